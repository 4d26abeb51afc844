"""From hook captures to step records: the training thread's side of the flow.

The hooks hand every captured tensor to ``StepBuffer.add``, which only
starts device work and appends a typed ``Capture`` (no host sync).  When the
step ends, ``StepBuffer.end`` interprets the step's captures in one place:
it brings every summary to the host at once, finds non-finite captures, and
returns the ``StepRecord``s to hand to the writer, the ring's dumped steps
first.  Nothing here writes or calls back.
"""

from __future__ import annotations

import collections
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from . import format as fmt
from ._config import RecorderConfig
from ._engines import engine_for
from ._snapshot import Snapshot
from ._summary import Summaries, exp_bits_of, finalize, merge
from .errors import InspectionError

__all__ = ["Capture", "StepBuffer", "StepRecord", "StatsRows", "TensorRow"]


# --- what a capture holds until the step ends ----------------------------------------
@dataclass(slots=True)
class Reduced:
    """A summary vector already under way on the device."""
    vec: torch.Tensor


@dataclass(slots=True)
class Deferred:
    """A tiny tensor, copied, summarised with the step's other tiny tensors."""
    tensor: torch.Tensor


@dataclass(slots=True)
class Probe:
    """Steps without statistics: a one-pass sum; if it is not finite, the
    source is summarised for exact NaN and Inf counts."""
    total: torch.Tensor
    source: torch.Tensor | Snapshot


@dataclass(slots=True)
class Capture:
    order: int
    kind: str
    name: str
    micro: int
    exp_bits: int
    summary: Reduced | Deferred | Probe | None
    snap: Snapshot | None


# --- what a step hands to the writer ---------------------------------------------------
@dataclass
class StatsRows:
    """One kind's statistics of a step: a row per layer."""
    layers: list[str]
    stats: dict[str, np.ndarray]
    hist: np.ndarray


@dataclass
class TensorRow:
    kind: str
    layer: str
    micro: int
    snap: Snapshot


@dataclass
class StepRecord:
    step: int
    layers: list[str] = field(default_factory=list)          # new names, in capture order
    stats: dict[str, StatsRows] = field(default_factory=dict)
    tensors: list[TensorRow] = field(default_factory=list)
    events: list[fmt.NonFiniteEvent] = field(default_factory=list)
    dropped: int = 0                                          # late gradients since the last record
    outside: int = 0                                          # forward passes outside a step, too
    over_budget: int = 0                                      # full tensors past max_bytes

    @property
    def nbytes(self) -> int:
        return sum(t.snap.nbytes for t in self.tensors)


