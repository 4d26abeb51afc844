"""The open step: its number, token and plan, and its passes.

``StepState`` says which step is open (``step``; its ``token``, which every
capture of the step carries, so that a gradient arriving after its step is
told apart), what the step does with its captures (its ``Plan``, decided once
when it begins), and how the recorded model's forward passes count:

- each forward pass with grad inside a step is a micro-batch (``micro``: 0,
  1, ...);
- a pass without grad after the step's first training pass is an evaluation
  pass: nothing of it is recorded, it is counted with the passes outside
  steps (``eval_pass``);
- passes without grad before the first training pass are recorded as
  micro-batches until one with grad comes; then they were evaluation passes
  after all, and the step's end drops their captures and numbers the training
  passes from 0 (``without_evaluation``); a step of passes without grad alone
  (recording inference) keeps them;
- a pass outside any step is counted (``outside_total``), never recorded;
- inside ``rec.pause()`` (``paused``), nothing counts.

Training thread only (the hooks of forward passes, and ``rec.step``); the
token is read from autograd's threads too, and only replaced, never changed.
"""

from __future__ import annotations

from typing import Protocol

from .._config import RecorderConfig
from ._record import Plan
from ..format import Kind

__all__ = ["StepState"]

_ONCE_A_STEP = frozenset({Kind.WEIGHTS, Kind.WEIGHT_GRADS})   # the step's, not a pass's


class _Micro(Protocol):
    kind: Kind
    micro: int


class StepState:
    """The open step (see the module)."""

    def __init__(self, config: RecorderConfig):
        self.config = config
        self.step: int | None = None
        self.token: object | None = None
        self.plan: Plan | None = None
        self.paused = 0                         # nesting of rec.pause()
        self.micro = 0                          # the open step's current micro-batch
        self._passes = 0                        # forward passes of the open step
        self._trained = False                   # one of them ran with grad
        self._untrained = 0                     # passes without grad before the first that did
        self._outside = 0                       # passes outside a step since the last record
        self.outside_total = 0

    def begin(self, step: int) -> None:
        self.step, self.token = step, object()
        self.plan = Plan.at(self.config, step)
        self.micro = self._passes = 0
        self._trained, self._untrained = False, 0

    def end(self) -> tuple[int, Plan]:
        """Close the open step: its number and plan."""
        step, plan = self.step, self.plan
        self.step = self.token = None
        return step, plan

    def current_token(self) -> object | None:
        """The open step's token; None outside a step or while paused (nothing is
        recorded then)."""
        return None if self.paused else self.token

    def begin_pass(self) -> bool:
        """The recorded model's forward begins: a new micro-batch of the open step
        (False), or a forward pass outside any step (True: counted; the caller
        applies ``outside_step``).  Nothing while paused."""
        if self.paused:
            return False
        if self.token is not None:
            self.micro, self._passes = self._passes, self._passes + 1
            self._trained = True
            return False
        self._count_outside(1)
        return True

    def eval_pass(self) -> bool:
        """A forward pass without grad inside the open step: an evaluation pass
        (True: record nothing of it), counted with the passes outside steps; or,
        until a pass with grad has run in the step, a micro-batch after all
        (False; see the module)."""
        if self._trained:
            self._count_outside(1)
            return True
        self.micro, self._passes = self._passes, self._passes + 1
        self._untrained += 1
        return False

    def without_evaluation(self, caps: list[_Micro]) -> list[_Micro]:
        """At the step's end: if a training pass ran, the passes without grad before
        it were evaluation passes: their captures go (not the weights and weight
        gradients, taken once a step), they are counted, and the training passes
        are micro-batches 0, 1, ..."""
        n, self._untrained = self._untrained, 0
        if not (n and self._trained):
            return caps
        self._count_outside(n)
        kept = []
        for c in caps:
            if c.kind in _ONCE_A_STEP:
                c.micro = max(c.micro - n, 0)
            elif c.micro < n:
                continue
            else:
                c.micro -= n
            kept.append(c)
        return kept

    def take_outside(self) -> int:
        """The passes outside a step since the last call (for a record)."""
        n, self._outside = self._outside, 0
        return n

    def _count_outside(self, n: int) -> None:
        self._outside += n
        self.outside_total += n
