"""tensortape's two custom ops: how a hook hands a tensor over, compiled or not.

``tensortape::capture`` receives a forward tensor (an output, an input or a
weight) and ``tensortape::capture_grad`` the gradient of an output.  They are
``torch.library`` custom ops marked as having side effects, so Dynamo and
AOTAutograd keep them in the graph (no graph break, ``fullgraph=True`` works)
and never eliminate them; at run time each calls back into the ``HookSet`` it
names, which runs eagerly: a compiled model is recorded by the same code and
the same statistics engine as an eager one.

``forward_pass`` marks the start and end of a call of the recorded model's
root module: a new forward pass, a micro-batch of the step.

``capture`` returns the capture's serial (a CPU int64 scalar from the op).
The gradient hook carries it to ``capture_grad``, so a gradient is named (and
assigned to its step and micro-batch) by the forward call that produced it,
also in compiled code.  Each capture that Dynamo traces also gets a number of
its own, its *site*, fixed in the compiled code (``_site``): a compiled
backward graph that recomputes a checkpointed region runs the same capture op,
with the same site, again, and the site tells which forward capture it
repeats (see ``_recompute``).  Eager captures have site 0.

What a capture holds is a ``What``; a custom op's arguments can only be
plain values, so it crosses the op as its int ``value`` (``capture`` and
``_capture``, the one boundary).  A capture's serial is None where no
gradient is expected, and -1 on the wire.

The custom ops are used only while compiling: in eager mode a hook calls the
Python body directly (an op's dispatch costs about ten times its body).

Runs on the training thread (the forward hooks, the ops) and on autograd's
threads (``capture_grad``); the table of hook sets is guarded by ``_lock``.
"""

from __future__ import annotations

import enum
import itertools
import threading
import weakref

import torch

from ._callnames import Phase
from ..format import Kind

__all__ = ["What", "capture", "capture_after", "capture_grad", "fault", "forward_pass", "gradient", "hookset",
           "register", "unregister"]


class What(enum.Enum):
    """What a hook hands over for one tensor of a module call: ``kind``, the kind
    it is recorded as now (None: nothing now, only its gradient later), ``grad``
    whether its gradient is wanted, and ``phase``, which hook sees it."""

    INPUTS = 1
    WEIGHTS = 2
    ACTIVATIONS = 3
    GRADIENTS = 4                   # an output whose gradient alone is recorded
    ACTIVATIONS_GRADIENTS = 5       # an output recorded now, and its gradient later

    def __init__(self, code: int):
        self.kind = (None, Kind.INPUTS, Kind.WEIGHTS, Kind.ACTIVATIONS, None,
                     Kind.ACTIVATIONS)[code]
        self.grad = code >= 4
        self.phase = Phase.PRE if code <= 2 else Phase.POST

    @property
    def label(self) -> Kind:
        """The kind that a fault of this capture is counted under."""
        return self.kind or Kind.GRADIENTS


# whether this torch's Dynamo rewrites a hook on an intermediate tensor as an autograd
# function (torch 2.11), which breaks compiled code where the model then changes that
# tensor in place: its outputs' gradient hooks are then registered outside the graph, a
# graph break each (set at attach, by ``_compile``)
EAGER_GRAD_HOOKS = False

# the code of the functions that run eagerly whenever Dynamo would make one of them the
# root of a frame (``eager_root``); ``_compile`` tells Dynamo at attach
EAGER_ROOTS: list = []


def eager_root(fn):
    """Mark ``fn`` to run eagerly where Dynamo would compile it as a frame of its own:
    called from code Dynamo runs eagerly (after a graph break in a hook's caller), it
    would guard on its arguments (a module's name, a hook), recompile for every
    module and give up at the recompile limit.  Traced from a compiled caller, it is
    still inlined (Dynamo skips the frame, never the calls it traces)."""
    EAGER_ROOTS.append(fn.__code__)
    return fn

_hooksets: dict[int, weakref.ref] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register(hookset) -> int:
    with _lock:
        i = next(_ids)
        _hooksets[i] = weakref.ref(hookset)
    return i


def unregister(i: int) -> None:
    """Forget ``i``: one dict ``pop``, atomic, and no lock (a finaliser calls this,
    maybe while this thread is inside ``register``)."""
    _hooksets.pop(i, None)


def hookset(i: int):
    """The HookSet registered as ``i`` (None once it is gone)."""
    return _hookset(i)


def _hookset(i: int):
    ref = _hooksets.get(i)
    return ref() if ref is not None else None


def _on_forward(x: torch.Tensor, hookset: int, module: str, path: str, what: What,
                first: bool, site: int = 0) -> int:
    hs = _hookset(hookset)
    serial = hs.on_forward(x, module, path, what, first, site) if hs is not None else None
    return -1 if serial is None else serial


