"""Which code a frame belongs to, for a replay: the user's, a library's, torch's
dispatch machinery, or tensortape's own.

``caller`` names the user's line that is calling a module now (the keeper notes
it at each kept call: a frame walk, no traceback); ``line`` gives a (file, line)
as the event says it, with its code.  Training thread (``caller``) and the
replay's thread.
"""

from __future__ import annotations

import linecache
import os
import sys

import torch

__all__ = ["caller", "kind", "line"]

from .. import __file__ as _recorder_init

_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_RECORDER = os.path.dirname(os.path.abspath(_recorder_init))
_ROOT = os.path.dirname(_RECORDER)
# tensortape's own code, and what only calls on (never the user's line)
_OURS = (_RECORDER + os.sep, os.path.join(_ROOT, "analysis") + os.sep, os.path.join(_ROOT, "cli.py"))
# torch's frames that are dispatch machinery, not a line of a library's op
_MACHINERY = tuple(os.path.join(_TORCH, f) for f in (
    "_compile.py", "_dynamo" + os.sep, "utils" + os.sep + "_python_dispatch.py", "_ops.py",
    "overrides.py"))
_KINDS: dict[str, str] = {}


def kind(filename: str) -> str:
    """A code file as the replay sees it: "user", "library" (torch, transformers,
    anything installed), "machinery" (torch's dispatch) or "ours" (tensortape,
    contextlib)."""
    found = _KINDS.get(filename)
    if found is None:
        f = os.path.abspath(filename)
        if (f.startswith(_OURS) or f.endswith(os.sep + "contextlib.py")
                or filename.startswith("<frozen")):
            found = "ours"
        elif f.startswith(_MACHINERY):
            found = "machinery"
        elif (f.startswith(_TORCH) or os.sep + "site-packages" + os.sep in f
              or os.sep + "dist-packages" + os.sep in f):
            found = "library"
        else:
            found = "user"
        _KINDS[filename] = found
    return found


def caller() -> tuple[str, int] | None:
    """The user's line that is calling a module now: the innermost frame outside
    torch, the libraries and tensortape, as (file, line); cheap (no traceback)."""
    frame = sys._getframe(2)
    while frame is not None:
        if kind(frame.f_code.co_filename) == "user":
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def line(where: tuple[str, int] | None) -> tuple[str, str]:
    if not where:
        return "?", ""
    return f"{where[0]}:{where[1]}", linecache.getline(where[0], where[1]).strip()

