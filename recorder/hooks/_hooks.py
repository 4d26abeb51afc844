"""The one place where hooks are registered on a model, and removed.

Runs on the training thread (the forward hooks) and on autograd's threads
(the gradient hooks).

A ``HookSet`` turns module calls into named captures and hands each one to a
sink (``_buffer.StepBuffer``, or the Inspector): ``sink.add(kind, name, tensor,
token, micro)``.  ``sink.current_token()`` identifies the step a capture
belongs to; a gradient carries the token, name and micro-batch of the forward
call that produced it (its *serial*), whenever it arrives.  Its rooms: call
names (``_callnames``), serials and leaf outputs (``_gradients``), activation
checkpointing (``_recompute``: a hook that fires while the autograd engine
runs is a recomputation) and Dynamo (``_compile``).

The hooks are traceable by ``torch.compile``: they only walk a module's
output (or inputs) and hand each tensor to ``_ops`` (custom ops while
compiling, the plain Python body in eager mode), and register a gradient
hook that does the same.  So recording adds no graph break; everything
stateful (names, call counts, steps) happens at run time, in ``on_forward``
and ``on_gradient``.  Attaching also makes sure that code compiled without
the hooks is not reused (``_compile``).

**The guard.**  ``on_pass``, ``on_forward`` and ``on_gradient`` are the only
ways from a hook into tensortape, and each catches whatever it raises: the
capture is dropped and counted (``sink.fault``), and training goes on.  Only
the policies a user chose raise through it (``_POLICY``), a tensortape warning
that the user's filters make an error included.

The common path pays one C call per capture, and a grad-mode check per call.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from . import _ops
from ._callnames import CallNamer, Phase
from ._compile import HookGuards
from ._gradients import BackwardProbe, GradientLedger
from ._naming import input_leaves, leaves
from ._ops import What
from ._recompute import Recomputation, reentrant_forward
from ._selection import module_table, unwrap
from ..errors import InspectionError, NonFiniteError, TensortapeWarning
from ..format import BATCH, Kind, join, label

if TYPE_CHECKING:
    from ..replay._keeper import Keeper

__all__ = ["HookSet"]


# what may raise through the guard: the policies a user chose
# a TensortapeWarning raised as an error is a policy too: the user's filter chose it
_POLICY = (InspectionError, NonFiniteError, TensortapeWarning)
_graph_task = torch._C._current_graph_task_id      # -1 unless the autograd engine runs here
# an enum's member read from its class costs 50 ns: the hot path reads these
_PRE, _POST = Phase.PRE, Phase.POST
_INPUTS, _WEIGHTS, _ACTIVATIONS = What.INPUTS, What.WEIGHTS, What.ACTIVATIONS
_K_GRADIENTS, _K_WEIGHTS = Kind.GRADIENTS, Kind.WEIGHTS


class Sink(Protocol):
    """Where captures go (``_buffer.StepBuffer``, the Inspector's).  ``on_end``: the
    callbacks it calls when a step ends; ``eval_pass()``: a forward pass without
    grad inside a step began (True: an evaluation pass, not recorded)."""

    micro: int
    on_end: list
    def add(self, kind: Kind, name: str, tensor: torch.Tensor, token: object, micro: int) -> None: ...
    def current_token(self) -> object: ...
    def begin_pass(self) -> None: ...
    def fault(self, error: BaseException, kind: Kind | str, name: str) -> None: ...
    def eval_pass(self) -> bool: ...


class HookSet:
    def __init__(self, model: nn.Module, names: list[str], kinds: tuple[Kind | str, ...], sink: Sink,
                 *, keeper: Keeper | None):
        table = module_table(model)
        self._model = model                                   # as given: maybe compiled
        self._root = unwrap(model)
        self._modules = [(n, table[n]) for n in names]
        self._kinds = frozenset(kinds)
        self._sink = sink
        self._keeper = keeper                                 # on_nonfinite="replay"
        self._handles: list = []
        self._names = CallNamer(label("", table))
        self._weighed: set[str] = set()                       # weights captured this step
        self._gradients = GradientLedger()
        self._lookup = self._gradients.lookup
        self._recompute = Recomputation(self._gradients)
        self._guards = HookGuards()
        self._probe = BackwardProbe(self._root)
        self._depth = 0                                      # nesting of root-module calls
        self._evaluating = False                   # the root's outermost call is under no_grad
        self.id = _ops.register(self)
        self._evaluating_as = _NoGrad(self)        # the root's calls without grad go here
        self.eval_id = _ops.register(self._evaluating_as)
        sink.on_end.append(self.end_step)          # the sink says when a step ends

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        k = self._kinds
        pre = Kind.INPUTS in k or Kind.WEIGHTS in k
        post = Kind.ACTIVATIONS in k or Kind.GRADIENTS in k
        self._handles.append(self._root.register_forward_pre_hook(
            _PassHook(self.id, True, self.eval_id), with_kwargs=True))
        if BATCH in k and not (Kind.INPUTS in k and "" in dict(self._modules)):
            # the root's integer inputs (its pass has begun: they are its micro-batch's)
            self._handles.append(self._root.register_forward_pre_hook(
                _PreHook(self.id, "", True, False, integers=True), with_kwargs=True))
        for name, module in self._modules:
            if pre:
                self._handles.append(module.register_forward_pre_hook(
                    _PreHook(self.id, name, Kind.INPUTS in k, Kind.WEIGHTS in k), with_kwargs=True))
            if post:
                self._handles.append(module.register_forward_hook(
                    _PostHook(self.id, name, Kind.ACTIVATIONS in k, Kind.GRADIENTS in k)))
        if self._keeper is not None:
            for name, module in self._modules:
                self._handles.append(module.register_forward_pre_hook(
                    _KeepHook(self.id, name, True), with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    _KeepHook(self.id, name, False), always_call=True))
        self._handles.append(self._root.register_forward_hook(
            _PassHook(self.id, False, self.eval_id), always_call=True))
        self._guards.see_hooks(self._model)

    def detach(self, wait: bool = True) -> None:
        """Remove the hooks; ``wait=False`` (a finaliser): wait for no lock."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._guards.release(wait)
        self.end_step()
        _ops.unregister(self.id)
        _ops.unregister(self.eval_id)

    def end_step(self) -> None:
        """The step ended: the gradient hooks on leaf outputs go."""
        self._gradients.end_step()

    def new_step(self) -> None:
        self._names.new_pass()
        self._weighed.clear()
        self._depth = 0
        self._evaluating = False
        self._gradients.new_step()
        self._probe.reset()

    def weight_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``module:param`` and ``.grad`` of every hooked module's own parameters."""
        for name, module in self._modules:
            for pname, p in module.named_parameters(recurse=False):
                if p.grad is not None:
                    yield f"{self._names.label(name)}:{pname}", p.grad

    def backward_ran(self) -> bool:
        """Whether a gradient reached the model since ``new_step``: the model ran,
        whether or not its hooks did."""
        return self._probe.ran()

    # --- called from the hooks (through ``_ops``), at run time: the guard ------------
    def on_pass(self, enter: bool, grad: bool = True) -> None:
        """The root module's forward begins (``enter``) or ends: the outermost call
        begins a forward pass, whose module calls are named afresh.  An outermost
        call without grad (``grad=False``: ``no_grad``, ``inference_mode``) inside a
        step is an evaluation pass: no micro-batch, nothing recorded until it ends,
        counted by ``sink.eval_pass()``, which may make it a micro-batch after all
        (a step of evaluation passes alone records them: recording inference)."""
        try:
            if _graph_task() != -1:             # a checkpoint recomputing the root: no pass
                return
            if enter:
                self._depth += 1
                if self._depth == 1:
                    ctx = None if grad else reentrant_forward()
                    if ctx is not None and any(ctx.needs_input_grad):
                        grad = True                 # a reentrant checkpoint's forward trains
                    if not grad and self._sink.current_token() is not None:
                        self._evaluating = self._sink.eval_pass()   # False: a micro-batch
                        if not self._evaluating:
                            self._names.new_pass()
                    else:
                        self._evaluating = False
                        self._names.new_pass()
                        self._sink.begin_pass()
            else:
                self._depth = max(self._depth - 1, 0)
                if self._depth == 0:
                    self._evaluating = False
        except _POLICY:
            raise
        except Exception as e:
            self._sink.fault(e, "forward pass", self._names.root)

    def on_forward(self, x: torch.Tensor, module: str, path: str, what: What, first: bool,
                   site: int = 0) -> int | None:
        """One tensor of a module call; the serial its gradient will carry (None: no
        gradient is expected).  ``site``: the capture op's in compiled code (0: eager)."""
        try:
            if _graph_task() != -1:             # inside backward: a checkpoint recomputes
                if what.phase is _PRE:
                    return None
                return self._recompute.recomputed(module, path, what.grad, first, site)
            return self._forward(x, module, path, what, first, site)
        except _POLICY:
            raise
        except Exception as e:
            self._sink.fault(e, what.label, join(self._names.label(module), path))
            return None

    def on_keep(self, module: str, mod: nn.Module, args, kwargs, output=None,
                enter: bool = True) -> None:
        """A recorded module's call begins or ends (``on_nonfinite="replay"``): the
        keeper holds its inputs and outputs until the step ends."""
        try:
            if self._sink.current_token() is None or self._evaluating \
                    or _graph_task() != -1:     # not recorded, or a checkpoint recomputing it
                return
            if enter:
                name = self._names.call(Phase.KEEP, module)
                self._keeper.enter(module, name, self._sink.micro, mod, args, kwargs)
            else:
                self._keeper.leave(module, output)
        except Exception as e:
            self._sink.fault(e, "replay inputs", self._names.label(module))

    def on_fault(self, error: BaseException, module: str) -> None:
        """An eager hook of ``module`` raised outside the methods above."""
        self._sink.fault(error, "capture", self._names.label(module))

    def on_gradient(self, serial: int, g: torch.Tensor) -> None:
        """The gradient of the output whose capture had ``serial`` (-1: none was
        recorded, so neither is this).  A serial of a step older than the last is
        a late gradient, dropped and counted like any."""
        token, name, micro, _ = self._lookup(serial)
        try:
            if self._keeper is not None and token is self._sink.current_token():
                self._keeper.grad(serial, g)
            self._sink.add(_K_GRADIENTS, name, g, token, micro)
        except _POLICY:
            raise
        except Exception as e:
            self._sink.fault(e, _K_GRADIENTS, name)

    def leaf_hook(self, t: torch.Tensor, serial) -> None:
        """The gradient hook of a leaf output whose capture had ``serial``: only for a
        recorded call; it acts once, and goes when the step ends."""
        serial = int(serial)
        if serial > 0:                          # else not recorded (outside a step, paused, eval)
            self._gradients.hold_leaf(t, serial, self.id)

    def _forward(self, x: torch.Tensor, module: str, path: str, what: What, first: bool,
                 site: int) -> int | None:
        if self._evaluating:                    # an evaluation pass: nothing is recorded
            return None
        token = self._sink.current_token()
        micro = self._sink.micro
        name = self._names.name(what.phase, module, path, first)
        if first and what.phase is _POST and not site and not torch.is_grad_enabled():
            base = self._names.current(_POST, module)
            self._recompute.forward_call(module, base, token, micro)
        if what is _WEIGHTS:             # a module's weights: once a step, not per micro-batch
            name = f"{self._names.label(module)}:{path}"
            if token is not None and name not in self._weighed:    # recorded, not paused
                self._weighed.add(name)
                self._sink.add(_K_WEIGHTS, name, x, token, micro)
            return None
        if what.kind is not None:
            self._sink.add(what.kind, name, x, token, micro)
        if not what.grad or token is None:
            return None
        # without grad, no gradient: unless the call is a reentrant checkpoint's forward
        no_grad = not site and not torch.is_grad_enabled()
        if no_grad and not self._recompute.in_forward(module):
            return None
        serial = self._gradients.expect(token, name, micro, site)
        if no_grad:
            self._recompute.bind(path, serial)
        if self._keeper is not None:            # on_nonfinite="replay": its gradient is kept
            self._keeper.bind(module, path, serial)
        return serial


class _Hook:
    """A hook: the HookSet's id and the module's name.  A deep
    copy (of a hooked model) is a no-op hook.

    In eager mode the whole hook runs under the guard (whatever its walk of the
    output raises is a dropped capture); while compiling, Dynamo traces ``run``
    alone, and the guard is in ``HookSet``'s methods, which run eagerly."""

    def __init__(self, hookset: int, module: str):
        self.hookset, self.module = hookset, module

    def __deepcopy__(self, memo):
        return _noop

    @_ops.eager_root
    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.run(*args)
        try:
            return self.run(*args, eager=True)
        except _POLICY:
            raise
        except Exception as e:
            _ops.fault(self.hookset, e, self.module)
            return None

    def run(self, *args, eager: bool = False):
        """The hook's body; ``eager``: not being traced (asked once, in ``__call__``)."""
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
        super().__init__(hookset, "")
        self.enter, self.no_grad = enter, no_grad

    def run(self, module, args, *rest, eager: bool = False):
        target = self.hookset if torch.is_grad_enabled() else self.no_grad
        _ops.forward_pass(target, self.enter, eager)
        return None


class _PreHook(_Hook):
    def __init__(self, hookset: int, module: str, inputs: bool, weights: bool,
                 integers: bool = False):
        super().__init__(hookset, module)
        self.inputs, self.weights = inputs, weights
        self.integers = integers                # capture="batch": integer and bool inputs only

    def run(self, module, args, kwargs, eager: bool = False):
        first = True
        if self.inputs:
            for path, t in input_leaves(args, kwargs):
                if self.integers and (t.is_floating_point() or t.is_complex()):
                    continue
                _ops.capture(t, self.hookset, self.module, path, _INPUTS, first, eager)
                first = False
        if self.weights:
            for pname, p in module.named_parameters(recurse=False):
                _ops.capture(p, self.hookset, self.module, pname, _WEIGHTS, first, eager)
                first = False
        return None


class _PostHook(_Hook):
    def __init__(self, hookset: int, module: str, activations: bool, gradients: bool):
        super().__init__(hookset, module)
        self.activations, self.gradients = activations, gradients
        # what an output is: with its gradient wanted, or without
        self.with_grad = What.ACTIVATIONS_GRADIENTS if activations else What.GRADIENTS

    def run(self, module, args, output, eager: bool = False):
        acts, grads = self.activations, self.gradients
        # eager, without grad: maybe a reentrant checkpoint's forward, whose outputs
        # get their gradients through its recomputation (_recompute)
        later = grads and eager and not torch.is_grad_enabled()
        first = True
        for path, t in leaves(output):
            wants_grad = grads and t.requires_grad
            if not (acts or wants_grad or later):
                continue
            if wants_grad and not t.is_leaf and not eager:
                if _ops.EAGER_GRAD_HOOKS:
                    _outside(self, t, path, first)
                else:
                    self._traced(t, path, first)
                first = False
                continue
            what = self.with_grad if wants_grad or later else _ACTIVATIONS
            serial = _ops.capture(t, self.hookset, self.module, path, what, first, eager)
            first = False
            if wants_grad:
                if t.is_leaf:                   # a leaf (a parameter, a buffer): it outlives
                    if torch.is_grad_enabled():     # the pass: see leaf_hook (a call without
                        _leaf_hook(t, serial, self.hookset)     # grad has no gradient)
                elif serial >= 0:               # a gradient to record (eager: never traced)
                    _hold(t, functools.partial(_ops.gradient, serial, self.hookset))
        return None

    def _traced(self, t: torch.Tensor, path: str, first: bool) -> None:
        """An output whose gradient is wanted, as Dynamo traces it: its serial from
        an op that does not read it, then its gradient hook, then its activation.
        A hook whose arguments depend on the tensor it hooks makes a cycle in the
        graph of a Dynamo that rewrites intermediate hooks as autograd functions
        (torch 2.11: the compiled frame fails)."""
        nothing = torch.empty(0)        # made in the graph: Dynamo may move it (no input)
        serial = _ops.capture(nothing, self.hookset, self.module, path, What.GRADIENTS, first)
        t.register_hook(functools.partial(_grad_hook, serial=serial, hookset=self.hookset))
        if self.activations:        # after the serial: it names the call when ``first``
            _ops.capture_after(t, serial, self.hookset, self.module, path, _ACTIVATIONS, False)


class _KeepHook(_Hook):
    """``on_nonfinite="replay"``: hands a call's inputs (``enter``) or outputs to the
    keeper; it runs eagerly, even in a compiled model (a graph break per call)."""

    def __init__(self, hookset: int, module: str, enter: bool):
        super().__init__(hookset, module)
        self.enter = enter

    @torch.compiler.disable
    def __call__(self, *args):
        return super().__call__(*args)

    def run(self, module, args, last, eager: bool = False):
        hs = _ops.hookset(self.hookset)
        if hs is not None:
            if self.enter:
                hs.on_keep(self.module, module, args, last)
            else:
                hs.on_keep(self.module, module, None, None, last, enter=False)
        return None


@torch.compiler.disable
def _outside(hook: _PostHook, t: torch.Tensor, path: str, first: bool) -> None:
    """An output whose gradient is wanted, captured and hooked outside the graph
    (a graph break), where this torch's Dynamo would rewrite the hook
    (``_ops.EAGER_GRAD_HOOKS``)."""
    serial = _ops.capture(t, hook.hookset, hook.module, path, hook.with_grad, first)
    t.register_hook(functools.partial(_grad_hook, serial=serial, hookset=hook.hookset))


@_ops.eager_root
def _grad_hook(grad, serial, hookset):
    _ops.capture_grad(grad, serial, hookset)


def _hold(t: torch.Tensor, hook) -> None:
    """``t.register_hook(hook)`` in eager mode, without the ``RemovableHandle`` that
    nobody removes (the hook goes with ``t``'s graph): the same dict on ``t``'s
    ``grad_fn`` that ``Tensor.register_hook`` fills, keyed by the hook itself (never
    one of torch's handle ids), at a third of its cost.  A subclass (``__torch_function__``)
    goes through ``register_hook``, and so does any tensor under a ``TorchFunctionMode``."""
    if type(t) is not torch.Tensor or torch._C._is_torch_function_mode_enabled():
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = collections.OrderedDict()
        t.grad_fn._register_hook_dict(t)
    hooks[hook] = hook


@torch.compiler.disable
def _leaf_hook(t, serial, hookset: int) -> None:
    hs = _ops.hookset(hookset)
    if hs is not None:
        hs.leaf_hook(t, serial)
