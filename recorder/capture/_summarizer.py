"""What form each capture takes, and the engines that make it.

For each captured tensor the ``Summarizer`` takes, as the step's ``Plan``
says:

- its full tensor, when the step keeps them (a ``Snapshot``, through the
  ``Stager``; one it cannot take is counted in the ``DropLedger``);
- its summary, in the form ``_summary.form`` decides: a summary vector from
  the statistics engine for the tensor's device and dtype; at a step without
  statistics the exact NaN/Inf counts; for a tiny float tensor, a copy that
  waits for the step's batch; for a tensor without float values, nothing (its
  element count is all).

Nothing waits for a device, and nothing keeps a reference to the user's
tensor.  At the step's end ``pack`` summarises the tiny tensors in one batch
per device and code width, stacks the other vectors of a device into blocks,
and starts each device's copy to the host.

**Left to the writer.**  While a CPU engine's kernels are still compiling
(``Engine.later``: numba's, compiled apart on a fresh machine), a capture's
summary is not made on the training thread: the capture keeps a contiguous
copy of the prepared tensor (the tiny tensors' batch its copies), and the
step's record carries them as a ``Later`` part of its packed vectors.  The
writer thread summarises them when it resolves the step (``Later.host``),
with the same engine once its kernels are loaded (it waits for them up to
``_Patience``), else with the eager torch kernels: the same counts, minimum,
maximum and histograms.  The copies are bounded (``_Held``: at most
``_LATER_MAX`` bytes, and half of ``max_pending_bytes``; they count in
the record's bytes); past it a capture is summarised here, as before.  Never
under ``on_nonfinite="raise"`` or ``"replay"``: their steps are resolved on
the training thread.

An engine that fails on a capture raises ``EngineFailed``, which carries the
tensor: the fault path (``demote``) moves that (device type, dtype) to the
next engine of the demotion order (``_engines.ORDER``).

Training thread (the hooks, and the step's end), and autograd's threads for
gradients: a ``Taken`` is built on the thread that took it.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from .._config import RecorderConfig
from ..step._drops import DropLedger
from ._engine import Engine
from ._engines import Engines
from ..step._record import Block, Deferred, Meta, Packed, Plan
from ._snapshot import Snapshot, Stager, unstorable
from ._summary import (COUNTS, NARROW, VECTOR, Form, Holds, batched_dtype, empty_summary, form,
                       prepared, widened)
from ..errors import TensortapeWarning

__all__ = ["EngineFailed", "Later", "Summarizer", "Taken"]


@dataclass(slots=True)
class Taken:
    """A tensor a hook took in the open step (its summary on the way), until the step ends."""
    order: int
    kind: str
    name: str
    micro: int
    exp_bits: int                   # its code width (``exp_bits_of``)
    numel: int
    form: Form                      # SUMMARY, NONFINITE, SMALL, FEW or COUNT (EMPTY: a SUMMARY)
    vec: torch.Tensor | None        # the device vector (or the tiny copy) until the step ends
    snap: Snapshot | None
    engine: Engine | None = None    # left to the writer (``Later``): ``vec`` is a copy for it
    block: int | None = None        # packed (``pack``): the block and row of its vector (None:
    row: int = 0                    # none); the step record's ``Meta`` from then on


class EngineFailed(Exception):
    """A statistics engine raised on ``tensor``: the error, and the tensor whose
    (device type, dtype) the fault path demotes."""

    def __init__(self, error: Exception, tensor: torch.Tensor):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.tensor = error, tensor


_HOLDS = {Form.SUMMARY: Holds.SUMMARY, Form.NONFINITE: Holds.NONFINITE}
# the members as module constants: an Enum attribute costs a lookup per capture
_COUNT, _EMPTY, _SMALL, _SUMMARY, _FEW = Form.COUNT, Form.EMPTY, Form.SMALL, Form.SUMMARY, Form.FEW
_LATER = "later"                 # ``pack``'s place for the blocks left to the writer
_LATER_MAX = 1 << 29             # bytes of copies left to the writer, at most (``_Held``)


class Summarizer:
    """A recording's capture forms, engines and snapshot memory (see the module)."""

    def __init__(self, config: RecorderConfig, ledger: DropLedger, fault):
        self.config = config
        self.ledger = ledger
        self._fault = fault                     # fault(error, kind, name, n): counted and told
        self.engines = Engines()
        self.stager = Stager(config.max_device_bytes, config.max_pinned_bytes,
                             config.max_pending_bytes)
        # summaries left to the writer (see the module): not where the training thread
        # resolves its steps itself
        self._held = None if config.on_nonfinite in ("raise", "replay") else \
            _Held(min(_LATER_MAX, config.max_pending_bytes // 2))
        self._patience = _Patience(config.close_timeout / 3)
        # a snapshot is the tensor itself, copied (no max_samples, no tensor_dtype)
        self._same = config.max_samples is None and config.tensor_dtype is None

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

    # --- a capture -----------------------------------------------------------------------
    def take(self, kind: str, name: str, micro: int, tensor: torch.Tensor, plan: Plan) -> Taken:
        """The capture of a detached ``tensor`` (its ``order`` is set by the caller).
        Raises ``EngineFailed`` when the engine fails."""
        snap = None
        if plan.keep:                           # its full tensor (inline: once per capture)
            reason = unstorable(tensor)
            if reason is None:
                snap = self.stager.take(tensor, self.config.max_samples, self.config.tensor_dtype)
                if isinstance(snap, str):       # a cap: the reason none was taken
                    reason, snap = snap, None
            if reason is not None:
                self.ledger.drop(reason)
        f, exp_bits, numel = form(tensor, plan.stats)
        vec = None
        if f is _SMALL or f is _FEW:            # a copy: the snapshot, where it is one
            vec = snap.local() if snap is not None and self._same else None
            if vec is None or vec.dtype in NARROW:
                vec = widened(tensor).clone()
        elif f is _EMPTY:
            f, vec = _SUMMARY, empty_summary()
        elif f is not _COUNT:
            engine = self.engines.for_tensor(tensor)
            try:
                x = prepared(tensor)
                if self._held is not None and engine.later(x.dtype) \
                        and (copy := self._held.copy(x)) is not None:   # to the writer
                    return Taken(0, kind, name, micro, exp_bits, numel, f, copy, snap, engine)
                vec = engine.reduce(x) if f is _SUMMARY else engine.count_nonfinite(x)
            except TensortapeWarning:   # made an error by the user's filter: their policy
                raise
            except Exception as e:
                raise EngineFailed(e, tensor) from e
        return Taken(0, kind, name, micro, exp_bits, numel, f, vec, snap)

    def demote(self, tensor: torch.Tensor) -> str:
        """After ``EngineFailed`` on ``tensor``: its (device type, dtype) moves to the
        next engine; what happened, in words."""
        failed = self.engines.for_tensor(tensor)
        after = self.engines.demote(tensor)
        return (f"{failed} failed on {tensor.dtype}, "
                + (f"{after} takes over" if after else "no other engine is left"))

    # --- the step's end ------------------------------------------------------------------
    def pack(self, caps: list[Taken]) -> tuple[list[Meta], list[Block], Packed | None]:
        """Batch the tiny tensors, stack the other vectors of a device and form into
        blocks, and start each device's copy to the host without waiting (a pinned
        buffer and an event on CUDA).  A failed batch is counted (``fault``), its
        captures left with their element counts.  The captures themselves are the
        record's metas (``block`` and ``row`` set, their vectors let go)."""
        groups: dict = {}          # (device, form, code width of tiny ones, left to the writer)
        for i, c in enumerate(caps):       # -> capture indices
            if c.vec is not None:
                key = (c.vec.device, c.form, c.exp_bits if c.form is _SMALL else 0,
                       c.engine is not None)
                groups.setdefault(key, []).append(i)
        made = []                  # (device or _LATER, matrix or _Job, what it holds, indices)
        for (device, f, e, later), idx in groups.items():
            vecs = [caps[i].vec for i in idx]
            if later:
                job = _Job(f, e, [(caps[i].engine, caps[i].vec) for i in idx])
                made.append((_LATER, job, _HOLDS[f], idx))
                continue
            if f is _FEW:                 # their NaN/Inf counts: in one batch, here
                try:
                    made.append((device, self.engines.for_tensor(vecs[0]).count_nonfinite_many(
                        vecs), Holds.NONFINITE, idx))
                except Exception as err:     # the guard: as a failed batch below
                    self._failed_batch(caps, idx, err)
                continue
            if f is _SMALL:
                engine = self.engines.for_tensor(vecs[0])
                if self._held is not None and engine.later(batched_dtype(e)):   # copies already
                    made.append((_LATER, _Job(f, e, [(engine, v) for v in vecs]), Holds.SUMMARY,
                                 idx))
                    continue
                try:
                    made.append((device, engine.reduce_many(vecs, e), Holds.SUMMARY, idx))
                except Exception as err:     # the guard: these captures' statistics are dropped
                    self._failed_batch(caps, idx, err)
                continue
            made.append((device, torch.stack(vecs), _HOLDS[f], idx))
        blocks, parts, start = [], [], 0
        for device in dict.fromkeys(d for d, *_ in made):
            mine = [b for b in made if b[0] == device]
            for _, mat, holds, idx in mine:
                for row, i in enumerate(idx):
                    caps[i].block, caps[i].row = len(blocks), row
                blocks.append(Block(holds, mat.shape[0], mat.shape[1], start))
                start += mat.shape[0] * mat.shape[1]
            if device == _LATER:
                parts.append(Later([job for _, job, *_ in mine], self._patience))
                continue
            mats = [mat.reshape(-1) for _, mat, *_ in mine]
            parts.append(self.to_host(mats[0] if len(mats) == 1 else torch.cat(mats)))
        for c in caps:
            c.vec = c.engine = None
        return caps, blocks, Packed(parts) if parts else None

    def _failed_batch(self, caps: list[Taken], idx: list[int], error: Exception) -> None:
        """A batch of tiny tensors failed: counted (``fault``), its captures left with
        their element counts."""
        self._fault(EngineFailed(error, caps[idx[0]].vec), "statistics",
                    f"{len(idx)} small tensors", len(idx))
        for i in idx:
            caps[i].form, caps[i].vec = Form.COUNT, None

    def to_host(self, flat: torch.Tensor) -> Snapshot:
        """A float64 vector's host copy, started now: on CUDA into a pinned slot on
        the current stream, with an event that the writer waits for (the vector's
        memory is reused only after the copy, on the same stream); elsewhere, a copy
        (none on the CPU)."""
        flat = flat.to(torch.float64)
        if flat.device.type == "cuda":
            return self.stager.pinned_copy(flat)
        return Snapshot(flat if flat.device.type == "cpu" else flat.to("cpu"))


# --- summaries left to the writer (see the module) ----------------------------------------
class _Held:
    """The copies left to the writer, bounded in bytes: the training thread takes
    them (``copy``), and each gives its bytes back when it is freed, on whichever
    thread drops it (the writer, once summarised; or a record never handed on)."""

    def __init__(self, cap: int):
        self.cap, self.bytes = cap, 0
        self._lock = threading.Lock()

    def copy(self, x: torch.Tensor) -> torch.Tensor | None:
        """A contiguous copy of ``x`` within the cap; None past it (or if it cannot
        be made): the caller summarises ``x`` itself."""
        n = x.numel() * x.element_size()
        with self._lock:
            if self.bytes + n > self.cap:
                return None
            self.bytes += n
        try:
            copy = x.clone(memory_format=torch.contiguous_format)
            weakref.finalize(copy, self._give, n)
        except Exception:
            self._give(n)
            return None
        return copy

    def _give(self, n: int) -> None:
        with self._lock:
            self.bytes -= n


class _Patience:
    """How long, in all, the writer waits for kernels still compiling: ``seconds``
    from its first wait (a third of ``close_timeout``: a waiting writer is not taken
    for a stuck one, and ``close`` ends in time); then it waits no more."""

    def __init__(self, seconds: float):
        self.seconds, self._until = seconds, None

    def left(self) -> float:
        if self._until is None:
            self._until = time.monotonic() + self.seconds
        return self._until - time.monotonic()


@dataclass
class _Job:
    """One block left to the writer: its captures' copies, each with its engine
    (a tiny tensors' batch: one engine, summarised in one call)."""
    form: Form
    exp_bits: int
    items: list[tuple[Engine, torch.Tensor]]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.items), (len(COUNTS) if self.form is Form.NONFINITE else VECTOR)


class Later(Deferred):
    """A ``Packed`` part whose vectors the writer thread makes (see the module):
    ``host`` summarises the copies, block after block, then lets them go."""

    _SLICE = 0.05                  # seconds between two looks at ``hurry`` while waiting

    def __init__(self, jobs: list[_Job], patience: _Patience):
        self._jobs, self._patience = jobs, patience
        self.nbytes = sum(x.numel() * x.element_size() for j in jobs for _, x in j.items)

    def host(self, hurry) -> torch.Tensor:
        """The blocks' vectors, flat, in float64: with each engine's kernels once they
        are loaded (waited for within the patience, and while ``hurry()`` is false:
        records waiting behind this one would soon hold the training thread up),
        else the eager torch kernels."""
        jobs, self._jobs = self._jobs, []
        flat = []
        while jobs:
            flat.append(self._summarise(jobs.pop(0), hurry).reshape(-1).to(torch.float64))
        return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)

    def _summarise(self, job: _Job, hurry) -> torch.Tensor:
        if job.form is _SMALL:
            engine, xs = job.items[0][0], [x for _, x in job.items]
            self._settle(engine, batched_dtype(job.exp_bits), hurry)
            return _either(engine, "reduce_many", batched_dtype(job.exp_bits), xs, job.exp_bits)
        name = "reduce" if job.form is _SUMMARY else "count_nonfinite"
        rows = []
        for engine, x in job.items:
            self._settle(engine, x.dtype, hurry)
            rows.append(_either(engine, name, x.dtype, x))
        return torch.stack(rows)

    def _settle(self, engine: Engine, dtype: torch.dtype, hurry) -> None:
        """Wait for ``dtype``'s kernels, in slices, within the patience and while
        nothing hurries the writer (then one look: loaded if they are there)."""
        while True:
            wait = 0.0 if hurry() else max(0.0, min(self._SLICE, self._patience.left()))
            if engine.settle(dtype, wait) or not wait:
                return


def _either(engine: Engine, name: str, dtype: torch.dtype, *args) -> torch.Tensor:
    """``engine``'s kernel ``name`` on ``args`` (of ``dtype``); if it fails, the eager
    torch kernel, and the engine is told (``Engine.fail``): the training thread
    demotes the dtype at its next capture, warned, as if it had failed there."""
    try:
        return getattr(engine, name)(*args)
    except Exception as e:
        engine.fail(dtype, e)
        return getattr(Engine, name)(engine, *args)