class StepBuffer:
    """The captures of the open step, and the ring of recent steps."""

    def __init__(self, config: RecorderConfig, known_layers: list[str], persisted: int = 0):
        self.config = config
        self.step: int | None = None
        self.token: object | None = None
        self._captures: list[Capture] = []
        self._lock = threading.Lock()          # backward hooks may run on autograd threads
        self._known = dict.fromkeys(known_layers)
        self._new: list[str] = []
        self._ring: collections.deque = collections.deque(maxlen=config.ring or None)
        self._dropped = 0
        self.dropped_total = 0
        self.captured = 0                       # captures of the last step ended
        self._warned_dropped = False
        self.paused = 0                         # nesting of rec.pause()
        self.micro = 0                          # the open step's current micro-batch
        self._passes = 0                        # forward passes of the open step
        self._outside = 0
        self.outside_total = 0
        self._warned_outside = False
        self.persisted = persisted              # bytes of full tensors stored in this run
        self._estimated = self._warned_budget = False

    def begin(self, step: int) -> None:
        self.step, self.token = step, object()
        self._captures = []
        self.micro = self._passes = 0

    # --- hook side: start device work, append a typed record ---------------------------
    def current_token(self) -> object | None:
        """The open step's token; None outside a step or while paused (nothing is
        recorded then)."""
        return None if self.paused else self.token

    def begin_pass(self) -> None:
        """The recorded model's forward begins: a new micro-batch of the open step,
        or a forward pass outside any step (counted, and handled by ``outside_step``)."""
        if self.paused:
            return
        if self.token is not None:
            self.micro, self._passes = self._passes, self._passes + 1
            return
        self._outside += 1
        self.outside_total += 1
        policy = self.config.outside_step
        if policy == "raise":
            raise InspectionError(
                "the recorded model ran outside a step; wrap forward and backward in "
                "`with rec.step():`, or wrap evaluation in `with rec.pause():`, or pass "
                "outside_step='warn' or 'ignore'")
        if policy == "warn" and not self._warned_outside:
            self._warned_outside = True
            warnings.warn("tensortape: the recorded model ran outside a step (an evaluation "
                          "loop?); such passes are not recorded, only counted. Wrap training "
                          "steps in `with rec.step():`; pass outside_step='ignore' to silence "
                          "this", stacklevel=4)

    def add(self, kind: str, name: str, tensor: torch.Tensor, token: object) -> None:
        if token is None:                   # outside a step or paused: not recorded
            return
        if token is not self.token or self.step is None:
            self._drop(name)
            return
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()          # a sharded DTensor (FSDP2): this rank's shard
        cfg, step = self.config, self.step
        keep = cfg.persists(step) or cfg.ring > 0 or cfg.on_nonfinite != "record"
        snap = Snapshot(tensor, cfg.max_samples, cfg.tensor_dtype) if keep else None
        exp_bits = exp_bits_of(tensor)
        engine = engine_for(tensor)
        summary: Reduced | Deferred | Probe | None
        if cfg.stats_at(step):
            summary = Deferred(tensor.detach().clone()) if engine.is_small(tensor) \
                else Reduced(engine.reduce(tensor))
        elif exp_bits:
            exact = snap is not None and cfg.max_samples is None and cfg.tensor_dtype is None
            summary = Probe(tensor.detach().sum().reshape(1).to(torch.float64),
                            snap if exact else tensor.detach())
        else:
            summary = None
        with self._lock:
            self._captures.append(Capture(len(self._captures), kind, name, self.micro, exp_bits,
                                          summary, snap))
            if name not in self._known:
                self._known[name] = None
                self._new.append(name)

    def _drop(self, name: str) -> None:
        self._dropped += 1
        self.dropped_total += 1
        if not self._warned_dropped:
            self._warned_dropped = True
            warnings.warn(f"tensortape: the gradient of {name!r} arrived after its step ended and "
                          f"was dropped; run backward inside the step (`with rec.step(): ...`)",
                          stacklevel=3)

    # --- end of step: interpret the captures in one place ---------------------------------
    def end(self) -> list[StepRecord]:
        """Close the step; the records to hand to the writer, oldest first."""
        step, cfg = self.step, self.config
        self.step = self.token = None
        with self._lock:
            caps, self._captures = self._captures, []
            new, self._new = self._new, []
        self.captured = len(caps)
        caps.sort(key=lambda c: (c.kind in fmt.BACKWARD_KINDS, c.order))
        rec = StepRecord(step, layers=new, dropped=self._dropped, outside=self._outside)
        self._dropped = self._outside = 0
        self._summarise(caps, rec)
        persist = cfg.persists(step)
        dump = bool(rec.events) and cfg.on_nonfinite in ("dump", "raise")
        out = []
        if dump:
            out = [StepRecord(s, tensors=self._rows(old)) for s, old in self._ring if old]
            self._ring = collections.deque(((s, None) for s, _ in self._ring), maxlen=self._ring.maxlen)
        if persist or dump:
            rec.tensors = self._rows(caps)
        if cfg.ring:
            self._ring.append((step, None if (persist or dump) else caps))
        out.append(rec)
        if persist and rec.tensors and not self._estimated:
            self._estimate(rec)
        if cfg.max_bytes is not None:
            for r in out:
                self._budget(r)
        return [r for r in out if r.stats or r.tensors or r.events or r.layers or r.dropped
                or r.outside or r.over_budget]

    GUARD_BYTES_PER_100 = 1 << 30       # warn when full tensors would pass this every 100 steps

    def _estimate(self, rec: StepRecord) -> None:
        """At the first persisted step: warn once if full tensors would fill disks."""
        self._estimated = True
        per_100 = rec.nbytes * 100 / (self.config.tensors_every or 1)
        if per_100 > self.GUARD_BYTES_PER_100 and self.config.max_bytes is None:
            warnings.warn(
                f"tensortape: full tensors take {rec.nbytes / 1e6:.0f} MB a step here, "
                f"{per_100 / 1e9:.1f} GB every 100 steps; record fewer with tensors_every= "
                f"(now {self.config.tensors_every}), layers= or max_samples=, or cap them with "
                f"max_bytes= (statistics are kept whatever you choose)", stacklevel=4)

    def _budget(self, rec: StepRecord) -> None:
        """Past ``max_bytes`` of full tensors, rows are counted instead of stored."""
        keep = []
        for row in rec.tensors:
            if self.persisted + row.snap.nbytes <= self.config.max_bytes:
                self.persisted += row.snap.nbytes
                keep.append(row)
            else:
                rec.over_budget += 1
                if not self._warned_budget:
                    self._warned_budget = True
                    warnings.warn(f"tensortape: max_bytes={self.config.max_bytes} of full "
                                  f"tensors reached at step {rec.step}; from now on only "
                                  f"statistics are recorded (tensors not stored are counted)",
                                  stacklevel=4)
        rec.tensors = keep

    def pending_record(self) -> StepRecord | None:
        """What was counted since the last record, outside any step (at close)."""
        if not (self._dropped or self._outside):
            return None
        rec = StepRecord(-1, dropped=self._dropped, outside=self._outside)
        self._dropped = self._outside = 0
        return rec

    def clear(self) -> None:
        self._ring.clear()
        self._captures = []

    @staticmethod
    def _rows(caps: list[Capture]) -> list[TensorRow]:
        return [TensorRow(c.kind, c.name, c.micro, c.snap) for c in caps if c.snap is not None]

    def _summarise(self, caps: list[Capture], rec: StepRecord) -> None:
        """Every summary to the host at once; statistics per kind; events."""
        deferred = [c for c in caps if isinstance(c.summary, Deferred)]
        by_engine: dict = {}
        for c in deferred:
            by_engine.setdefault(engine_for(c.summary.tensor), []).append(c)
        for engine, group in by_engine.items():
            for c, vec in zip(group, engine.reduce_many([c.summary.tensor for c in group])):
                c.summary = Reduced(vec)
        on_device = [c for c in caps if isinstance(c.summary, (Reduced, Probe))]
        host = _to_host([c.summary.vec if isinstance(c.summary, Reduced) else c.summary.total
                         for c in on_device])
        stats_caps, vecs, exps = [], [], []
        for c, vec in zip(on_device, host):
            if isinstance(c.summary, Probe):
                if np.isfinite(vec[0]):
                    continue
                src = c.summary.source            # rare: summarised for exact counts
                src = src.host() if isinstance(src, Snapshot) else src
                vec = engine_for(src).reduce(src).cpu().numpy()
            stats_caps.append(c)
            vecs.append(vec)
            exps.append(c.exp_bits)
        per_kind: dict[str, dict[str, list[int]]] = {}      # kind -> layer -> rows of vecs
        for i, c in enumerate(stats_caps):
            if isinstance(c.summary, Reduced):
                per_kind.setdefault(c.kind, {}).setdefault(c.name, []).append(i)
        singles = finalize(vecs, exps) if vecs else None
        for i, c in enumerate(stats_caps):
            bad = singles.nonfinite(i)
            if any(bad):
                rec.events.append(fmt.NonFiniteEvent(
                    rec.step, c.name, c.kind, *bad, order=c.order,
                    phase="backward" if c.kind in fmt.BACKWARD_KINDS else "forward",
                    micro=c.micro))
            c.summary = None
        rec.events.sort(key=lambda e: e.sort_key)
        for kind, layers in per_kind.items():
            if all(len(rows) == 1 for rows in layers.values()):
                rows = [r[0] for r in layers.values()]
                s = Summaries({k: v[rows] for k, v in singles.stats.items()}, singles.hist[rows])
            else:                        # micro-batches: one summary over all of them
                merged, widths = [], []
                for rows in layers.values():
                    e = exps[rows[0]]
                    same = [r for r in rows if exps[r] == e]
                    merged.append(merge([vecs[r] for r in same], e))
                    widths.append(e)
                s = finalize(merged, widths)
            rec.stats[kind] = StatsRows(list(layers), s.stats, s.hist)

def _to_host(parts: list[torch.Tensor]) -> list[np.ndarray]:
    """Device vectors on the host, with one copy (one sync) per device."""
    by_device: dict = {}
    for i, p in enumerate(parts):
        by_device.setdefault(p.device, []).append(i)
    out: list = [None] * len(parts)
    for idx in by_device.values():
        flat = torch.cat([parts[i] for i in idx]).cpu().numpy()
        pos = 0
        for i in idx:
            n = parts[i].numel()
            out[i], pos = flat[pos: pos + n], pos + n
    return out
