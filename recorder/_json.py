"""JSON both ways for the schema (``format``): a JSON-safe copy of what is
written (``to_json``), and the strict readers of what is read back, each
raising ``TypeError`` or ``ValueError`` for a value of the wrong type (the
caller turns it into ``StoreFormatError``).  No state; any thread.
"""

from __future__ import annotations

import json

__all__ = ["integer", "object_or_none", "step_run", "strings", "to_json"]


def _plain(obj):
    if hasattr(obj, "tolist"):          # numpy and torch scalars and arrays
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def to_json(obj):
    """A JSON-safe copy of ``obj``; numpy and torch scalars become plain numbers
    (``TypeError`` for other objects)."""
    return json.loads(json.dumps(obj, allow_nan=False, default=_plain))


def integer(v) -> int:
    """``v``, a whole number (a float such as 3.0 too, never a bool), as an int."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise TypeError(f"{v!r} is not an integer")
    return int(v)


def object_or_none(v) -> dict | None:
    """``v``, a JSON object or null."""
    if v is not None and not isinstance(v, dict):
        raise TypeError(f"{v!r:.40} is not an object")
    return v


def step_run(v) -> list[int]:
    """``v``, a run of steps ``[recording, first, last, stride]`` (``format.note_step``)."""
    recording, first, last, stride = (integer(x) for x in v)
    if first > last or stride < 0:
        raise ValueError(f"{v!r:.60} is not a run of steps")
    return [recording, first, last, stride]


def strings(v) -> list[str]:
    """``v``, a list of names."""
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise TypeError(f"{v!r:.60} is not a list of names")
    return list(v)
