"""The thread contract: what crosses from the training thread to the writer thread.

The training thread builds a ``StepRecord`` when a step ends (``_buffer``)
and hands it to the writer (``Writer.put``); from then on the writer thread
owns it, and the training thread keeps no reference to it, except:

- ``on_nonfinite="raise"`` and ``"replay"`` call ``StepRecord.resolve`` on the
  training thread before handing the record on (they need the step's events
  at once); the writer then finds it resolved.  ``resolve`` runs once, on one
  thread at a time.

What a record holds:

- ``plan``: what the step did with its captures (``Plan``, immutable);
- ``metas`` and ``blocks``: each capture, and where its vector sits in the
  step's ``Packed`` vectors (none for a count only); a ``Block`` says what
  its vectors hold (``Holds``), never its width;
- ``packed``: the step's vectors, their copies to the host started on the
  training thread (a pinned buffer and an event on CUDA); ``Packed.host``
  waits for them, on the writer thread.  A part may be vectors not made yet
  (a ``Deferred``: copies of CPU tensors whose kernels were compiling, ``held``
  bytes); ``Packed.host`` makes them there, on the writer thread, waiting for
  the kernels until ``hurry`` says the writer is needed elsewhere;
- ``tensors``: the full tensors kept (``Snapshot``: the writer gives their
  pinned slots back once stored);
- ``drops``, ``outside``: what was counted, not recorded;
- ``scalars``: what ``rec.log`` logged (``_scalars.Logged``: numbers, and the
  tensors' values copying to the host like ``packed``).

When the recording closes, what was counted since the last step record goes
as a ``CloseRecord``: drops and passes outside a step, no step of its own.

``resolve`` (``_resolve``) turns the packed vectors into ``Resolved``:
statistics per kind (``StatsRows``) and non-finite events.  It runs on the
writer thread, but for the two policies above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .. import format as fmt
from .._config import RecorderConfig
from ..capture._snapshot import Snapshot
from ..capture._summary import Holds, combine, moments

__all__ = ["Block", "CloseRecord", "Deferred", "Meta", "Packed", "Plan", "Resolved", "StatsRows",
           "StepRecord", "TensorRow"]


@dataclass(frozen=True)
class Plan:
    """What a step does with each capture, decided once when it begins."""
    step: int
    stats: bool                  # statistics and histograms (else: exact NaN/Inf counts)
    persist: bool                # full tensors are stored
    keep: bool                   # full tensors are snapshotted (persisted, or for the ring)

    @classmethod
    def at(cls, config: RecorderConfig, step: int) -> "Plan":
        persist = config.persists(step)
        keep = persist or config.dumps          # a ring implies a dump (``_config``)
        return cls(step, config.stats_at(step), persist, keep)


class Meta(Protocol):
    """A capture as the record keeps it: which row of which block holds its vector
    (``block`` None: none, its element count is all).  The step's own captures
    (``_summarizer.Taken``, packed): no second object per capture."""
    order: int
    kind: str
    name: str
    micro: int
    numel: int
    block: int | None
    row: int


@dataclass(frozen=True)
class Block:
    """A (rows x width) matrix of a step's vectors, as one engine call or one stack
    made them: what they hold, and where it starts in the packed host vector."""
    holds: Holds
    rows: int
    width: int
    start: int


@dataclass
class StatsRows:
    """One kind's statistics of a step: a row per layer."""
    layers: list[str]
    stats: dict[str, np.ndarray]
    hist: np.ndarray


@dataclass(slots=True)
class TensorRow:
    """A full tensor kept: stored by the writer, or held by its ring."""
    kind: str
    layer: str
    micro: int
    snap: Snapshot


class Deferred:
    """A part of ``Packed`` whose vectors the writer thread makes (``_summarizer.Later``),
    from copies of ``nbytes``."""
    nbytes = 0

    def host(self, hurry: Callable[[], bool]):
        """The vectors, flat, float64 (a tensor); ``hurry``: whether to stop waiting
        for kernels still compiling."""
        raise NotImplementedError


class Packed:
    """A step's vectors, packed per device, on their way to the host."""

    def __init__(self, parts: list):
        self._parts = parts            # a float64 host copy per device (a ``Snapshot``),
        # or a ``Deferred``: the copies it holds
        self.held = sum(p.nbytes for p in parts if isinstance(p, Deferred))

    def host(self, hurry: Callable[[], bool] = lambda: False) -> np.ndarray:
        """Every vector, on the host (waits for the copies, and makes the deferred
        ones: the writer thread does; ``hurry`` as ``Deferred.host``)."""
        arrays = []
        for part in self._parts:
            if isinstance(part, Deferred):
                arrays.append(part.host(hurry).numpy())
            else:
                part.unpin()
                arrays.append(part.host().numpy())
        if len(arrays) == 1:           # one device (the common case): no copy
            return arrays[0]
        return np.concatenate(arrays) if arrays else np.zeros(0)


