"""From hook captures to step records: the training thread's side of the flow.

The hooks hand every captured tensor to ``StepBuffer.add``.  It follows the
step's ``Plan`` (decided once, when the step begins): it starts the tensor's
summary on its device (the statistics, or at a step without statistics the
exact NaN/Inf counts), takes a snapshot when the step keeps full tensors, and
appends a typed ``Capture``.  Nothing there waits for a device or keeps a
reference to the user's tensor.

When the step ends, ``StepBuffer.end`` batches the step's tiny tensors, packs
every summary vector of a device into one, starts its copy to the host, and
returns a ``StepRecord``.  The record is interpreted later, off the training
thread (``StepRecord.resolve``: statistics, histograms, events), by the writer;
only ``on_nonfinite="raise"`` resolves it at once, on the training thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from . import format as fmt
from ._config import RecorderConfig
from ._engines import Engines
from ._quiet import holding, warn
from ._replay import Keeper
from ._snapshot import Snapshot, Stager, unstorable
from ._summary import combine, empty_summary, exp_bits_of, moments, widened
from .errors import InspectionError

__all__ = ["Capture", "Plan", "StepBuffer", "StepRecord", "StatsRows", "TensorRow"]

SMALL = 1 << 13                # float elements below which a tensor waits for the step's batch
LATE_GRADIENT = "gradient arrived after its step"


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
        keep = persist or config.ring > 0 or config.on_nonfinite != "record"
        return cls(step, config.stats_at(step), persist, keep)


# --- what a capture holds until the step ends ------------------------------------------
SUMMARY, COUNTED, DEFERRED, COUNT_ONLY = "summary", "counted", "deferred", "count"


@dataclass(slots=True)
class Capture:
    order: int
    kind: str
    name: str
    micro: int
    exp_bits: int
    numel: int
    form: str                       # SUMMARY, COUNTED, DEFERRED (a tiny copy) or COUNT_ONLY
    vec: torch.Tensor | None        # the device vector (or the tiny copy) until the step ends
    snap: Snapshot | None


@dataclass(frozen=True)
class Meta:
    """A capture as the record keeps it: which row of which block holds its vector
    (block -1: none, a count only)."""
    order: int
    kind: str
    name: str
    micro: int
    numel: int
    form: str
    block: int = -1
    row: int = 0


@dataclass(frozen=True)
class Block:
    """A (rows x width) matrix of a step's summary vectors (or NaN/Inf counts), as
    one engine call or one stack made them, and where it starts in the packed
    host vector."""
    form: str                    # SUMMARY or COUNTED
    rows: int
    width: int
    start: int


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


class Packed:
    """A step's summary vectors, packed per device, on their way to the host."""

    def __init__(self, parts: list[Snapshot]):
        self._parts = parts            # a float64 host copy per device

    def host(self) -> np.ndarray:
        """Every vector, on the host (waits for the copies: the writer thread does)."""
        for part in self._parts:
            part.unpin()
        arrays = [part.host().numpy() for part in self._parts]
        return np.concatenate(arrays) if arrays else np.zeros(0)


@dataclass
class Resolved:
    """A step record interpreted: statistics per kind, and its non-finite events."""
    stats: dict[str, StatsRows] = field(default_factory=dict)
    events: list[fmt.NonFiniteEvent] = field(default_factory=list)


@dataclass
class StepRecord:
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
    _resolved: Resolved | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.snap.nbytes for t in self.tensors)

    def resolve(self) -> Resolved:
        """Statistics and events from the packed vectors (once; waits for the copies)."""
        if self._resolved is None:
            self._resolved = _resolve(self)
            self.packed = None
        return self._resolved


