"""The one place where hooks are registered on a model, and removed.

A ``HookSet`` turns module calls into named captures and hands each one to a
sink (``_step.StepBuffer``, or the Inspector): ``sink.add(kind, name, tensor,
token, micro)``.  ``sink.current_token()`` identifies the step a capture
belongs to; a gradient carries the token, name and micro-batch of the forward
call that produced it (its *serial*), whenever it arrives.

The hooks are traceable by ``torch.compile``: they only walk a module's
output (or inputs) and hand each tensor to ``_ops`` (custom ops while
compiling, the plain Python body in eager mode), and register a gradient
hook that does the same.  So recording adds no graph break; everything
stateful (names, call counts, steps) happens at run time, in ``on_forward``
and ``on_gradient``.  Attaching also makes sure that code compiled without
the hooks is not reused (``_see_hooks``).

**The guard.**  ``on_pass``, ``on_forward`` and ``on_gradient`` are the only
ways from a hook into tensortape, and each catches whatever it raises: the
capture is dropped and counted (``sink.fault``), and training goes on.  Only
the policies a user chose raise through it (``_POLICY``), a tensortape warning
that the user's filters make an error included.

Hooks act only on the modules they were attached to: a ``deepcopy`` of the
model (an EMA or evaluation copy) carries no-op hooks.

**Evaluation passes.**  A call of the root module under ``no_grad`` or
``inference_mode`` inside a step is an evaluation pass (``on_pass`` with
``grad=False``): it is not a micro-batch, nothing of it is recorded, and the
sink counts it (``sink.eval_pass``, where the sink has one).  A step of such
passes alone (recording inference) records them: the sink decides
(``StepBuffer.eval_pass``).

**Leaf outputs.**  A module whose output is a leaf (``return self.pe``: a
parameter, a buffer, an input that requires grad) hands the hook a tensor that
outlives the forward pass, so a gradient hook on it would stay for good.  Such
a hook (``leaf_hook``) is registered only for a recorded call, acts once (the
gradient of that call's backward), and is removed when its step ends (the
sink's ``on_end``), at the next step and at ``detach``.

**Checkpointing.**  ``torch.utils.checkpoint`` runs a region's forward again
inside backward, so its hooks fire again.  A hook that fires while the
autograd engine runs (``_current_graph_task_id() != -1``, one C call) is such
a recomputation: it records nothing, is no new call (no name, no micro-batch,
no pass of the root, nothing kept for replay), and only decides which serial
the recomputed output's gradient carries: that of the forward call it
repeats.  The activations are the forward's own, once.

- Non-reentrant (Hugging Face's default): the forward's outputs are in the
  graph, and their gradient hooks fire; the recomputed outputs are never
  backpropagated.  Nothing to do (-1).
- Reentrant: the forward runs without grad inside ``CheckpointFunction``'s
  forward, and the gradients flow through the recomputation that its
  backward runs.  An eager call without grad looks for that frame on the
  stack (``_checkpoint``); inside one, its outputs get serials as if they had
  a gradient, listed under the checkpoint's ctx (``_segments``, weak keys).
  The recomputation finds the same ctx on the stack and takes the serials of
  the forward's calls in order: the j-th call of a module there is its j-th
  call in the forward (``_Segment``).  The root called there is a training
  pass, not an evaluation.  A reentrant checkpoint inside another is listed
  under the outer one too; its forward inside the outer one's recomputation
  is the k-th listed (``_nested``).  A non-reentrant recomputation (which a
  reentrant backward may start, reading its saved inputs) hides the frames
  behind it.
- Compiled (AOTAutograd, Inductor): a checkpointed region is recomputed
  inside the backward graph, capture ops included, and the gradient carries
  the serial of the recomputed capture.  Each traced capture has a site of
  its own (``_ops._site``), the same in the recomputation, which returns the
  serial of its site's latest forward capture in this step that no
  recomputation has taken yet (``_of_site``): the graph run whose backward
  this is (the backward of several forward passes runs the latest first).
  Run eagerly (``backend="eager"``), the recomputed outputs are never
  backpropagated, as in eager mode.

The common path pays one C call per capture, and a grad-mode check per call.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from . import _ops
from ._naming import input_leaves, leaves
from ._quiet import quiet, warn
from ._selection import module_table, unwrap
from .errors import InspectionError, NonFiniteError, TensortapeWarning
from .format import join, label

__all__ = ["HookSet"]


# what may raise through the guard: the policies a user chose
# a TensortapeWarning raised as an error is a policy too: the user's filter chose it
_POLICY = (InspectionError, NonFiniteError, TensortapeWarning)
_STALE = object()          # the token of a step that is gone: never the open step's
_graph_task = torch._C._current_graph_task_id      # -1 unless the autograd engine runs here
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


class Sink(Protocol):
    def add(self, kind: str, name: str, tensor: torch.Tensor, token: object, micro: int) -> None: ...

    def current_token(self) -> object: ...

    def begin_pass(self) -> None: ...

    def fault(self, error: BaseException, kind: str, name: str) -> None: ...

    micro: int


class HookSet:
    def __init__(self, model: nn.Module, names: list[str], kinds: tuple[str, ...], sink: Sink):
        table = module_table(model)
        self._model = model                                   # as given: maybe compiled
        self._root_label = label("", table)
        self._root = unwrap(model)
        self._modules = [(n, table[n]) for n in names]
        self._kinds = set(kinds)
        self._sink = sink
        self._keeper = getattr(sink, "keeper", None)          # on_nonfinite="replay"
        self._handles: list = []
        self._calls: dict[tuple[str, str], int] = {}          # calls in this forward pass
        self._weighed: set[str] = set()                       # weights captured this step
        self._names: dict[str, str] = {}                     # module -> base name of its call
        # gradients expected: (token, name, micro, site); and those of the step before
        self._serials: dict[int, tuple] = {}
        self._older: dict[int, tuple] = {}
        self._segments = weakref.WeakKeyDictionary()   # reentrant checkpoint ctx -> _Segment
        self._call: _Call | None = None        # the call whose outputs are being captured
        self._by_site: dict[int, list] = {}    # site -> serials of this step not recomputed
        self._indexed = 0                      # the last serial in _by_site
        self._serial = 0
        self._probe: tuple | None = None
        self._depth = 0                                      # nesting of root-module calls
        self._evaluating = False                   # the root's outermost call is under no_grad
        self._leaf_handles: list = []              # gradient hooks on leaf outputs, this step
        self.id = _ops.register(self)
        self._evaluating_as = _NoGrad(self)        # the root's calls without grad go here
        self.eval_id = _ops.register(self._evaluating_as)
        ends = getattr(sink, "on_end", None)       # the sink says when a step ends
        if ends is not None:
            ends.append(self.end_step)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        pre = frozenset(self._kinds & {"inputs", "weights"})
        post = frozenset(self._kinds & {"activations", "gradients"})
        self._handles.append(self._root.register_forward_pre_hook(
            _PassHook(self.id, True, self.eval_id), with_kwargs=True))
        for name, module in self._modules:
            if pre:
                self._handles.append(module.register_forward_pre_hook(
                    _PreHook(self.id, name, pre), with_kwargs=True))
            if post:
                self._handles.append(module.register_forward_hook(_PostHook(self.id, name, post)))
        if self._keeper is not None:
            for name, module in self._modules:
                self._handles.append(module.register_forward_pre_hook(
                    _KeepHook(self.id, name, frozenset(), True), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    _KeepHook(self.id, name, frozenset(), False), always_call=True))
        self._handles.append(self._root.register_forward_hook(
            _PassHook(self.id, False, self.eval_id), always_call=True))
        _see_hooks(self._model)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.end_step()
        _ops.unregister(self.id)
        _ops.unregister(self.eval_id)

    def end_step(self) -> None:
        """The step ended: the gradient hooks on leaf outputs go (a parameter keeps
        no hook of tensortape's between steps)."""
        handles, self._leaf_handles = self._leaf_handles, []
        for h in handles:
            h.remove()

    def new_step(self) -> None:
        self.end_step()
        self._calls.clear()
        self._weighed.clear()
        self._depth = 0
        self._evaluating = False
        self._older, self._serials = self._serials, {}
        self._by_site, self._indexed = {}, self._serial
        self._probe = self._grad_state()

    def weight_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``module:param`` and ``.grad`` of every hooked module's own parameters."""
        for name, module in self._modules:
            for pname, p in module.named_parameters(recurse=False):
                if p.grad is not None:
                    yield f"{self._label(name)}:{pname}", p.grad

    def backward_ran(self) -> bool:
        """Whether a gradient reached the model's first parameter since ``new_step``:
        the model ran, whether or not its hooks did."""
        return self._probe is not None and self._grad_state() != self._probe

    def _label(self, module: str) -> str:
        return module or self._root_label

    def _grad_state(self):
        p = next(self._root.parameters(), None)
        g = None if p is None else p.grad
        return ("grad", None) if g is None else ("grad", id(g), g._version)

    # --- called from the hooks (through ``_ops``), at run time: the guard ------------
    def on_pass(self, enter: bool, grad: bool = True) -> None:
        """The root module's forward begins (``enter``) or ends: the outermost call
        begins a forward pass, whose module calls are named afresh.  An outermost
        call without grad (``grad=False``) inside a step is an evaluation pass: no
        micro-batch, nothing recorded until it ends, counted by the sink."""
        try:
            if _graph_task() != -1:             # a checkpoint recomputing the root: no pass
                return
            if enter:
                self._depth += 1
                if self._depth == 1:
                    ctx = None if grad else _reentrant_forward()
                    if ctx is not None and any(ctx.needs_input_grad):
                        grad = True                 # a reentrant checkpoint's forward trains
                    evaluate = getattr(self._sink, "eval_pass", None)
                    if not grad and evaluate is not None \
                            and self._sink.current_token() is not None:
                        self._evaluating = evaluate()      # False: a micro-batch after all
                        if not self._evaluating:
                            self._calls.clear()
                    else:
                        self._evaluating = False
                        self._calls.clear()
                        self._sink.begin_pass()
            else:
                self._depth = max(self._depth - 1, 0)
                if self._depth == 0:
                    self._evaluating = False
        except _POLICY:
            raise
        except Exception as e:
            self._sink.fault(e, "forward pass", self._root_label)

    def on_forward(self, x: torch.Tensor, module: str, path: str, what: str, first: bool,
                   site: int = 0) -> int:
        """One tensor of a module call; the serial its gradient will carry (or -1).
        ``site``: the capture op's in compiled code (0: eager)."""
        try:
            if _graph_task() != -1:             # inside backward: a checkpoint recomputes
                return self._recomputed(module, path, what, first, site)
            return self._forward(x, module, path, what, first, site)
        except _POLICY:
            raise
        except Exception as e:
            self._sink.fault(e, what.split("+")[0], join(self._label(module), path))
            return -1

    def on_keep(self, module: str, mod: nn.Module, args, kwargs, output=None,
                enter: bool = True) -> None:
        """A recorded module's call begins or ends (``on_nonfinite="replay"``): the
        keeper holds its inputs and outputs until the step ends."""
        try:
            if self._sink.current_token() is None or self._evaluating \
                    or _graph_task() != -1:     # not recorded, or a checkpoint recomputing it
                return
            if enter:
                k = self._calls.get(("keep", module), 0)
                self._calls[("keep", module)] = k + 1
                name = self._label(module) + (f"#{k}" if k else "")
                self._keeper.enter(module, name, self._sink.micro, mod, args, kwargs)
            else:
                self._keeper.leave(module, output)
        except Exception as e:
            self._sink.fault(e, "replay inputs", self._label(module))

    def on_fault(self, error: BaseException, module: str) -> None:
        """An eager hook of ``module`` raised outside the methods above."""
        self._sink.fault(error, "capture", self._label(module))

    def on_gradient(self, serial: int, g: torch.Tensor) -> None:
        """The gradient of the output whose capture had ``serial`` (-1: none was
        recorded, so neither is this).  A serial of a step older than the last is
        a late gradient, dropped and counted like any."""
        found = self._serials.get(serial) or self._older.get(serial)
        if found is None:
            found = (_STALE, "an output of an earlier step", 0) if serial > 0 else (None, "?", 0)
        token, name, micro = found[:3]
        try:
            if self._keeper is not None and token is self._sink.current_token():
                self._keeper.grad(serial, g)
            self._sink.add("gradients", name, g, token, micro)
        except _POLICY:
            raise
        except Exception as e:
            self._sink.fault(e, "gradients", name)

    def leaf_hook(self, t: torch.Tensor, serial) -> None:
        """The gradient hook of a leaf output whose capture had ``serial``: only for a
        recorded call; it acts once, and goes when the step ends."""
        serial = int(serial)
        if serial <= 0:                         # not recorded (outside a step, paused, eval)
            return
        self._leaf_handles.append(t.register_hook(_Once(serial, self.id)))

    def _forward(self, x: torch.Tensor, module: str, path: str, what: str, first: bool,
                 site: int) -> int:
        if self._evaluating:                    # an evaluation pass: nothing is recorded
            return -1
        token = self._sink.current_token()
        micro = self._sink.micro
        phase = "pre" if what in ("inputs", "weights") else "post"
        if first:                                   # a new call of the module
            k = self._calls.get((phase, module), 0)
            self._calls[(phase, module)] = k + 1
            self._names[phase + module] = base = self._label(module) + (f"#{k}" if k else "")
            if phase == "post" and not site and not torch.is_grad_enabled():
                self._call = self._segment_call(module, base, token, micro)
        if what == "weights":            # a module's weights: once a step, not per micro-batch
            name = f"{self._label(module)}:{path}"
            if token is not None and name not in self._weighed:    # recorded, not paused
                self._weighed.add(name)
                self._sink.add("weights", name, x, token, micro)
            return -1
        name = join(self._names[phase + module], path)
        if what != "gradients":
            self._sink.add(what.split("+")[0], name, x, token, micro)
        if "gradients" not in what or token is None:
            return -1
        call = None
        if not site and not torch.is_grad_enabled():    # no gradient, unless the call is
            call = self._call                           # a reentrant checkpoint's forward
            if call is None or call.module != module:
                return -1
        self._serial += 1
        self._serials[self._serial] = (token, name, micro, site)
        if call is not None:
            call.serials[path] = self._serial
        if self._keeper is not None:            # on_nonfinite="replay": its gradient is kept
            self._keeper.bind(module, path, self._serial)
        return self._serial

    # --- checkpointing (see the module's docstring) -------------------------------------
    def _segment_call(self, module: str, base: str, token, micro: int) -> _Call | None:
        """A call without grad: inside a reentrant checkpoint's forward (whose
        recomputation will need its serials), its record in the checkpoint's list."""
        if token is None:
            return None
        ctx = _reentrant_forward()
        if ctx is None:
            return None
        segment = self._segments.get(ctx)
        if segment is None:
            segment = self._segments[ctx] = _Segment()
            outer = _checkpoint(_CHECKPOINT_FORWARD, 1)      # a checkpoint inside another
            if outer is not None:
                if outer not in self._segments:
                    self._segments[outer] = _Segment()
                self._segments[outer].inner.append(segment)
        call = _Call(module, base, token, micro)
        segment.calls.setdefault(module, []).append(call)
        return call

    def _recomputed(self, module: str, path: str, what: str, first: bool, site: int) -> int:
        """A capture while backward runs: a checkpoint recomputing a forward call.
        Nothing is recorded; the serial its gradient must carry (-1: none)."""
        if what in ("inputs", "weights"):
            return -1
        if site:                                # compiled
            return self._of_site(site) if "gradients" in what else -1
        if not torch.is_grad_enabled():         # a checkpoint inside the one recomputed
            self._nested()
            return -1
        if first:
            self._call = None
            ctx = _checkpoint(_CHECKPOINT_BACKWARD)
            segment = self._segments.get(ctx) if ctx is not None else None
            if segment is None:                 # non-reentrant: the forward's own outputs
                return -1                       # carry the gradients
            calls = segment.calls.get(module)
            if not calls:
                raise RuntimeError("a checkpoint's recomputation called a module its forward "
                                   "did not call (does its control flow depend on state that "
                                   "changed?); the gradient is not recorded")
            j = segment.replayed.get(module, 0)
            segment.replayed[module] = j + 1
            self._call = calls[j % len(calls)]  # again from the start: another backward
        call = self._call
        if "gradients" not in what or call is None or call.module != module:
            return -1
        serial = call.serials.get(path)
        if serial is None:                      # an output that had no capture in the forward
            self._serial += 1
            serial = self._serial
            call.serials[path] = serial
            self._serials[serial] = (call.token, join(call.base, path), call.micro, 0)
        return serial

    def _nested(self) -> None:
        """A reentrant checkpoint's forward inside the recomputation of another: the
        k-th such of the outer one is its k-th in the forward, whose calls its own
        recomputation will repeat."""
        self._call = None
        ctx = _reentrant_forward()
        if ctx is None or ctx in self._segments:
            return
        recomputed = _checkpoint(_CHECKPOINT_BACKWARD)
        outer = self._segments.get(recomputed) if recomputed is not None else None
        if outer is not None and outer.inner:
            segment = outer.inner[outer.nested % len(outer.inner)]
            outer.nested += 1
            segment.replayed = {}
            self._segments[ctx] = segment

    def _of_site(self, site: int) -> int:
        """The serial of the forward capture that a compiled recomputation with
        ``site`` repeats: the latest of this step not taken yet, else the step
        before's latest (a late gradient), else -1 (not recorded)."""
        for s in range(self._indexed + 1, self._serial + 1):   # index the new ones
            found = self._serials.get(s)
            if found is not None and found[3]:
                self._by_site.setdefault(found[3], []).append(s)
        self._indexed = self._serial
        latest = self._by_site.get(site)
        if latest:
            return latest.pop()
        for s, found in reversed(self._older.items()):
            if found[3] == site:
                return s
        return -1


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


class _Call:
    """A module call inside a reentrant checkpoint's forward: its name, step and
    micro-batch, and the serials of its outputs by path."""

    __slots__ = ("module", "base", "token", "micro", "serials")

    def __init__(self, module: str, base: str, token, micro: int):
        self.module, self.base, self.token, self.micro = module, base, token, micro
        self.serials: dict[str, int] = {}


def _reentrant_forward():
    """The ctx of the reentrant checkpoint whose forward runs here, or None."""
    return _checkpoint(_CHECKPOINT_FORWARD)


class _Hook:
    """A hook: the HookSet's id, the module's name and what to capture.  A deep
    copy (of a hooked model) is a no-op hook.

    In eager mode the whole hook runs under the guard (whatever its walk of the
    output raises is a dropped capture); while compiling, Dynamo traces ``run``
    alone, and the guard is in ``HookSet``'s methods, which run eagerly."""

    def __init__(self, hookset: int, module: str, kinds: frozenset):
        self.hookset, self.module, self.kinds = hookset, module, kinds

    def __deepcopy__(self, memo):
        return _noop

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.run(*args)
        try:
            return self.run(*args)
        except _POLICY:
            raise
        except Exception as e:
            _ops.fault(self.hookset, e, self.module)
            return None

    def run(self, *args):
        raise NotImplementedError


def _noop(*args):
    return None


class _NoGrad:
    """The HookSet as the root's calls without grad see it (registered in ``_ops``
    under its own id): ``on_pass`` with ``grad=False``.  The grad mode is read
    where the hook is traced (Dynamo guards on it), never inside the op: in
    compiled code it runs in an autograd Function's forward, always without
    grad.  So telling an evaluation pass apart costs no graph break."""

    def __init__(self, hookset: HookSet):
        self._hookset = weakref.ref(hookset)

    def on_pass(self, enter: bool) -> None:
        hs = self._hookset()
        if hs is not None:
            hs.on_pass(enter, grad=False)


class _PassHook(_Hook):
    def __init__(self, hookset: int, enter: bool, no_grad: int):
        super().__init__(hookset, "", frozenset())
        self.enter, self.no_grad = enter, no_grad

    def run(self, module, args, *rest):
        target = self.hookset if torch.is_grad_enabled() else self.no_grad
        _ops.forward_pass(target, self.enter)
        return None


class _PreHook(_Hook):
    def run(self, module, args, kwargs):
        first = True
        if "inputs" in self.kinds:
            for path, t in input_leaves(args, kwargs):
                _ops.capture(t, self.hookset, self.module, path, "inputs", first)
                first = False
        if "weights" in self.kinds:
            for pname, p in module.named_parameters(recurse=False):
                _ops.capture(p, self.hookset, self.module, pname, "weights", first)
                first = False
        return None


class _PostHook(_Hook):
    def run(self, module, args, output):
        acts, grads = "activations" in self.kinds, "gradients" in self.kinds
        # eager, without grad: maybe a reentrant checkpoint's forward, whose outputs
        # get their gradients through its recomputation (HookSet._segment_call)
        later = grads and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        first = True
        for path, t in leaves(output):
            wants_grad = grads and t.requires_grad
            if not (acts or wants_grad or later):
                continue
            what = "activations+gradients" if acts and (wants_grad or later) else \
                "activations" if acts else "gradients"
            serial = _ops.capture(t, self.hookset, self.module, path, what, first)
            first = False
            if wants_grad:
                if t.is_leaf:                   # a leaf (a parameter, a buffer): it outlives
                    if torch.is_grad_enabled():     # the pass: see leaf_hook (a call without
                        _leaf_hook(t, serial, self.hookset)     # grad has no gradient)
                else:
                    t.register_hook(functools.partial(_grad_hook, serial=serial,
                                                      hookset=self.hookset))
        return None


class _KeepHook(_Hook):
    """``on_nonfinite="replay"``: hands a call's inputs (``enter``) or outputs to the
    keeper; it runs eagerly, even in a compiled model (a graph break per call)."""

    def __init__(self, hookset: int, module: str, kinds: frozenset, enter: bool):
        super().__init__(hookset, module, kinds)
        self.enter = enter

    @torch.compiler.disable
    def __call__(self, *args):
        return super().__call__(*args)

    def run(self, module, args, last):
        hs = _ops.hookset(self.hookset)
        if hs is not None:
            if self.enter:
                hs.on_keep(self.module, module, args, last)
            else:
                hs.on_keep(self.module, module, None, None, last, enter=False)
        return None


def _grad_hook(grad, serial, hookset):
    _ops.capture_grad(grad, serial, hookset)


@torch.compiler.disable
def _leaf_hook(t, serial, hookset: int) -> None:
    hs = _ops.hookset(hookset)
    if hs is not None:
        hs.leaf_hook(t, serial)


class _Once:
    """A leaf output's gradient hook: the first gradient after its call is that
    call's; later ones (another micro-batch's backward) are not."""

    __slots__ = ("serial", "hookset", "done")

    def __init__(self, serial: int, hookset: int):
        self.serial, self.hookset, self.done = serial, hookset, False

    def __call__(self, grad):
        if self.done:
            return None
        self.done = True
        hs = _ops.hookset(self.hookset)
        if hs is not None:
            hs.on_gradient(self.serial, grad)
        return None


def _compiled_frames(model: nn.Module) -> set:
    """The code objects whose compiled code may run ``model``: the ``forward`` of
    every module class in it (the root included), the frames a ``torch.compile``
    wrapper compiles (Dynamo's wrapper of the module's call, shared by every
    compiled module), and ``Module._call_impl`` when a module was compiled in
    place (``module.compile()``)."""
    codes = set()
    for m in model.modules():
        codes.add(getattr(type(m).forward, "__code__", None))
        f = m.__dict__.get("forward")              # a torch.compile wrapper's own forward
        while f is not None:
            codes.add(getattr(f, "__code__", None))
            f = getattr(f, "__wrapped__", None)
        if getattr(m, "_compiled_call_impl", None) is not None:
            codes.add(nn.Module._call_impl.__code__)
    codes.discard(None)
    return codes


def _see_hooks(model: nn.Module) -> None:
    """Make compiled code see the hooks just attached (and later removed).

    Dynamo does not guard on module hooks by default, so code compiled before
    (for this model, or for another instance of its class) would run on without
    them.  From now on it guards on them (a length check per hooks dict), and the
    compiled code of every frame that can run this model (``_compiled_frames``)
    is dropped: the model recompiles once, with its hooks.  A frame shared with
    other compiled models (Dynamo's wrapper) makes them recompile once too.
    """
    try:
        with quiet():              # importing Dynamo may warn: torch's news, not the user's
            import torch._dynamo
            torch._dynamo.config.skip_nnmodule_hook_guards = False
            from torch._C._dynamo.eval_frame import reset_code
    except Exception as e:  # no Dynamo here: nothing can be compiled
        warn(f"tensortape: cannot make compiled code see the hooks ({e})")
        return
    for code in _compiled_frames(model):
        reset_code(code)
