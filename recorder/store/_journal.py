"""What a rank has committed, and what it has not yet: the writer's memory for a
new start after a fault.  Runs on the writer thread only.

The store's commit protocol (data first, counters after) makes the last commit
a safe place to start again from.  The journal keeps that commit's state and,
since it, every step's rows but its full tensors (``Unsaved``: statistics,
events, the NaN/Inf counts of a step without statistics, new names and
counters), bounded in bytes and in records: past either bound a step's
statistics and NaN/Inf counts, and events beyond the stored maximum, are
counted instead of kept.  Once the job's claim is lost (``lose``), nothing is
kept: the steps not committed then and every later one are counted in
``Unstored``, in memory only, since the store may no longer be written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..writer import _overbudget
from .. import format as fmt

__all__ = ["Journal", "Unsaved", "Unstored"]

BACKLOG_BYTES = 256 << 20      # statistics kept in memory while the store cannot be written
BACKLOG_RECORDS = 100_000      # steps kept so
EVENT_BYTES = 160              # a rough size of one kept event, and of a record's own fields
RECORD_BYTES = 256


@dataclass
class Unsaved:
    """One step's rows not committed yet, as kept for a new start: everything but
    its full tensors, of which only the count is kept."""
    step: int | None            # None: the close record's counts (no step of its own)
    layers: list[str]
    drops: dict[str, int]
    outside: int
    events: list
    stats: dict                 # kind -> StatsRows
    bundle: tuple | None = None
    tensors: int = 0            # full-tensor rows stored (lost again at a new start)
    over_budget: list = field(default_factory=list)   # due rows lost past max_bytes, as
                                        # ``_overbudget`` runs (some of earlier steps)
    events_total: int | None = None     # non-finite captures (None: those in ``events``)
    earlier: list = field(default_factory=list)   # the steps merged into this one past the
                                        # bounds, as ``fmt.note_step`` runs (recording 0)
    scalars: list = field(default_factory=list)   # rec.log's: (step, names, values)
    counts: dict = field(default_factory=dict)    # a step without statistics: its NaN/Inf
                                        # counts (``Resolved.counts``)
    captures: int = 0           # what ``dropped`` counts of it if it is never stored

    def __post_init__(self):
        if self.events_total is None:
            self.events_total = len(self.events)

    @property
    def rows(self) -> int:
        return sum(len(r.layers) for r in self.stats.values())

    @property
    def count_rows(self) -> int:
        return sum(len(c) for c in self.counts.values())

    @property
    def nbytes(self) -> int:
        return (RECORD_BYTES + EVENT_BYTES * (len(self.events) + self.count_rows)
                + sum(r.hist.nbytes + 8 * len(r.stats) * len(r.layers) for r in self.stats.values()))

    def merged(self, later: "Unsaved") -> "Unsaved":
        """This lean record and a later lean one as one (past the bound in records)."""
        drops = dict(self.drops)
        for k, n in later.drops.items():
            drops[k] = drops.get(k, 0) + n
        return replace(later, layers=self.layers + later.layers, drops=drops,
                       outside=self.outside + later.outside, tensors=self.tensors + later.tensors,
                       captures=self.captures + later.captures,
                       over_budget=_overbudget.runs(_overbudget.each(later.over_budget),
                                                    into=self.over_budget),
                       events_total=self.events_total + later.events_total,
                       earlier=self._steps_before(later))

    def _steps_before(self, later: "Unsaved") -> list:
        runs = [list(r) for r in self.earlier]
        if self.step is not None:
            fmt.note_step(runs, 0, self.step)
        return runs + [list(r) for r in later.earlier]

    def lean(self, reason: str) -> "Unsaved":
        """Past the backlog's bounds: statistics and kept events counted, not kept
        (the bundle too: its event is gone)."""
        drops = dict(self.drops)
        n = self.rows + self.count_rows + sum(len(names) for _, names, _ in self.scalars)
        if n:
            drops[reason] = drops.get(reason, 0) + n
        return replace(self, drops=drops, events=[], stats={}, bundle=None, scalars=[], counts={})


@dataclass
class Unstored:
    """What this job could not commit because its claim was lost: the steps (how
    many, the first and the last) and their captures (``dropped``'s unit)."""
    captures: int = 0
    steps: int = 0
    first: int | None = None
    last: int | None = None

    def add(self, u: Unsaved) -> None:
        self.captures += u.captures
        own = [] if u.step is None else [[0, u.step, u.step, 0]]
        for _, first, last, stride in [*u.earlier, *own]:
            self.steps += (last - first) // (stride or 1) + 1
            self.first = first if self.first is None else min(self.first, first)
            self.last = last if self.last is None else max(self.last, last)

    def words(self) -> str:
        """The steps, in words (``"3 steps (steps 3 to 5)"``)."""
        if self.steps == 1:
            return f"1 step (step {self.first})"
        return f"{self.steps} steps (steps {self.first} to {self.last})"


class Journal:
    def __init__(self, state: fmt.RankState):
        self.saved = self._copy(state)       # as last committed
        self.unsaved: list[Unsaved] = []
        self.kept = 0                         # their bytes
        self.overflow = False                 # the last one holds every step past the bounds
        self.last_committed_step = state.last_step
        self.unstored: Unstored | None = None     # once the claim is lost (``lose``)

    @staticmethod
    def _copy(state: fmt.RankState) -> fmt.RankState:
        return fmt.RankState.from_json(state.to_json())

    def full(self, more: Unsaved) -> bool:
        return (self.kept + more.nbytes > BACKLOG_BYTES
                or len(self.unsaved) + 1 > BACKLOG_RECORDS)

    def keep(self, u: Unsaved, reason: str) -> Unsaved | None:
        """Remember ``u`` until the next commit; past the bounds lean, and merged
        into one record with the others past them (memory stays bounded); it.
        Once the claim is lost, ``u`` is counted as unstored instead (None)."""
        if self.unstored is not None:
            self.unstored.add(u)
            return None
        if self.full(u):
            u = u.lean(reason)
            if self.overflow:
                self.kept -= self.unsaved[-1].nbytes
                u = self.unsaved[-1] = self.unsaved[-1].merged(u)
                self.kept += u.nbytes
                return u
            self.overflow = True
        self.unsaved.append(u)
        self.kept += u.nbytes
        return u

    def lose(self) -> None:
        """The claim is lost: the steps since the last commit, and every later one,
        are never committed (``unstored``)."""
        if self.unstored is None:
            self.unstored = Unstored()
            for u in self.unsaved:
                self.unstored.add(u)
            self.unsaved, self.kept, self.overflow = [], 0, False

    def committed(self, state: fmt.RankState) -> None:
        self.saved = self._copy(state)
        self.unsaved, self.kept, self.overflow = [], 0, False
        self.last_committed_step = state.last_step

    def start_again(self) -> tuple[fmt.RankState, list[Unsaved]]:
        """The last committed state (a copy) and the steps to write again."""
        return self._copy(self.saved), list(self.unsaved)

    def pending_rows(self) -> tuple[int, int]:
        """Steps and statistics rows not committed."""
        return len(self.unsaved), sum(u.rows for u in self.unsaved)