def _resolve(rec: StepRecord) -> Resolved:
    out = Resolved()
    if not rec.metas:
        return out
    flat = rec.packed.host() if rec.packed is not None else np.zeros(0)
    mats = [flat[b.start: b.start + b.rows * b.width].reshape(b.rows, b.width) for b in rec.blocks]
    # every capture with statistics is a row of ``moments``: the summary blocks, then a
    # block of counts for those without a vector (integer, bool, complex)
    summary = [i for i, b in enumerate(rec.blocks) if b.form == SUMMARY]
    base, at = {}, 0
    for i in summary:
        base[i], at = at, at + rec.blocks[i].rows
    counted_only = [i for i, m in enumerate(rec.metas) if m.block < 0]
    position = {i: at + j for j, i in enumerate(counted_only)}
    for i, m in enumerate(rec.metas):
        if m.block >= 0 and rec.blocks[m.block].form == SUMMARY:
            position[i] = base[m.block] + m.row
    blocks = [mats[i] for i in summary]
    blocks.append(np.array([float(rec.metas[i].numel) for i in counted_only]).reshape(-1, 1))
    m, hist = moments(blocks)
    for i, meta in enumerate(rec.metas):
        if i in position:
            p = position[i]
            bad = (int(m["nan"][p]), int(m["posinf"][p]), int(m["neginf"][p]))
        elif meta.form == COUNTED:
            bad = tuple(int(v) for v in mats[meta.block][meta.row])
        else:
            continue
        if any(bad):
            out.events.append(fmt.NonFiniteEvent(
                rec.step, meta.name, meta.kind, *bad, order=meta.order,
                phase="backward" if meta.kind in fmt.BACKWARD_KINDS else "forward",
                micro=meta.micro))
    out.events.sort(key=lambda e: e.sort_key)
    if not rec.plan.stats:
        return out
    per_kind: dict[str, dict[str, list[int]]] = {}        # kind -> layer -> its rows
    for i, meta in enumerate(rec.metas):
        if i in position:
            per_kind.setdefault(meta.kind, {}).setdefault(meta.name, []).append(position[i])
    s = combine(m, hist, [rows for layers in per_kind.values() for rows in layers.values()])
    at = 0                                             # micro-batches: one row over all of them
    for kind, layers in per_kind.items():
        part = slice(at, at + len(layers))
        out.stats[kind] = StatsRows(list(layers), {k: v[part] for k, v in s.stats.items()},
                                    s.hist[part])
        at += len(layers)
    return out


