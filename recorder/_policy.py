"""Which full tensors a step stores: persist, ring, dump and ``max_bytes``.

A pure policy: no threads, no store, no warnings issued (it returns them as
``Notice``s).  The writer thread runs it once per step record, in step order.

- A step whose plan persists stores its own full tensors.
- ``ring``: the full tensors of the last ``ring`` steps not stored are held.
- A non-finite value under ``dump``/``raise``/``replay`` stores the ring's steps
  and the step's own (the ring is then emptied: each tensor is stored once).
- ``max_bytes``: past that many bytes of full tensors in all, rows are counted
  (``over``) instead of stored.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ._config import RecorderConfig
from ._worker import Notice

__all__ = ["Choice", "TensorPolicy"]

GUARD_BYTES_PER_100 = 1 << 30  # warn when full tensors would pass this every 100 steps
DUMPING = ("dump", "raise", "replay")


@dataclass
class Choice:
    """What to store now, as (step, rows); the rows past ``max_bytes``; notices."""
    tensors: list = field(default_factory=list)
    over: int = 0
    notices: list[Notice] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(rows) for _, rows in self.tensors)


class TensorPolicy:
    def __init__(self, config: RecorderConfig, stored_bytes: int = 0):
        self.config = config
        self.used = stored_bytes                 # bytes of full tensors stored, for max_bytes
        self.estimated = stored_bytes > 0
        # the full tensors of the steps before (None: already stored), dumped on a NaN/Inf
        self.ring: collections.deque = collections.deque(maxlen=config.ring or None)

    def choose(self, step: int, plan, rows: list, nonfinite: bool) -> Choice:
        """The rows of ``step`` (its plan, its full-tensor rows, whether it held a
        NaN/Inf) -> what to store now.  A step not stored goes into the ring."""
        out = Choice()
        if plan is None:
            return out
        cfg = self.config
        dump = nonfinite and cfg.on_nonfinite in DUMPING
        if dump:
            out.tensors = [(s, r) for s, r in self.ring if r]
            self.ring = collections.deque(((s, None) for s, _ in self.ring), maxlen=self.ring.maxlen)
        stored = plan.persist or dump
        if stored and rows:
            out.tensors.append((step, rows))
            if plan.persist and not self.estimated:
                self.estimated = True
                out.notices.extend(self._estimate(rows))
        if cfg.ring:
            if not stored:
                for row in rows:                 # the ring lives in ordinary host memory
                    row.snap.unpin()
            self.ring.append((step, None if stored else rows))
        if cfg.max_bytes is not None:
            self._within_budget(out)
        return out

    def _estimate(self, rows: list) -> list[Notice]:
        """At the first persisted step: a notice if full tensors would fill disks."""
        cfg = self.config
        nbytes = sum(r.snap.nbytes for r in rows)
        per_100 = nbytes * 100 / (cfg.tensors_every or 1)
        if per_100 <= GUARD_BYTES_PER_100 or cfg.max_bytes is not None:
            return []
        return [Notice("estimate", (
            f"tensortape: full tensors take {nbytes / 1e6:.0f} MB a step here, "
            f"{per_100 / 1e9:.1f} GB every 100 steps; record fewer with tensors_every= "
            f"(now {cfg.tensors_every}), layers= or max_samples=, or cap them with "
            f"max_bytes= (statistics are kept whatever you choose)"))]

    def _within_budget(self, out: Choice) -> None:
        limit = self.config.max_bytes
        kept = []
        for step, rows in out.tensors:
            mine = []
            for row in rows:
                if self.used + row.snap.nbytes <= limit:
                    self.used += row.snap.nbytes
                    mine.append(row)
                    continue
                out.over += 1
                row.snap.release()
                if not any(n.key == "budget" for n in out.notices):
                    out.notices.append(Notice("budget", (
                        f"tensortape: max_bytes={limit} of full tensors reached at step {step}; "
                        f"from now on only statistics are recorded (tensors not stored are "
                        f"counted)")))
            kept.append((step, mine))
        out.tensors = kept
