"""The ranks of a job decide together: rank 0's outcome is every rank's.

``rank0_decides`` runs a decision on rank 0 (the mode and what is at the path
at construction, the claim and the new root at attach) and hands its outcome,
a refusal included, to every rank before any rank goes on: every rank raises
the same error, and none opens what rank 0 refused.  ``all_agree`` then
gathers every rank's own outcome (each opens its part of the run), so that a
rank that failed fails the job on every rank instead of leaving the others to
wait for it in the next collective.  Outside ``torch.distributed`` both are
plain calls.

An error crosses to the other ranks as its class name and message: one of
``errors``' classes is raised as itself, anything else as a ``RecorderError``
that names it and the rank it came from (no pickle of an arbitrary object).

Training thread, at a Recorder's construction and attach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .. import errors

__all__ = ["all_agree", "rank0_decides", "rank_and_world"]

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world's size (0 and 1 outside torch.distributed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _portable(e: BaseException | None) -> tuple[str, str] | None:
    return None if e is None else (type(e).__name__, str(e))


def _rebuilt(told: tuple[str, str], rank: int) -> Exception:
    name, text = told
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.RecorderError):
        return cls(text)
    return errors.RecorderError(f"rank {rank} could not open the run: {name}: {text}")


def rank0_decides(decide: Callable[[], tuple[T, str]], rank: int,
                  world: int) -> tuple[T | None, str]:
    """``decide()`` on rank 0, which returns a result and a word for every rank:
    the result on rank 0 (None on the others) and the word on every rank; or
    rank 0's error, raised on every rank once every rank has it."""
    result, word, error = None, "", None
    if rank == 0:
        try:
            result, word = decide()
        except Exception as e:
            error = e
    if world > 1:
        box = [(_portable(error), word)]
        torch.distributed.broadcast_object_list(box, src=0)
        told, word = box[0]
        if rank != 0 and told is not None:
            raise _rebuilt(told, 0)
    if error is not None:
        raise error
    return result, word


def all_agree(error: BaseException | None, rank: int, world: int) -> None:
    """Raise on every rank the first error any rank had (``error``: this rank's)."""
    if world > 1:
        told: list = [None] * world
        torch.distributed.all_gather_object(told, _portable(error))
        first = next((r for r, t in enumerate(told) if t is not None), None)
        if first is not None and first != rank:
            raise _rebuilt(told[first], first)
    if error is not None:
        raise error