class StepBuffer:
    """The captures of the open step, on the training thread."""

    def __init__(self, config: RecorderConfig, known_layers: list[str]):
        self.config = config
        self.engines = Engines()
        self.stager = Stager(config.max_device_bytes, config.max_pinned_bytes)
        self.keeper = Keeper(config.max_replay_bytes) if config.on_nonfinite == "replay" else None
        self.step: int | None = None
        self.plan: Plan | None = None
        self.token: object | None = None
        self._captures: list[Capture] = []
        self._lock = threading.Lock()          # backward hooks may run on autograd threads
        self._known = dict.fromkeys(known_layers)
        self._new: list[str] = []
        self._drops: dict[str, int] = {}
        self.drops_total = 0
        self.captured = 0                       # captures of the last step ended
        self._warned: set[str] = set()
        self.pending: list[str] = []            # warnings held by end(), for tell()
        self.paused = 0                         # nesting of rec.pause()
        self.micro = 0                          # the open step's current micro-batch
        self._passes = 0                        # forward passes of the open step
        self._trained = False                   # one of them ran with grad
        self._untrained = 0                     # passes without grad before the first that did
        self._outside = 0
        self.outside_total = 0
        self.on_end: list = []                  # called when a step ends (the hooks' cleanup)
        self._engine_tensor: torch.Tensor | None = None     # the tensor an engine works on

    def warm(self, model: torch.nn.Module) -> None:
        """Prepare the statistics engines for the float dtypes and devices of the
        model's parameters and buffers (``Engine.warm``: on CUDA the Triton kernel
        compiles in the background; the first capture of any other dtype
        prepares its own)."""
        try:
            seen = {(t.dtype, t.device) for t in (*model.parameters(), *model.buffers())
                    if t.is_floating_point() and t.device.type != "meta"}
            for dtype, device in seen:
                self.engines.warm(dtype, device)
        except Exception:               # only a head start: the captures compile what they need
            pass

    def begin(self, step: int) -> None:
        self.step, self.token = step, object()
        self.plan = Plan.at(self.config, step)
        self._captures = []
        self.micro = self._passes = 0
        self._trained, self._untrained = False, 0
        self.tell()                             # what the last end() held, if not told yet

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
            self._trained = True
            return
        self._outside += 1
        self.outside_total += 1
        policy = self.config.outside_step
        if policy == "raise":
            raise InspectionError(
                "the recorded model ran outside a step; wrap forward and backward in "
                "`with rec.step():`, or wrap evaluation in `with rec.pause():`, or pass "
                "outside_step='warn' or 'ignore'")
        if policy == "warn":
            self._warn_once("outside", "tensortape: the recorded model ran outside a step (an "
                            "evaluation loop?); such passes are not recorded, only counted. Wrap "
                            "training steps in `with rec.step():`; pass outside_step='ignore' to "
                            "silence this")

    def eval_pass(self) -> bool:
        """A forward pass of the recorded model under ``no_grad``/``inference_mode``
        inside the open step: an evaluation pass (True: record nothing of it), not
        a micro-batch, counted with the passes outside steps (the run's
        ``outside_steps``) without a warning.

        Until a pass with grad has run in the step, such a pass is recorded as a
        micro-batch after all (False): a step of forward passes alone (recording
        inference) keeps them.  When a pass with grad follows, the step's end
        drops them (``_without_evaluation``) and its micro-batches are numbered
        from its first training pass."""
        if self._trained:
            self._outside += 1
            self.outside_total += 1
            return True
        self.micro, self._passes = self._passes, self._passes + 1
        self._untrained += 1
        return False

    def add(self, kind: str, name: str, tensor: torch.Tensor, token: object, micro: int) -> None:
        """One captured tensor of the step whose token is ``token`` (its forward
        call's micro-batch ``micro``)."""
        if token is None:                   # its forward was not recorded: neither is it
            return
        if token is not self.token:
            self.drop(LATE_GRADIENT)
            self._warn_once("late", f"tensortape: the gradient of {name!r} arrived after its step "
                            f"ended and was dropped; run backward inside the step "
                            f"(`with rec.step(): ...`)")
            return
        if self.paused:                     # inside pause(): nothing is recorded
            return
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()          # a sharded DTensor (FSDP2): this rank's shard
        tensor = tensor.detach()
        plan, cfg = self.plan, self.config
        snap = None
        if plan.keep:
            reason = unstorable(tensor)
            if reason is None:
                snap = self.stager.take(tensor, cfg.max_samples, cfg.tensor_dtype)
                reason = snap if isinstance(snap, str) else None
            if reason is not None:
                snap = None
                self.drop(reason)
        exp_bits = exp_bits_of(tensor)
        numel = tensor.numel()
        if not exp_bits:
            form, vec = COUNT_ONLY, None
        elif numel == 0:
            form, vec = (SUMMARY, empty_summary()) if plan.stats else (COUNT_ONLY, None)
        elif plan.stats and numel < SMALL:
            form, vec = DEFERRED, widened(tensor).clone()
        else:
            engine = self.engines.for_tensor(tensor)
            self._engine_tensor = tensor
            if plan.stats:
                form, vec = SUMMARY, engine.reduce(tensor)
            else:
                form, vec = COUNTED, engine.count_nonfinite(tensor)
            self._engine_tensor = None
        with self._lock:
            self._captures.append(Capture(len(self._captures), kind, name, micro, exp_bits, numel,
                                          form, vec, snap))
            if name not in self._known:
                self._known[name] = None
                self._new.append(name)

    # --- faults and drops ----------------------------------------------------------------
    def drop(self, reason: str, n: int = 1) -> None:
        """Count ``n`` captures (or rows) dropped for ``reason``."""
        with self._lock:
            self._drops[reason] = self._drops.get(reason, 0) + n
            self.drops_total += n

    def fault(self, error: BaseException, kind: str, name: str, n: int = 1) -> None:
        """Anything raised while capturing ``name``: that capture (or ``n`` of them) is
        dropped (counted with its reason), a failing statistics engine is demoted,
        and it warns once per cause.  Training goes on."""
        cause = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        self.drop(f"capture failed ({cause})", n)
        tensor, self._engine_tensor = self._engine_tensor, None
        note = ""
        if tensor is not None:
            failed = self.engines.for_tensor(tensor)
            after = self.engines.demote(tensor)
            note = (f"; {failed} failed on {tensor.dtype}, "
                    + (f"{after} takes over" if after else "no other engine is left"))
        self._warn_once(cause, f"tensortape: capturing {kind} of {name!r} failed ({cause}); the "
                        f"capture is dropped and counted in the run's 'dropped'{note}; training "
                        f"goes on")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    def tell(self) -> None:
        """Issue the warnings that ``end`` held (on the training thread, once its
        record is handed on: a filter that makes them errors raises here)."""
        pending, self.pending = self.pending, []
        for message in pending:
            warn(message)

    # --- end of step ---------------------------------------------------------------------
    def idle(self) -> bool:
        """Whether no thread is inside the buffer now (without waiting)."""
        if not self._lock.acquire(blocking=False):
            return False
        self._lock.release()
        return True

    def end(self) -> StepRecord:
        """Close the step and start its summaries' copy to the host; the record.
        It never raises: its warnings (and its engines') are held for ``tell``."""
        with holding(self.pending):
            return self._end()

    def _end(self) -> StepRecord:
        step, plan = self.step, self.plan
        self.step = self.token = None
        for f in self.on_end:
            try:
                f()
            except Exception as e:       # never into training
                self.fault(e, "step end", "(hooks)")
        with self._lock:
            caps, self._captures = self._captures, []
            new, self._new = self._new, []
        caps = self._without_evaluation(caps)
        self.captured = len(caps)
        caps.sort(key=lambda c: (c.kind in fmt.BACKWARD_KINDS, c.order))
        rec = StepRecord(step, plan, layers=new, outside=self._outside)
        try:
            rec.metas, rec.blocks, rec.packed = self._pack(caps)
        except Exception as e:           # never into training: the step's statistics are dropped
            cause = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            self.drop(f"statistics failed ({cause})", len(caps))
            self._warn_once(cause, f"tensortape: the statistics of step {step} failed ({cause}); "
                            f"they are dropped and counted; training goes on")
        rec.tensors = [TensorRow(c.kind, c.name, c.micro, c.snap) for c in caps if c.snap is not None]
        with self._lock:
            rec.drops, self._drops = self._drops, {}
        self._outside = 0
        return rec

    def _without_evaluation(self, caps: list[Capture]) -> list[Capture]:
        """A step with a training pass: the passes without grad before it were
        evaluation passes (``eval_pass``): their captures go (not its weights,
        taken once a step), they are counted, and the training passes are
        micro-batches 0, 1, ..."""
        n, self._untrained = self._untrained, 0
        if not (n and self._trained):
            return caps
        self._outside += n
        self.outside_total += n
        kept = []
        for c in caps:
            if c.kind == "weights":
                c.micro = max(c.micro - n, 0)
            elif c.micro < n:
                continue
            else:
                c.micro -= n
            kept.append(c)
        return kept

    def _pack(self, caps: list[Capture]) -> tuple[list[Meta], list[Block], Packed | None]:
        """Batch the tiny tensors, stack the other vectors of a device and width into
        blocks, and start each device's copy to the host without waiting (a pinned
        buffer and an event on CUDA)."""
        groups: dict = {}          # (device, form, code width of tiny ones) -> capture indices
        for i, c in enumerate(caps):
            if c.vec is not None:
                key = (c.vec.device, c.form, c.exp_bits if c.form == DEFERRED else 0)
                groups.setdefault(key, []).append(i)
        made = []                  # (device, matrix, form, capture indices)
        for (device, form, e), idx in groups.items():
            vecs = [caps[i].vec for i in idx]
            if form == DEFERRED:
                engine = self.engines.for_tensor(vecs[0])
                try:
                    made.append((device, engine.reduce_many(vecs, e), SUMMARY, idx))
                except Exception as err:     # the guard: these captures' statistics are dropped
                    self._engine_tensor = vecs[0]
                    self.fault(err, "statistics", f"{len(idx)} small tensors", len(idx))
                    for i in idx:
                        caps[i].form, caps[i].vec = COUNT_ONLY, None
                continue
            made.append((device, torch.stack(vecs), form, idx))
        metas = [Meta(c.order, c.kind, c.name, c.micro, c.numel, c.form) for c in caps]
        blocks, parts, start = [], [], 0
        for device in dict.fromkeys(d for d, *_ in made):
            mine = [b for b in made if b[0] == device]
            for _, mat, form, idx in mine:
                for row, i in enumerate(idx):
                    c = caps[i]
                    metas[i] = Meta(c.order, c.kind, c.name, c.micro, c.numel, form, len(blocks), row)
                blocks.append(Block(form, mat.shape[0], mat.shape[1], start))
                start += mat.numel()
            mats = [mat.reshape(-1) for _, mat, *_ in mine]
            parts.append(self._to_host(mats[0] if len(mats) == 1 else torch.cat(mats)))
        for c in caps:
            c.vec = None
        return metas, blocks, Packed(parts) if parts else None

    def pending_record(self) -> StepRecord | None:
        """What was counted since the last record, outside any step (at close)."""
        if not (self._drops or self._outside):
            return None
        rec = StepRecord(-1, drops=self._drops, outside=self._outside)
        self._drops, self._outside = {}, 0
        return rec

    def clear(self) -> None:
        self._captures = []

    def _to_host(self, flat: torch.Tensor) -> Snapshot:
        """A float64 vector's host copy, started now: on CUDA into a pinned slot on
        the current stream, with an event that the writer waits for (the vector's
        memory is reused only after the copy, on the same stream); elsewhere, a copy
        (none on the CPU)."""
        flat = flat.to(torch.float64)
        if flat.device.type == "cuda":
            return self.stager.pinned_copy(flat)
        return Snapshot(flat if flat.device.type == "cpu" else flat.to("cpu"))