def _capture(x: torch.Tensor, hookset: int, module: str, path: str, what: int,
             first: bool, site: int) -> torch.Tensor:
    return torch.full((), _on_forward(x, hookset, module, path, What(what), first, site),
                      dtype=torch.int64)


def _capture_after(x: torch.Tensor, after: torch.Tensor, hookset: int, module: str, path: str,
                   what: int, first: bool, site: int) -> torch.Tensor:
    return _capture(x, hookset, module, path, what, first, site)


_sites = itertools.count(1)


@torch.compiler.assume_constant_result
def _site() -> int:
    """A new number, each time Dynamo traces a capture: Dynamo runs this while
    tracing and puts its result in the graph as a constant."""
    return next(_sites)


def fault(hookset: int, error: BaseException, module: str) -> None:
    """An eager hook raised: the HookSet's guard counts it."""
    hs = _hookset(hookset)
    if hs is not None:
        hs.on_fault(error, module)


def _capture_grad(g: torch.Tensor, serial: torch.Tensor, hookset: int) -> None:
    hs = _hookset(hookset)
    if hs is not None:
        hs.on_gradient(int(serial), g)


def _forward_pass(hookset: int, enter: bool) -> torch.Tensor:
    hs = _hookset(hookset)
    if hs is not None:
        hs.on_pass(enter)
    return torch.zeros((), dtype=torch.int64)


if hasattr(torch.library, "custom_op"):           # torch >= 2.4
    import inspect
    from torch.fx.node import has_side_effect

    # CUDA graphs (mode="reduce-overhead") never hold these ops: the recorder keeps
    # the tensors they see past the graph's replay, which a graph's memory pool
    # refuses ("tensors in the cudagraph pool not tracked as outputs"); tagged,
    # inductor runs them between the graph's partitions, or skips CUDA graphs.
    _unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    _tags = ({"tags": (_unsafe,)} if _unsafe is not None
             and "tags" in inspect.signature(torch.library.custom_op).parameters else {})

    def _custom_op(name, fn):
        return torch.library.custom_op(f"tensortape::{name}", mutates_args=(), **_tags)(fn)

    _capture_op = _custom_op("capture", _capture)
    _capture_grad_op = _custom_op("capture_grad", _capture_grad)

    @_capture_op.register_fake
    def _(x, hookset, module, path, what, first, site):
        return torch.empty((), dtype=torch.int64)

    @_capture_grad_op.register_fake
    def _(g, serial, hookset):
        return None

    _capture_after_op = _custom_op("capture_after", _capture_after)

    @_capture_after_op.register_fake
    def _(x, after, hookset, module, path, what, first, site):
        return torch.empty((), dtype=torch.int64)

    _forward_pass_op = _custom_op("forward_pass", _forward_pass)

    @_forward_pass_op.register_fake
    def _(hookset, enter):
        return torch.empty((), dtype=torch.int64)

    ops = torch.ops.tensortape
    for op in (ops.capture, ops.capture_grad, ops.forward_pass, ops.capture_after):
        has_side_effect(op.default)
    _ops = (ops.capture, ops.capture_grad, ops.forward_pass, ops.capture_after)
else:                                              # older torch: eager only (a graph break)
    _ops = tuple(torch.compiler.disable(f)
                 for f in (_capture, _capture_grad, _forward_pass, _capture_after))


@eager_root
def capture(x, hookset: int, module: str, path: str, what: What, first: bool,
            eager: bool = False):
    """Hand one tensor of a module call over; its serial (an int, or an int64 scalar
    while compiling; -1: no gradient is expected).  ``eager``: the hook already knows
    that nothing is being traced (it asked once)."""
    if not eager and torch.compiler.is_compiling():
        return _ops[0](x, hookset, module, path, what.value, first, _site())
    return _on_forward(x, hookset, module, path, what, first)


@eager_root
def capture_after(x, after, hookset: int, module: str, path: str, what: What, first: bool):
    """``capture``, while compiling, run after ``after`` (a tensor it depends on,
    so no compiler puts it first)."""
    return _ops[3](x, after, hookset, module, path, what.value, first, _site())


@eager_root
def capture_grad(g, serial, hookset) -> None:
    if torch.compiler.is_compiling():
        _ops[1](g, serial, hookset)
    else:
        _capture_grad(g, serial, hookset)


@eager_root
def gradient(serial: int, hookset: int, g) -> None:
    """The gradient hook of an output captured in eager mode, as a ``functools.partial``
    of its (int) serial and HookSet: ``capture_grad`` in one call (a backward that
    Dynamo's compiled autograd traces still gets the op)."""
    if torch.compiler.is_compiling():
        _ops[1](g, torch.tensor(serial), hookset)
        return
    hs = _hookset(hookset)
    if hs is not None:
        hs.on_gradient(serial, g)


@eager_root
def forward_pass(hookset, enter, eager: bool = False) -> None:
    if not eager and torch.compiler.is_compiling():
        _ops[2](hookset, enter)
    else:
        _forward_pass(hookset, enter)