@dataclass
class Resolved:
    """A step record interpreted: statistics per kind, and its non-finite events;
    at a step without statistics, ``counts``: each kind's NaN/Inf counts per layer
    that held any, summed over its micro-batches (kind -> layer -> (nan, posinf,
    neginf))."""
    stats: dict[str, StatsRows] = field(default_factory=dict)
    events: list[fmt.NonFiniteEvent] = field(default_factory=list)
    counts: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class StepRecord:
    """A finished step, handed from the training thread to the writer."""
    step: int
    plan: Plan | None = None
    layers: list[str] = field(default_factory=list)          # new names, in capture order
    metas: list[Meta] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    packed: Packed | None = None
    tensors: list[TensorRow] = field(default_factory=list)
    drops: dict[str, int] = field(default_factory=dict)      # what was dropped, by reason
    outside: int = 0                                          # forward passes outside a step
    bundle: tuple | None = None          # on_nonfinite="replay": (group path, attrs, arrays)
    scalars: list = field(default_factory=list)              # rec.log's (``_scalars.Logged``)
    _resolved: Resolved | None = None

    @property
    def captures(self) -> int:
        """What ``dropped`` counts of this step if it is not stored: its captures and
        its logged scalars."""
        return len(self.metas) + sum(len(s.names) for s in self.scalars)

    @property
    def nbytes(self) -> int:
        held = self.packed.held if self.packed is not None else 0
        return held + sum(t.snap.nbytes for t in self.tensors)

    def resolve(self, hurry: Callable[[], bool] = lambda: False) -> Resolved:
        """Statistics and events from the packed vectors (once; waits for the copies;
        ``hurry`` as ``Deferred.host``)."""
        if self._resolved is None:
            self._resolved = _resolve(self, hurry)
            self.packed = None
        return self._resolved


@dataclass
class CloseRecord:
    """What was counted since the last step record, handed to the writer when the
    recording closes: no step of its own, no captures."""
    drops: dict[str, int] = field(default_factory=dict)      # what was dropped, by reason
    outside: int = 0                                          # forward passes outside a step
    layers: list[str] = field(default_factory=list)          # new names of a record not handed on
    nbytes: int = 0                                           # no full tensors
    scalars: list = field(default_factory=list)              # rec.log's since the last step


def _resolve(rec: StepRecord, hurry: Callable[[], bool]) -> Resolved:
    """The writer thread's work on a record (see the module): every capture with
    statistics is a row of ``moments``, the summary blocks' rows first, then a row
    for each capture without a vector (its element count).  One pass over the
    captures finds each one's row; the non-finite counts are read for all of them
    at once, and only captures holding NaN/Inf become events."""
    out = Resolved()
    metas, blocks = rec.metas, rec.blocks
    if not metas:
        return out
    flat = rec.packed.host(hurry) if rec.packed is not None else np.zeros(0)
    mats = [flat[b.start: b.start + b.rows * b.width].reshape(b.rows, b.width) for b in blocks]
    summary = [i for i, b in enumerate(blocks) if b.holds is Holds.SUMMARY]
    base, at = {}, 0
    for i in summary:
        base[i], at = at, at + blocks[i].rows
    position = [-1] * len(metas)         # each capture's row of ``moments`` (-1: none)
    counts: list[float] = []             # the element counts of captures without a vector
    nonfinite = []                       # captures whose vector is their NaN/Inf counts
    for i, meta in enumerate(metas):
        b = meta.block
        if b is None:
            position[i] = at + len(counts)
            counts.append(float(meta.numel))
        elif b in base:
            position[i] = base[b] + meta.row
        else:
            nonfinite.append(i)
    m, hist = moments([mats[i] for i in summary], counts)
    pos = np.array(position, dtype=np.int64)
    rows = np.flatnonzero(pos >= 0)
    bad = np.stack([m["nan"], m["posinf"], m["neginf"]], axis=1)[pos[rows]]
    found = [(int(rows[j]), bad[j]) for j in np.flatnonzero(bad.any(axis=1))]
    found += [(i, mats[metas[i].block][metas[i].row]) for i in nonfinite]
    for i, counted in found:
        n_nan, n_pos, n_neg = (int(v) for v in counted)
        if n_nan or n_pos or n_neg:
            meta = metas[i]
            out.events.append(fmt.NonFiniteEvent(
                rec.step, meta.name, meta.kind, n_nan, n_pos, n_neg, order=meta.order,
                phase="backward" if meta.kind in fmt.BACKWARD_KINDS else "forward",
                micro=meta.micro))
    out.events.sort(key=lambda e: e.sort_key)
    if not rec.plan.stats:
        for e in out.events:
            per_layer = out.counts.setdefault(e.kind, {})
            per_layer[e.layer] = per_layer.get(e.layer, 0) + np.array([e.nan, e.posinf, e.neginf])
        return out
    per_kind: dict[str, dict[str, list[int]]] = {}        # kind -> layer -> its rows
    for i in rows.tolist():
        meta = metas[i]
        per_kind.setdefault(meta.kind, {}).setdefault(meta.name, []).append(position[i])
    s = combine(m, hist, [r for layers in per_kind.values() for r in layers.values()])
    at = 0                                             # micro-batches: one row over all of them
    for kind, layers in per_kind.items():
        part = slice(at, at + len(layers))
        out.stats[kind] = StatsRows(list(layers), {k: v[part] for k, v in s.stats.items()},
                                    s.hist[part])
        at += len(layers)
    return out
