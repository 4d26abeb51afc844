"""``over_budget``: the full tensors due at a step that no reader can read for
``max_bytes``, counted per step.  The writer thread's.

A full tensor (one micro-batch's) is due at a step whose plan persists it
(``tensors_every``).  The policy (``_policy``) names those it did not store once
they are lost for good.  The rank state keeps their total (``over_budget``) and
where it was counted (``over_budget_at``): ``format.note_step`` runs ``[count,
first, last, stride]``, each of their steps with ``count`` tensors lost.  A step
that a later recording records again (``mode="a"``) is read from that recording
alone, so its count is taken back (``take_back``), and the new recording counts
its own.
"""

from __future__ import annotations

from .. import format as fmt

__all__ = ["count", "each", "runs", "take_back"]


def runs(pairs, into: list | None = None) -> list:
    """``(step, count)`` pairs as ``note_step`` runs (added to ``into``, a copy)."""
    out = [list(r) for r in into or ()]
    for step, n in pairs:
        fmt.note_step(out, n, step)
    return out


def each(at: list):
    """The ``(step, count)`` of each step of the runs ``at``."""
    for n, first, last, stride in at:
        for step in range(first, last + 1, stride or 1):
            yield step, n


def count(state: fmt.RankState, at: list) -> None:
    """Add the counts of the runs ``at`` to ``state``."""
    for step, n in each(at):
        state.over_budget += n
        fmt.note_step(state.over_budget_at, n, step)


def take_back(state: fmt.RankState, step: int) -> None:
    """``step`` is recorded again: an older recording's count there no longer holds."""
    kept, n = [], 0
    for run in state.over_budget_at:
        c, first, last, stride = run
        if not (first <= step <= last and (step - first) % (stride or 1) == 0):
            kept.append(run)
            continue
        n += c
        if step > first:
            before = step - stride
            kept.append([c, first, before, stride if before > first else 0])
        if step < last:
            after = step + stride
            kept.append([c, after, last, stride if after < last else 0])
    state.over_budget_at[:] = kept
    state.over_budget -= n
