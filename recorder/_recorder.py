"""The Recorder: the user's handle on a recording.

It wires the one-way flow and owns the lifecycle, nothing more::

    hooks (_hooks) -> captures -> step buffer (_buffer) -> records (_record) -> writer (_writer)
        -> rank log (_ranklog) -> tables (_store) -> fenced commit

Settings are validated once (``_config``); the run is opened on every rank by
``_ranklog.RankLog.open``, the owner of the rank's durable state, which the
writer feeds.  Under
``on_nonfinite="replay"`` a step's end goes through ``_replayer.Replayer`` too.
A Recorder left open at exit, or collected unclosed, is ended by ``_exit``.

Training thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import numpy as np
import torch
from torch import nn

from . import _exit
from .step import _scalars
from . import format as fmt
from ._config import ON_NONFINITE, STATS_EVERY, TENSORS_EVERY, RecorderConfig
from .capture._engines import engine_choice
from .quiet import quiet, warn
from .hooks._hooks import HookSet
from .hooks._selection import select_layers, unwrap
from .writer._budget import resolve as resolve_budget
from .step._buffer import StepBuffer
from .step._drops import DropLedger
from .store._ranklog import RankLog
from .store._ranks import rank0_decides, rank_and_world
from .store._pool import write_threads
from .claim._root import check_mode
from .replay._replayer import Replayer
from .writer._writer import Writer
from .errors import ConfigError, InspectionError, NonFiniteError

__all__ = ["Recorder"]


class _StepScope:
    """What ``rec.step()`` returns: ending it ends the step."""

    def __init__(self, rec: "Recorder"):
        self._rec = rec

    def __enter__(self):
        return self._rec

    def __exit__(self, exc_type, exc, tb):
        self._rec._end_step(raise_nonfinite=exc_type is None)
        return False


class Recorder:
    """Record activations and gradients of chosen layers into a Zarr store.

    ``with Recorder(model, "run.zarr") as rec:`` then ``with rec.step(i):`` around
    each training step's forward and backward.  Arguments (all but the first two
    by keyword):

    model: any ``nn.Module``, also one wrapped by ``torch.compile``, DDP or FSDP
        (names are the unwrapped model's), or a ``torch.fx.GraphModule``.
    store: a folder path or fsspec URL (``s3://...``, ``memory://...``).
    layers: a glob pattern or list of them over module names (``"*"``: every
        module; the root is ``""``).  A pattern matching nothing raises
        ``LayerNotFoundError`` naming the closest names.
    capture: kinds to record: ``activations``, ``gradients`` (of the outputs),
        ``inputs``, ``weights``, ``weight_grads``.
    stats_every: statistics and histograms at steps where ``step % stats_every == 0``
        (the default: 1); every other step still counts NaN/Inf exactly.
    tensors_every: full tensors at steps where ``step % tensors_every == 0``;
        ``None`` (the default) or 0 for statistics only (``--tensors-every 0``).
    ring: keep the full tensors of this many steps before the current one in
        memory, stored at a NaN/Inf with the step's own.  ``None`` (the default):
        2 where ``on_nonfinite`` dumps, else 0; a ring above 0 needs
        ``on_nonfinite`` ``"dump"``, ``"raise"`` or ``"replay"`` (``ConfigError``
        under ``"record"``).
    on_nonfinite: ``"record"`` (an event), ``"dump"`` (the default: also store the
        ring and the current step's full tensors), ``"raise"`` (dump, then raise
        ``NonFiniteError`` at the step's end), ``"replay"`` (dump, and name the
        aten op and the line that made the run's first NaN/Inf, in forward or
        backward: docs/GUIDE.md).
    max_samples: full tensors keep only their first k entries along dim 0.
    tensor_dtype: storage dtype of full tensors (``None``: their own).
    mode: ``"w-"`` (refuse an existing run), ``"w"`` (replace a tensortape run;
        never anything else), ``"a"`` (append to one).
    metadata: a JSON-able dict saved with the run.
    outside_step: a forward outside any step: ``"warn"`` once, ``"ignore"``, or
        ``"raise"`` (``InspectionError``); it is counted, never recorded.
    max_bytes: a budget for full tensors on disk, in bytes.  ``"auto"`` (the
        default): a tenth of the free space where the store is, at most 10 GB,
        printed when recording starts; ``None``: no budget.  Past it, the full
        tensors a step persists are not stored (those no dump stores are counted in
        ``over_budget``); statistics, histograms and the non-finite dump go on every
        step.
    flush_interval: seconds between commits (a crash loses at most this much).
    max_pending_bytes: snapshot bytes queued for the writer before the training
        thread waits (nothing is dropped).
    max_device_bytes: on an accelerator, device memory for the clones of full
        tensors whose copies to the host are still in flight; past it a full
        tensor is not taken (counted in ``dropped``, its statistics kept).
    max_pinned_bytes: on an accelerator, pinned host memory for full tensors on
        their way to the writer; past it, the same.
    max_replay_bytes: ``on_nonfinite="replay"``: bytes of module inputs kept by
        reference until the step ends; past it calls are not kept (counted).
    compression: full tensors: ``"auto"`` (zstd level 1 where it shrinks an
        array's first step by 10% or more, else zstd's fast mode), a zstd level,
        or ``None``.
    on_error: when the store cannot be written: ``"warn"`` (warn once, keep the
        statistics in memory, count the full tensors not written in
        ``dropped``, train on) or ``"raise"`` (``RecorderError`` at the next
        step end, flush or close).
    close_timeout: seconds ``close()`` (and interpreter exit) waits for the
        writer to commit, and the longest the training thread waits on a writer
        that makes no progress; past it the run is marked ``interrupted`` (or,
        while training, captures are dropped and counted), never a hang.

    docs/GUIDE.md says how each behaves where it matters (micro-batches,
    compile, distributed runs, faults).
    """

    def __init__(self, model: nn.Module, store, *, layers="*",
                 capture=("activations", "gradients"), tensors_every=TENSORS_EVERY,
                 stats_every=STATS_EVERY, ring=None, on_nonfinite=ON_NONFINITE, max_samples=None,
                 tensor_dtype=None, mode="w-",
                 metadata=None, outside_step="warn", max_bytes="auto", flush_interval=5.0,
                 max_pending_bytes=1 << 30, max_device_bytes=1 << 30, max_pinned_bytes=2 << 30,
                 max_replay_bytes=1 << 30, compression="auto", on_error="warn",
                 close_timeout=60.0):
        if isinstance(model, torch.jit.ScriptModule):
            raise ConfigError(f"{type(model).__name__} is a TorchScript module, whose calls run no "
                              f"Python hooks; record the eager module instead, or compile it "
                              f"with torch.compile")
        self.config = RecorderConfig.build(
            capture=capture, tensors_every=tensors_every, stats_every=stats_every, ring=ring,
            on_nonfinite=on_nonfinite, max_samples=max_samples, tensor_dtype=tensor_dtype,
            mode=mode, flush_interval=flush_interval, max_pending_bytes=max_pending_bytes,
            max_device_bytes=max_device_bytes, max_pinned_bytes=max_pinned_bytes,
            max_replay_bytes=max_replay_bytes, compression=compression,
            outside_step=outside_step, max_bytes=max_bytes, on_error=on_error,
            close_timeout=close_timeout)
        self.metadata = fmt.to_json(metadata or {})
        self.store_location = fmt.location(store)
        engine_choice()                   # a bad TENSORTAPE_ENGINE or TENSORTAPE_WRITE_THREADS:
        write_threads()                   # one line, before anything is written
        self.layers = select_layers(model, layers)
        self.rank, self._world = rank_and_world()
        self._model_class = type(unwrap(model)).__qualname__
        self._model = model
        self._hooks: HookSet | None = None
        self._writer: Writer | None = None
        self._buffer: StepBuffer | None = None
        self._replayer: Replayer | None = None        # on_nonfinite="replay"
        self._closed = False
        self._last_step: int | None = None           # the store's, for numbering steps
        self._own_last: int | None = None            # this Recorder's: steps must increase
        self._dropped_before = self._outside_before = 0
        self._warned_silent = False

        def look():                   # rank 0 looks, before any hook; its answer is every rank's
            with quiet():
                check_mode(self.store_location, self.config.mode)
            return None, ""
        rank0_decides(look, self.rank, self._world)

    # --- lifecycle ------------------------------------------------------------
    def attach(self) -> "Recorder":
        """Open the store and register the hooks (``__enter__`` calls it)."""
        if self._closed:
            raise InspectionError("this Recorder is closed; create a new one to record again")
        if self._writer is not None:
            return self
        budget = resolve_budget(self.config.max_bytes, self.store_location,
                                self.config.tensors_every is not None or self.config.ring > 0)
        self.config = cfg = dataclasses.replace(self.config, max_bytes=budget.limit)
        if budget.text and self.rank == 0:        # a line, not a warning (-W error)
            print(budget.text, file=sys.stderr)
        log = RankLog.open(self.store_location, cfg, self.rank, self._world, self._model_class,
                           self.metadata)
        try:                                      # a failure here gives the claim back
            self._last_step, self._dropped_before = log.last_step, log.dropped
            self._outside_before = log.outside_steps
            drops = DropLedger()                  # one for the step buffer and the writer's handle
            self._buffer = StepBuffer(cfg, log.layers, drops)
            self._buffer.summarizer.warm(self._model)
            self._writer = Writer(log, cfg, drops)
        except BaseException:
            log.abandon()
            raise
        if self._buffer.keeper is not None:
            self._replayer = Replayer(self._buffer.keeper, self.rank, self.pause,
                                      self._buffer.fault)
        self._hooks = HookSet(self._model, self.layers, cfg.capture, self._buffer,
                              keeper=self._buffer.keeper)
        self._model = None
        self._hooks.attach()
        _exit.opened(self, self._writer, self._hooks, self._buffer)
        return self

    def close(self, status: str = fmt.STATUS_COMPLETE) -> None:
        """End any open step, flush everything (within ``close_timeout``), and remove
        every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _exit.closed(self)
        try:
            if self._buffer is not None and self._buffer.state.step is not None:
                self._end_step(raise_nonfinite=False)
        finally:
            self._model = None
            if self._hooks is not None:
                self._hooks.detach()
            if self._writer is not None:
                try:
                    late = self._buffer.close_record()
                    if late is not None:
                        self._writer.put(late)
                finally:
                    self._buffer.clear()
                    self._writer.close(status)
                    self._buffer.tell()

    def __enter__(self) -> "Recorder":
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(fmt.STATUS_INTERRUPTED if exc_type is not None else fmt.STATUS_COMPLETE)
        return False

    @property
    def dropped(self) -> int:
        """Captures dropped so far in this run: late gradients, full tensors of a
        dtype the store cannot hold, captures that failed, records the writer could
        not be given (the run's ``drop_reasons`` say which; ``DropLedger``), and
        those of steps never committed because the claim on the store was lost
        (which the store may not count); the writer thread's own drops are counted
        in the store."""
        return self._dropped_before + (self._buffer.drops.total if self._buffer else 0) \
            + (self._writer.unstored if self._writer else 0)

    # --- steps ----------------------------------------------------------------
    def step(self, i: int | None = None) -> _StepScope:
        """Begin step ``i`` (default: the previous step plus 1, from 0)."""
        if self._writer is None:
            if self._closed:
                raise InspectionError("this Recorder is closed; create a new one to record again")
            self.attach()
        if self._buffer.state.step is not None:
            self._end_step(raise_nonfinite=True)
        if i is None:
            i = 0 if self._last_step is None else self._last_step + 1
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise InspectionError(f"step {i!r} is not an integer; call rec.step() or rec.step(int)")
        if self._own_last is not None and i <= self._own_last:
            raise InspectionError(
                f"step {i} comes after step {self._own_last}; steps must increase. With "
                f"gradient accumulation, begin one step per optimizer step and run every "
                f"micro-batch's forward and backward inside it: each forward of the model is a "
                f"micro-batch of that step")
        self._own_last = int(i)
        self._buffer.begin(int(i))
        self._hooks.new_step()
        return _StepScope(self)

    def log(self, values: dict) -> None:
        """Store named scalars for the open step, or, after it ended, the last one:
        ``rec.log({"loss": loss, "lr": lr})``.  Values: Python or numpy numbers, or
        real 0-dim tensors, read when the step ends with its summaries (no sync of
        their own; logged after the step, a tensor's value when logged).  Anything
        else raises ``ConfigError``; ``run.scalars()`` reads them back."""
        values = _scalars.check(values)
        if self._buffer is None:
            if self._closed:
                raise InspectionError("this Recorder is closed; log inside or after a step "
                                      "while it records")
            self.attach()
        self._buffer.scalars.log(values, self._buffer.state.step, self._own_last)

    @contextlib.contextmanager
    def pause(self):
        """``with rec.pause():`` records nothing inside it, within a step or not."""
        if self._buffer is None:
            self.attach()
        self._buffer.state.paused += 1
        try:
            yield self
        finally:
            self._buffer.state.paused -= 1

    def micro_batch(self, enter: bool) -> None:
        """A training framework's batch begins or ends (what ``integrations`` call):
        the model's calls inside it are one micro-batch, whatever module is called."""
        if self._hooks is not None:
            self._hooks.on_pass(enter)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (nothing more is recorded)."""
        return self._closed

    @property
    def outside_steps(self) -> int:
        """Forward passes of the model outside any step in this run."""
        return self._outside_before + (self._buffer.state.outside_total if self._buffer else 0)

    def flush(self) -> None:
        """Block until every finished step is written and committed (while the
        store cannot be written, under ``on_error="warn"``, it tries once more and
        returns: the warning has said so)."""
        if self._writer is not None:
            self._writer.flush()

    def _end_step(self, raise_nonfinite: bool) -> None:
        buffer, cfg = self._buffer, self.config
        step = buffer.state.step
        if step is None:
            return
        try:
            if fmt.Kind.WEIGHT_GRADS in cfg.capture:
                try:
                    for name, g in self._hooks.weight_grads():
                        buffer.add(fmt.Kind.WEIGHT_GRADS, name, g, buffer.state.token, 0)
                except Exception as e:          # the guard, as in the hooks
                    buffer.fault(e, fmt.Kind.WEIGHT_GRADS, "(parameters)")
        finally:
            self._last_step = step
            record = buffer.end()
        silent = not buffer.captured and not self._warned_silent and self._hooks.backward_ran()
        if self._replayer is not None:          # on_nonfinite="replay"
            self._replayer.on_step_end(record)
        events = []
        if cfg.on_nonfinite == "raise":         # the one policy that waits for the device
            try:
                events = record.resolve().events
            except Exception:                   # the writer counts it
                events = []
        self._writer.put(record)
        if events:
            self._writer.flush()
        # the step is handed on: what it has to say is said now, on the training thread (a
        # filter that makes warnings errors raises here, losing nothing)
        buffer.tell()
        self._writer.tell()
        if silent:
            self._warned_silent = True
            warn(f"tensortape: step {step} ran the model (its gradients changed) but captured "
                 f"nothing: its hooks did not run. Compiled code made without them may be in use "
                 f"(a torch.compile'd function that calls the model); attach the Recorder before "
                 f"compiling, or call torch.compiler.reset()")
        if events:
            if raise_nonfinite:
                e = events[0]
                raise NonFiniteError(
                    f"step {step}: {e.kind} of layer {e.layer!r} holds {e.nan} NaN, "
                    f"{e.posinf} +Inf and {e.neginf} -Inf values (first of {len(events)} "
                    f"non-finite captures in this step); the ring and this step were dumped")
