"""Which full tensors a step stores: persist, ring, dump and ``max_bytes``.

A pure policy: no threads, no store, no warnings issued (it returns them as
``Notice``s).  The writer thread runs it once per step record, in step order.

- A step whose plan persists stores its own full tensors.
- ``ring``: the full tensors of the last ``ring`` steps not stored are held.
- A non-finite value under ``dump``/``raise``/``replay`` stores the ring's steps
  and the step's own (the ring is then emptied: each tensor is stored once).
- ``max_bytes`` (resolved to bytes, ``_budget``): past that many bytes of full
  tensors in all, the rows a step persists are not stored.  They are counted
  (``over``: ``over_budget``, ``_overbudget``) once they are lost for good: at
  once with no ring, else when their step leaves the ring undumped, or at
  ``close``; a dump stores them.  A non-finite dump is always stored (it is
  what the budget keeps room for), and counts towards the budget.  At the
  first persisted step, one notice
  projects the size per 100 steps when the budget would be reached within
  ``SOON`` steps (or, with no budget, when that size passes ``GUARD_BYTES_PER_100``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .._config import DUMPING, RecorderConfig
from ._worker import Notice
from ..errors import argument

__all__ = ["Choice", "TensorPolicy"]

GUARD_BYTES_PER_100 = 1 << 30  # no budget: warn when full tensors would pass this every 100 steps
SOON = 1000                    # a budget: warn when it would be reached within this many steps


@dataclass
class Choice:
    """What to store now, as (step, rows); the rows a step persisted that are now
    lost past ``max_bytes``, as (step, count); notices."""
    tensors: list = field(default_factory=list)
    over: list = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(rows) for _, rows in self.tensors)


class TensorPolicy:
    def __init__(self, config: RecorderConfig, stored_bytes: int = 0):
        self.config = config
        # max_bytes as the Recorder resolved it (``_budget``; None: no budget)
        self.limit = config.max_bytes if isinstance(config.max_bytes, int) else None
        self.used = stored_bytes                 # bytes of full tensors stored, for max_bytes
        self.estimated = stored_bytes > 0
        self.spent = False                       # the budget's notice was given
        # the last steps' full tensors not stored, dumped on a NaN/Inf: (step, rows or None,
        # how many of them the step persisted: past the budget, counted if never dumped)
        self.ring: collections.deque = collections.deque()

    def choose(self, step: int, plan, rows: list, nonfinite: bool) -> Choice:
        """The rows of ``step`` (its plan, its full-tensor rows, whether it held a
        NaN/Inf) -> what to store now.  A step not stored goes into the ring."""
        out = Choice()
        if plan is None:
            return out
        cfg = self.config
        dump = nonfinite and cfg.dumps
        if dump:
            out.tensors = [(s, r) for s, r, _ in self.ring if r]
            self.ring = collections.deque((s, None, 0) for s, _, _ in self.ring)
        stored = plan.persist or dump
        if plan.persist and rows and not self.estimated:
            self.estimated = True
            out.notices.extend(self._estimate(rows))
        left = []                               # rows past the budget
        if stored and rows:
            if plan.persist and not dump and self.limit is not None:
                left = self._within_budget(out, step, rows)
            else:
                out.tensors.append((step, rows))
        if dump and self.limit is not None:     # a dump is always stored, and counted
            self.used += sum(r.snap.nbytes for _, done in out.tensors for r in done)
        if cfg.ring:                            # past the budget, a dump may still store them
            held = left if stored else rows
            for row in held:                     # the ring lives in ordinary host memory
                row.snap.unpin()
            if len(self.ring) == cfg.ring:
                self._lose(out, *self.ring.popleft())
            self.ring.append((step, held or None, len(left)))
        else:
            for row in left:
                row.snap.release()
            self._lose(out, step, left, len(left))
        return out

    def close(self) -> list:
        """The end of the recording: the ring's rows are never stored; the due ones,
        as (step, count)."""
        out = Choice()
        while self.ring:
            self._lose(out, *self.ring.popleft())
        return out.over

    @staticmethod
    def _lose(out: Choice, step: int, rows, due: int) -> None:
        if rows and due:
            out.over.append((step, due))

    def _estimate(self, rows: list) -> list[Notice]:
        """At the first persisted step: a notice if full tensors would soon reach the
        budget (or, with none, fill disks)."""
        cfg = self.config
        nbytes = sum(r.snap.nbytes for r in rows)
        every = cfg.tensors_every or 1
        per_100 = nbytes * 100 / every
        size = (f"tensortape: full tensors take {_size(nbytes)} a step here, "
                f"{_size(per_100)} every 100 steps")
        fewer = (f"record fewer with {argument('tensors_every')} (now {cfg.tensors_every}), "
                 f"{argument('layers')} or {argument('max_samples')}")
        if self.limit is None:
            if per_100 <= GUARD_BYTES_PER_100:
                return []
            return [Notice("estimate", f"{size}; {fewer}, or cap them with "
                                       f"{argument('max_bytes')} (statistics are kept whatever "
                                       f"you choose)")]
        left = self.limit - self.used
        steps = int(max(left, 0) // nbytes) * every if nbytes else None
        if steps is None or steps >= SOON:
            return []
        return [Notice("estimate", (
            f"{size}: {argument('max_bytes', self.limit)} ({_size(self.limit)}) is reached in "
            f"about {steps} "
            f"step{'' if steps == 1 else 's'}, and then only "
            f"statistics, histograms and the non-finite dump are stored; {fewer}, or raise "
            f"{argument('max_bytes')} ({argument('max_bytes', None)}: no budget)"))]

    def _within_budget(self, out: Choice, step: int, rows: list) -> list:
        """The rows ``step`` persists, as far as the budget goes; the rest returned."""
        mine, left = [], []
        for row in rows:
            if self.used + row.snap.nbytes <= self.limit:
                self.used += row.snap.nbytes
                mine.append(row)
                continue
            left.append(row)
            if not self.spent:
                self.spent = True
                out.notices.append(Notice("budget", (
                    f"tensortape: {argument('max_bytes', self.limit)} ({_size(self.limit)}) of full "
                    f"tensors reached at "
                    f"step {step}; "
                    f"from now on only statistics, histograms and the non-finite dump are "
                    f"stored (tensors not stored are counted in over_budget)")))
        if mine:
            out.tensors.append((step, mine))
        return left


def _size(n: float) -> str:
    if n < 1e5:
        return f"{int(n)} byte{'' if n == 1 else 's'}"
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
