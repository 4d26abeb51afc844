"""The hooks' sink: the open step's captures, from the hooks to a step record.

The hooks hand every captured tensor to ``StepBuffer.add`` (the ``Sink`` of
``_hooks``).  It asks the ``StepState`` whether the tensor belongs to the open
step, the ``Summarizer`` for its capture (its summary started on its device,
its full tensor taken when the step keeps them), and appends it.  Nothing
there waits for a device or keeps a reference to the user's tensor.

When the step ends, ``end`` packs the step's captures (``Summarizer.pack``:
their copies to the host start) and returns a ``StepRecord`` (``_record``),
with the drops counted since the last one (``DropLedger``).  The record is
interpreted later, on the writer thread.

Anything raised while capturing is a fault (``fault``): the capture is
dropped and counted with its reason, a failing engine is demoted, and it
warns once per cause; training goes on.

``keeper``: under ``on_nonfinite="replay"``, the step's module calls kept for
a replay (``_keeper.Keeper``), else None.  The hooks hand it each recorded
call (``HookSet`` reads the attribute); ``_replayer.Replayer`` takes them when
the step ends.

Training thread; ``add`` and ``fault`` also on autograd's threads (a lock
guards the captures).  ``end`` holds its warnings until ``tell``, once its
record is handed on.
"""

from __future__ import annotations

import threading

import torch

from .. import format as fmt
from .._config import RecorderConfig
from ._drops import DropLedger, cause
from ..quiet import holding, warn
from ._record import CloseRecord, StepRecord, TensorRow
from ..replay._keeper import Keeper
from ._scalars import ScalarLog
from ._step import StepState
from ..capture._summarizer import EngineFailed, Summarizer, Taken
from ..errors import InspectionError

__all__ = ["StepBuffer"]

LATE_GRADIENT = "gradient arrived after its step"
_BACKWARD = frozenset(fmt.BACKWARD_KINDS)


class StepBuffer:
    """The captures of the open step (see the module)."""

    def __init__(self, config: RecorderConfig, known_layers: list[str], drops: DropLedger):
        self.config = config
        self.state = StepState(config)
        self.drops = drops                      # shared with the writer's handle
        self.summarizer = Summarizer(config, self.drops, self.fault)
        # on_nonfinite="replay": the calls the hooks keep for a replay (see the module)
        self.keeper: Keeper | None = (Keeper(config.max_replay_bytes)
                                      if config.on_nonfinite == "replay" else None)
        self.on_end: list = []                  # called when a step ends (the hooks' cleanup)
        self.captured = 0                       # captures of the last step ended
        self.pending: list[str] = []            # warnings held by end(), for tell()
        self._captures: list[Taken] = []
        self._lock = threading.Lock()           # backward hooks may run on autograd threads
        self._known = dict.fromkeys(known_layers)       # the run's names, in first-capture order
        self._warned: set[str] = set()
        # the Sink's questions about the step, answered by the state itself (no extra call)
        self.current_token = self.state.current_token
        self.scalars = ScalarLog(self.drops, self._warn_once)     # rec.log's
        self.micro = 0              # the Sink's: the state's, copied at each pass (read per capture)

    # --- the step ------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        self.state.begin(step)
        self.micro = self.state.micro
        self._captures = []
        self.tell()                             # what the last end() held, if not told yet

    # --- the hooks' side (the Sink: also ``current_token`` and ``micro``, above) ----------
    def eval_pass(self) -> bool:
        """A forward pass without grad inside the step (``StepState.eval_pass``)."""
        evaluating = self.state.eval_pass()
        self.micro = self.state.micro
        return evaluating

    def begin_pass(self) -> None:
        """The recorded model's forward begins (``StepState.begin_pass``); outside
        any step, ``outside_step`` says what to do."""
        outside = self.state.begin_pass()
        self.micro = self.state.micro
        if not outside:
            return
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

    def add(self, kind: fmt.Kind, name: str, tensor: torch.Tensor, token: object, micro: int) -> None:
        """One captured tensor of the step whose token is ``token`` (its forward
        call's micro-batch ``micro``)."""
        if token is None:                   # its forward was not recorded: neither is it
            return
        state = self.state
        if token is not state.token:
            self.drops.drop(LATE_GRADIENT)
            self._warn_once("late", f"tensortape: the gradient of {name!r} arrived after its step "
                            f"ended and was dropped; run backward inside the step "
                            f"(`with rec.step(): ...`)")
            return
        if state.paused:                    # inside pause(): nothing is recorded
            return
        if type(tensor) is not torch.Tensor and hasattr(tensor, "to_local"):
            tensor = tensor.to_local()          # a sharded DTensor (FSDP2): this rank's shard
        if tensor.requires_grad:            # an activation (a gradient needs no detach)
            tensor = tensor.detach()
        capture = self.summarizer.take(kind, name, micro, tensor, state.plan)
        with self._lock:
            capture.order = len(self._captures)
            self._captures.append(capture)

    def fault(self, error: BaseException, kind: fmt.Kind | str, name: str, n: int = 1) -> None:
        """Anything raised while capturing ``name``: that capture (or ``n`` of them) is
        dropped (counted with its reason), a failing statistics engine is demoted
        (``EngineFailed`` carries its tensor), and it warns once per cause.
        Training goes on."""
        tensor = None
        if isinstance(error, EngineFailed):
            error, tensor = error.error, error.tensor
        why = cause(error)
        self.drops.drop(f"capture failed ({why})", n)
        note = "" if tensor is None else "; " + self.summarizer.demote(tensor)
        self._warn_once(why, f"tensortape: capturing {kind} of {name!r} failed ({why}); the "
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

    # --- the step's end ------------------------------------------------------------------
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
        step, plan = self.state.end()
        for f in self.on_end:
            try:
                f()
            except Exception as e:       # never into training
                self.fault(e, "step end", "(hooks)")
        with self._lock:
            caps, self._captures = self._captures, []
        caps = self.state.without_evaluation(caps)
        # the names first recorded now, in capture order (an evaluation pass's are not recorded)
        new = [n for n in dict.fromkeys(c.name for c in caps) if n not in self._known]
        self._known.update(dict.fromkeys(new))
        self.captured = len(caps)
        # forward kinds first, then backward, each in capture order (the order appended)
        caps = [c for c in caps if c.kind not in _BACKWARD] + \
            [c for c in caps if c.kind in _BACKWARD]
        rec = StepRecord(step, plan, layers=new)
        for c in caps:                   # the full tensors: the captures (the metas) let them go
            if c.snap is not None:
                rec.tensors.append(TensorRow(c.kind, c.name, c.micro, c.snap))
                c.snap = None
        try:
            rec.metas, rec.blocks, rec.packed = self.summarizer.pack(caps)
        except Exception as e:           # never into training: the step's statistics are dropped
            why = cause(e)
            self.drops.drop(f"statistics failed ({why})", len(caps))
            self._warn_once(why, f"tensortape: the statistics of step {step} failed ({why}); "
                            f"they are dropped and counted; training goes on")
        rec.scalars = self.scalars.pack(step, self.summarizer.to_host)
        rec.drops = self.drops.take()
        rec.outside = self.state.take_outside()
        return rec

    def close_record(self) -> CloseRecord | None:
        """What was counted since the last record, outside any step (at close)."""
        scalars = self.scalars.pack(None, self.summarizer.to_host)
        drops, outside = self.drops.take(), self.state.take_outside()
        if not (drops or outside or scalars):
            return None
        return CloseRecord(drops, outside, scalars=scalars)

    def clear(self) -> None:
        self._captures = []
