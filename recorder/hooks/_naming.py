"""Which tensors a module's output or inputs hold, and their paths (see
``format.label`` and ``format.join`` for the recorded names).

Runs on the thread that calls it, with no state of its own: the training thread
(the hooks, the keeper) and the thread that replays a call."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["leaves", "input_leaves"]


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj`` with its dotted path; other leaves are skipped.

    Mappings (Hugging Face ``ModelOutput`` included) go by key, namedtuples
    and dataclasses by field name, sequences by index.
    """
    def sub(key) -> str:
        return f"{path}.{key}" if path else str(key)

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from leaves(v, sub(k))
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for k in obj._fields:
            yield from leaves(getattr(obj, k), sub(k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from leaves(v, sub(i))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), sub(f.name))


def input_leaves(args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Inputs of a call: a lone tensor argument is unnamed, others ``i`` / ``kw``."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor) and not any(
            True for _ in leaves(kwargs)):
        yield "", args[0]
        return
    yield from leaves(list(args))
    yield from leaves(dict(kwargs))
