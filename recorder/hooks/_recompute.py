"""Activation checkpointing: which serial a recomputed output's gradient carries.

Runs on the training thread (a checkpoint's forward) and on the autograd
engine's (its recomputation inside backward), always inside a ``HookSet``'s
guard.

``torch.utils.checkpoint`` runs a region's forward again inside backward, so
its hooks fire again.  A hook that fires while the autograd engine runs
(``_current_graph_task_id() != -1``, one C call) is such a recomputation: it
records nothing, is no new call (no name, no micro-batch, no pass of the root,
nothing kept for replay), and only decides which serial the recomputed
output's gradient carries: that of the forward call it repeats.  The
activations are the forward's own, once.

- Non-reentrant (Hugging Face's default): the forward's outputs are in the
  graph, and their gradient hooks fire; the recomputed outputs are never
  backpropagated.  Nothing to do (no serial).
- Reentrant: the forward runs without grad inside ``CheckpointFunction``'s
  forward, and the gradients flow through the recomputation that its
  backward runs.  An eager call without grad looks for that frame on the
  stack (``_checkpoint``); inside one, its outputs get serials as if they had
  a gradient, listed under the checkpoint's ctx (``Recomputation._segments``,
  weak keys).  The recomputation finds the same ctx on the stack and takes
  the serials of the forward's calls in order: the j-th call of a module there
  is its j-th call in the forward (``_Segment``).  The root called there is a
  training pass, not an evaluation.  A reentrant checkpoint inside another is
  listed under the outer one too; its forward inside the outer one's
  recomputation is the k-th listed (``_nested``).  A non-reentrant
  recomputation (which a reentrant backward may start, reading its saved
  inputs) hides the frames behind it.
- Compiled (AOTAutograd, Inductor): a checkpointed region is recomputed
  inside the backward graph, capture ops included, and the gradient carries
  the serial of the recomputed capture.  Each traced capture has a site of
  its own (``_ops._site``), the same in the recomputation, which returns the
  serial of its site's latest forward capture in this step that no
  recomputation has taken yet (``GradientLedger.of_site``): the graph run
  whose backward this is (the backward of several forward passes runs the
  latest first).  Run eagerly (``backend="eager"``), the recomputed outputs
  are never backpropagated, as in eager mode.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils.checkpoint import CheckpointFunction

from ._gradients import GradientLedger
from ..format import join

__all__ = ["Recomputation", "reentrant_forward"]

_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__
_CHECKPOINT_BACKWARD = CheckpointFunction.backward.__code__
# where a non-reentrant checkpoint recomputes (its saved tensors' unpack hook)
_NON_REENTRANT = (CheckpointFunction.forward.__code__.co_filename, ("unpack_hook", "recompute_fn"))


def _checkpoint(code, outer: int = 0):
    """The ctx of the innermost reentrant checkpoint whose ``forward`` or
    ``backward`` (``code``) runs on this thread's stack (``outer``: of the one that
    many levels further out), or None; none behind a non-reentrant checkpoint's
    recomputation (which a reentrant one's backward may start)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is code:
            if not outer:
                return f.f_locals.get("ctx")
            outer -= 1
        elif f.f_code.co_name in _NON_REENTRANT[1] \
                and f.f_code.co_filename == _NON_REENTRANT[0]:
            return None
        f = f.f_back
    return None


def reentrant_forward():
    """The ctx of the reentrant checkpoint whose forward runs here, or None."""
    return _checkpoint(_CHECKPOINT_FORWARD)


class _Call:
    """A module call inside a reentrant checkpoint's forward: its name, step and
    micro-batch, and the serials of its outputs by path."""

    __slots__ = ("module", "base", "token", "micro", "serials")

    def __init__(self, module: str, base: str, token, micro: int):
        self.module, self.base, self.token, self.micro = module, base, token, micro
        self.serials: dict[str, int] = {}


class _Segment:
    """A reentrant checkpoint's forward: its calls by module, in order, and how
    many of each its recomputation has repeated so far; the checkpoints inside it,
    in order, and how many of them its recomputation has run."""

    __slots__ = ("calls", "replayed", "inner", "nested")

    def __init__(self):
        self.calls: dict[str, list[_Call]] = {}
        self.replayed: dict[str, int] = {}
        self.inner: list[_Segment] = []
        self.nested = 0


class Recomputation:
    """The reentrant checkpoints' forward calls, and the call whose outputs are
    being captured; serials come from (and go to) ``ledger``."""

    def __init__(self, ledger: GradientLedger):
        self._ledger = ledger
        self._segments = weakref.WeakKeyDictionary()   # reentrant checkpoint ctx -> _Segment
        self._call: _Call | None = None                # the call whose outputs are captured

    def forward_call(self, module: str, base: str, token, micro: int) -> None:
        """A call of ``module`` without grad begins (named ``base``): inside a
        reentrant checkpoint's forward (whose recomputation will need its
        serials), its record in the checkpoint's list."""
        self._call = None
        if token is None:
            return
        ctx = reentrant_forward()
        if ctx is None:
            return
        segment = self._segments.get(ctx)
        if segment is None:
            segment = self._segments[ctx] = _Segment()
            outer = _checkpoint(_CHECKPOINT_FORWARD, 1)      # a checkpoint inside another
            if outer is not None:
                if outer not in self._segments:
                    self._segments[outer] = _Segment()
                self._segments[outer].inner.append(segment)
        self._call = call = _Call(module, base, token, micro)
        segment.calls.setdefault(module, []).append(call)

    def bind(self, path: str, serial: int) -> None:
        """The output at ``path`` of the call in a reentrant checkpoint's forward
        (``in_forward``) got ``serial``: its recomputation will carry it."""
        self._call.serials[path] = serial

    def in_forward(self, module: str) -> bool:
        """Whether ``module``'s call without grad is in a reentrant checkpoint's forward."""
        call = self._call
        return call is not None and call.module == module

    def recomputed(self, module: str, path: str, grad: bool, first: bool,
                   site: int) -> int | None:
        """An output (``grad``: whose gradient is wanted) captured while backward
        runs: a checkpoint recomputing a forward call.  Nothing is recorded; the
        serial its gradient must carry (None: none)."""
        if site:                                # compiled
            return self._ledger.of_site(site) if grad else None
        if not torch.is_grad_enabled():         # a checkpoint inside the one recomputed
            self._nested()
            return None
        if first:
            self._call = None
            ctx = _checkpoint(_CHECKPOINT_BACKWARD)
            segment = self._segments.get(ctx) if ctx is not None else None
            if segment is None:                 # non-reentrant: the forward's own outputs
                return None                     # carry the gradients
            calls = segment.calls.get(module)
            if not calls:
                raise RuntimeError("a checkpoint's recomputation called a module its forward "
                                   "did not call (does its control flow depend on state that "
                                   "changed?); the gradient is not recorded")
            j = segment.replayed.get(module, 0)
            segment.replayed[module] = j + 1
            self._call = calls[j % len(calls)]  # again from the start: another backward
        call = self._call
        if not grad or call is None or call.module != module:
            return None
        serial = call.serials.get(path)
        if serial is None:                      # an output that had no capture in the forward
            serial = call.serials[path] = self._ledger.expect(
                call.token, join(call.base, path), call.micro)
        return serial

    def _nested(self) -> None:
        """A reentrant checkpoint's forward inside the recomputation of another: the
        k-th such of the outer one is its k-th in the forward, whose calls its own
        recomputation will repeat."""
        self._call = None
        ctx = reentrant_forward()
        if ctx is None or ctx in self._segments:
            return
        recomputed = _checkpoint(_CHECKPOINT_BACKWARD)
        outer = self._segments.get(recomputed) if recomputed is not None else None
        if outer is not None and outer.inner:
            segment = outer.inner[outer.nested % len(outer.inner)]
            outer.nested += 1
            segment.replayed = {}
            self._segments[ctx] = segment
