"""Replay: the aten op, and the line of code, that made a step's first NaN/Inf.

Under ``on_nonfinite="replay"`` the hooks keep, for every call of a recorded
module in the step, references to its inputs (args and kwargs) and outputs,
with the RNG and autocast state, the grad mode and the user's line that
called the module (a frame walk to the first frame outside torch, the
libraries and tensortape: a file and a line, no traceback) at the call
(``Keeper``): no copy, and no check while the step runs, so no device sync.
The bytes kept, inputs, outputs and output gradients alike, are bounded by
``max_replay_bytes`` (past it calls are no longer kept, and that is counted).

When the step ends with a non-finite capture (its summaries, read at the
step's end: the one wait of this mode), ``find`` looks for the *producer*:
the first call, in completion order (so the deepest module first), whose
outputs held NaN/Inf (by the capture's own counts: an output cleaned in place
after the call still counts) while its inputs are finite; modules that only passed a
NaN on are not producers.  ``replay`` runs that call again (``module.forward``
on copies of the inputs, the recorder paused) under a ``TorchDispatchMode``
that checks every aten op: the first op whose floating inputs are finite and
whose output is not is named, with the Python line that called it and its
inputs' statistics.  The line is the innermost of the user's code inside the
replay; for a library's module (torch's ``LayerNorm``) it is the user's line
that called the module, with the op's line in the library as
``library_source``.  The module's buffers (BatchNorm's running statistics),
torch's, Python's and numpy's RNG states and the grad mode are restored, so
training is untouched.

A replay never runs a collective: a producer that is, or holds, an FSDP-sharded
module, a DDP wrapper, DTensor parameters or a forward hook of
``torch.distributed``'s is not replayed (``collective`` says why), and a
dispatch mode refuses any collective op during a replay, before it starts.

When the step's first NaN/Inf is in backward, the output gradients of the
calls (kept by reference when backward hands them to the recorder) find the
backward producer (``find_backward``): a call whose output gradients are
finite and whose backward, replayed from them (its forward again under anomaly
mode, which notes each autograd node's forward line, then ``autograd.grad``),
makes a non-finite gradient, the deepest first.  The check then also names the
autograd node (``SqrtBackward0``) and the forward line that made it, which is
then the ``source``.

An input changed in place after the call (its version moved) is not replayed:
the replay would not be faithful, and the event says so.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import random
import re
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ._callnames import split_call
from ._naming import leaves
from ._quiet import quiet

__all__ = ["Keeper", "bundle", "from_bundle", "investigate", "replay"]

REPLAY_CAP = "replay inputs past max_replay_bytes"   # (inputs, outputs and output gradients)
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_ROOT = os.path.dirname(_HERE)
# tensortape's own code, and what only calls on (never the user's line)
_OURS = (_HERE + os.sep, os.path.join(_ROOT, "analysis") + os.sep, os.path.join(_ROOT, "cli.py"))
# torch's frames that are dispatch machinery, not a line of a library's op
_MACHINERY = tuple(os.path.join(_TORCH, f) for f in (
    "_compile.py", "_dynamo" + os.sep, "utils" + os.sep + "_python_dispatch.py", "_ops.py",
    "overrides.py"))
_KINDS: dict[str, str] = {}


def _kind(filename: str) -> str:
    """A code file as the replay sees it: "user", "library" (torch, transformers,
    anything installed), "machinery" (torch's dispatch) or "ours" (tensortape,
    contextlib)."""
    kind = _KINDS.get(filename)
    if kind is None:
        f = os.path.abspath(filename)
        if (f.startswith(_OURS) or f.endswith(os.sep + "contextlib.py")
                or filename.startswith("<frozen")):
            kind = "ours"
        elif f.startswith(_MACHINERY):
            kind = "machinery"
        elif (f.startswith(_TORCH) or os.sep + "site-packages" + os.sep in f
              or os.sep + "dist-packages" + os.sep in f):
            kind = "library"
        else:
            kind = "user"
        _KINDS[filename] = kind
    return kind


def _caller() -> tuple[str, int] | None:
    """The user's line that is calling a module now: the innermost frame outside
    torch, the libraries and tensortape, as (file, line); cheap (no traceback)."""
    frame = sys._getframe(2)
    while frame is not None:
        if _kind(frame.f_code.co_filename) == "user":
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def _line(where: tuple[str, int] | None) -> tuple[str, str]:
    if not where:
        return "?", ""
    return f"{where[0]}:{where[1]}", linecache.getline(where[0], where[1]).strip()


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own reductions would be collectives), else ``t``."""
    return getattr(t, "_local_tensor", t) if type(t).__name__ == "DTensor" else t


def _all_finite(ts) -> bool:
    return all(bool(torch.isfinite(_local(t)).all()) for t in ts if _floating(t) and t.numel())


@dataclass
class Call:
    """One call of a recorded module, as kept for a replay."""
    name: str
    micro: int
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    versions: list[int]
    outputs: list | None
    rng: torch.Tensor
    cuda_rng: dict
    autocast: dict
    grad: bool
    order: int = 0                      # when the call began and ended, in the step
    end: int = 0
    grads: dict | None = None           # output path -> its gradient, as backward gave it
    caller: tuple | None = None         # the user's line that called the module: (file, line)


class Keeper:
    """A step's module calls, kept by reference (see the module)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.calls: list[Call] = []
        self._open: dict[str, list[Call]] = {}
        self._serials: dict[int, tuple[Call, str]] = {}
        self._clock = 0
        self.nbytes = 0
        self.dropped = 0
        self.done = False                 # the run's first NaN/Inf was replayed: keep nothing
        self._seen: dict[int, int] = {}   # storages kept (data pointer -> bytes)

    def _fits(self, ts) -> bool:
        """Count the storages of ``ts`` not yet kept, if they fit under the cap (all
        that is kept is counted: inputs, outputs, output gradients)."""
        new = {}
        for t in ts:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._seen:
                new[ptr] = t.untyped_storage().nbytes()
        n = sum(new.values())
        if self.nbytes + n > self.max_bytes:
            self.dropped += 1
            return False
        self.nbytes += n
        self._seen.update(new)
        return True

    def enter(self, module_name: str, name: str, micro: int, module, args, kwargs) -> None:
        """A recorded module's call begins (its pre-hook)."""
        if self.done:
            return
        ts = _tensors((args, kwargs))
        stack = self._open.setdefault(module_name, [])
        if not self._fits(ts):
            stack.append(None)          # its leave pops this, not an outer call's
            return
        devices = {t.device for t in ts if t.device.type == "cuda"}
        call = Call(name, micro, module, args, kwargs, [t._version for t in ts], None,
                    torch.get_rng_state(),
                    {d: torch.cuda.get_rng_state(d) for d in devices},
                    {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                     for d in ("cpu", "cuda")},
                    torch.is_grad_enabled(), order=self._tick(), caller=_caller())
        stack.append(call)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def bind(self, module_name: str, path: str, serial: int) -> None:
        """An output of the open call of ``module_name`` whose gradient will carry
        ``serial`` (the recorder's gradient hook)."""
        stack = self._open.get(module_name)
        if stack and stack[-1] is not None:
            self._serials[serial] = (stack[-1], path)

    def grad(self, serial: int, g: torch.Tensor) -> None:
        """The gradient of a kept call's output, kept by reference."""
        found = self._serials.get(serial)
        if found is not None and self._fits([g]):
            call, path = found
            call.grads = {**(call.grads or {}), path: g}

    def leave(self, module_name: str, output) -> None:
        """The call ends (its post-hook): it is complete, in completion order."""
        stack = self._open.get(module_name)
        if stack:
            call = stack.pop()
            if call is None:
                return
            outputs = _tensors(output)
            if not self._fits(outputs):
                return
            call.outputs = outputs
            call.end = self._tick()
            self.calls.append(call)

    def take(self) -> list[Call]:
        calls, self.calls, self._open, self._serials = self.calls, [], {}, {}
        self.nbytes, self._seen, self._clock = 0, {}, 0
        return calls


def _made(events) -> set | None:
    """The forward captures that held NaN/Inf, as the capture counted them
    ((micro, layer) pairs), or None where the step's outputs were not captured
    (no activations counted: the live outputs are judged instead)."""
    acts = [e for e in events if e.kind == "activations" and e.phase == "forward"]
    return {(e.micro, e.layer) for e in acts} if acts else None


def _outputs_nonfinite(call: Call, made: set | None) -> bool:
    """The call's outputs held NaN/Inf when it returned: by the capture's own counts
    (an output cleaned in place afterwards, ``y.nan_to_num_()``, still counts),
    else (outputs not captured) by the kept outputs."""
    if made is None:
        return bool(call.outputs) and not _all_finite(call.outputs)
    return any(m == call.micro and (layer == call.name or layer.startswith(call.name + ":"))
               for m, layer in made)


def find(calls: list[Call], events=()) -> Call | None:
    """The producer: the first call (completion order) whose outputs held NaN/Inf
    (``events``: the step's, the capture's counts) and whose inputs are finite."""
    made = _made(events)
    for call in calls:
        if call.outputs is not None and _outputs_nonfinite(call, made) and _all_finite(
                _tensors((call.args, call.kwargs))):
            return call
    return None


def find_backward(calls: list[Call], paused) -> tuple[Call, dict] | None:
    """The backward producer: a call whose output gradients are finite and whose
    replayed backward makes a non-finite gradient, the deepest first (calls with
    the shortest span, then the latest); with what its replay found."""
    tried = sorted((c for c in calls if c.grads and _all_finite(c.grads.values())),
                   key=lambda c: (c.end - c.order, -c.end))
    refused = None
    for call in tried:
        found = replay(call, paused, backward=True)
        if found.get("op"):
            return call, found
        if found.get("collective") and refused is None:
            refused = found             # said, where nothing else names the op
    return (None, refused) if refused is not None else None


def investigate(calls: list[Call], events: list, paused) -> tuple[int, dict, Call | None]:
    """A step's calls and its (ordered) non-finite events -> which event carries
    the answer, the answer, and the producer call when an op was named (else
    None).  Forward when the step's first event is, else backward."""
    first = events[0]
    if first.phase == "forward":
        call = find(calls, events)
        found = None if call is None else replay(call, paused)
    else:
        call, found = find_backward(calls, paused) or (None, None)
    if found is None:                   # say so: the user knows where to look next
        found = {"op": None, "phase": first.phase, "note": (
            "no recorded module made it from finite inputs"
            + ("" if first.phase == "forward" else " and output gradients")
            + ": it was made between recorded modules, or outside the model; record more of "
              "them (layers='*')")}
    if call is None or not found.get("op"):
        return 0, found, None
    mine = [i for i, e in enumerate(events) if e.phase == "forward" and e.micro == call.micro
            and (e.layer == call.name or e.layer.startswith(call.name + "."))]
    return (mine[0] if mine and first.phase == "forward" else 0), found, call


class _Found(Exception):
    pass


def _statistics(t: torch.Tensor) -> dict:
    out = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if _floating(t) and t.numel():
        v = t.detach().to(torch.complex128 if t.is_complex() else torch.float64)
        if t.is_complex():
            v = v.abs()
        finite = v[torch.isfinite(v)]
        out.update(nan=int(torch.isnan(v).sum()), posinf=int((v == float("inf")).sum()),
                   neginf=int((v == -float("inf")).sum()))
        if finite.numel():
            out.update(min=float(finite.min()), max=float(finite.max()),
                       abs_max=float(finite.abs().max()))
    return out


def _lines(frames=None) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """The innermost frame of the user's code and of a library's (torch's op line),
    each (file, line) or None, on the stack (or in ``frames``, a traceback), inside
    the replay only: what called the replay (tensortape, the training loop's
    ``with rec.step``, ``run.replay``) is not the call's."""
    if frames is None:
        frames, frame = [], sys._getframe(1)
        while frame is not None and frame.f_code is not replay.__code__:
            frames.append((frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
    else:           # outermost first: keep what is inside the replay's frame
        start = [i for i, (f, _, name) in enumerate(frames)
                 if name == "replay" and os.path.abspath(f) == os.path.abspath(__file__)]
        frames = [(f, n) for f, n, _ in frames[start[-1] + 1 if start else 0:]][::-1]
    user = library = None
    for f, n in frames:
        kind = _kind(f)
        if kind == "user" and user is None:
            user = (f, n)
        elif kind == "library" and library is None and user is None:
            library = (f, n)
    return user, library


def _node(caller) -> dict:
    """In backward: the autograd node running, and the line of the forward op
    that made it (recorded by anomaly mode during the replay's forward); for a
    library's module, the user's line that called it."""
    node = torch._C._current_autograd_node()
    if node is None:
        return {}
    out = {"node": node.name()}
    trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    if trace:
        text = "".join(trace) if isinstance(trace, list) else str(trace)
        user, library = _lines([(m.group(1), int(m.group(2)), m.group(3))
                                for m in _FRAME.finditer(text)])
        where, code = _line(user or caller)
        out.update(forward_source=where, forward_code=code)
        if library is not None:
            out["forward_library_source"] = _line(library)[0]
    return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


# ops whose output is memory not yet written: any bits, NaN among them
_UNINITIALIZED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                            "aten::new_empty", "aten::new_empty_strided", "aten::resize_",
                            "aten::set_", "aten::empty_permuted"})


class _Check(TorchDispatchMode):
    """Stops at the first aten op whose floating inputs are finite and whose
    floating output is not."""

    def __init__(self, caller=None):
        super().__init__()
        self.found: dict | None = None
        self.caller = caller            # the user's line that called the module

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None and func._schema.name not in _UNINITIALIZED:
            outs = [t for t in _tensors(out) if _floating(t)]
            if outs and not _all_finite(outs):
                ins = _tensors((args, kwargs))
                if _all_finite(ins):
                    user, library = _lines()
                    node = _node(self.caller)
                    if user is None and "forward_source" in node:   # backward: the forward line
                        where, code = node["forward_source"], node["forward_code"]
                    else:                   # a library's module: the user's line that called it
                        where, code = _line(user or self.caller)
                    self.found = {"op": func.name(), "source": where, "code": code,
                                  "inputs": [_statistics(t) for t in ins], **node}
                    if library is not None:     # the op's line in the library
                        self.found["library_source"], self.found["library_code"] = \
                            _line(library)
                    raise _Found
        return out


# --- a replay never runs a collective --------------------------------------------------------
_COLLECTIVE_NS = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def _distributed(fn) -> bool:
    """``fn`` (a hook: function, bound method, partial) is torch.distributed's."""
    for _ in range(4):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None)
        if inner is None:
            break
        fn = inner
    return (getattr(fn, "__module__", None) or "").startswith("torch.distributed")


def collectives(module: torch.nn.Module) -> str | None:
    """Why calling ``module`` would (or may) run a collective on this rank alone, or
    None: it or a descendant is sharded by FSDP (FSDP2's ``fully_shard``, whose
    pre-forward hooks all-gather, or FSDP1), wrapped in DDP, holds DTensor
    parameters or buffers (their ops redistribute), or carries a forward hook of
    ``torch.distributed``'s."""
    if not torch.distributed.is_available():
        return None
    kinds = []
    try:
        from torch.distributed.fsdp import FSDPModule
        kinds.append((FSDPModule, "it is sharded by FSDP (fully_shard): its pre-forward hooks "
                                  "all-gather the parameters"))
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        kinds.append((FullyShardedDataParallel, "it is wrapped in FSDP: its forward all-gathers"))
    except ImportError:
        pass
    kinds.append((torch.nn.parallel.DistributedDataParallel,
                  "it is wrapped in DDP: its forward may broadcast buffers"))
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        DTensor = ()
    glob = torch.nn.modules.module
    for hooks in (glob._global_forward_pre_hooks, glob._global_forward_hooks):
        if any(_distributed(h) for h in hooks.values()):
            return "a global forward hook of torch.distributed's is registered"
    for name, m in module.named_modules():
        who = f"{name!r} in it" if name else "the module"
        for cls, why in kinds:
            if isinstance(m, cls):
                return f"{who}: {why}"
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for h in hooks.values():
                if _distributed(h):
                    hook = f"{getattr(h, '__qualname__', h)!s:.80}"
                    return f"{who}: a forward hook of torch.distributed's ({hook}) may run a collective"
        if DTensor and any(isinstance(t, DTensor) for t in
                           (*m.parameters(recurse=False), *m.buffers(recurse=False))):
            return f"{who}: its DTensor parameters' ops redistribute across the ranks"
    return None


class _Collective(Exception):
    pass


class _NoCollective(TorchDispatchMode):
    """The guard: a collective op (c10d, functional collectives) during a replay is
    refused before it starts, so no rank waits on this one."""

    def __init__(self):
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COLLECTIVE_NS:
            self.op = func.name()
            raise _Collective(self.op)
        return func(*args, **(kwargs or {}))


def _not_replayed_collective(why: str, refused: bool = False) -> dict:
    said = (f"stopped before {why}: a replay never runs a collective" if refused else
            f"its call would run a collective ({why})")
    return {"op": None, "collective": why,
            "note": f"not replayed: {said}; a replay on one rank alone would desynchronise "
                    f"the ranks"}


def replay(call: Call, paused, backward: bool = False) -> dict:
    """Run ``call`` again and name the op that made its NaN/Inf (see the module);
    ``paused`` silences the recorder's hooks meanwhile.  With ``backward``, run its
    forward and then its backward from the kept output gradients, checking the
    backward's ops.  The answer as JSON."""
    where = {"module": call.name, "module_class": type(call.module).__qualname__,
             "micro": call.micro, "phase": "backward" if backward else "forward",
             "torch_version": torch.__version__}
    if [t._version for t in _tensors((call.args, call.kwargs))] != call.versions:
        return {**where, "op": None, "note": "its inputs were changed in place after the call; "
                                             "not replayed"}
    module = call.module
    why = collectives(module)               # before anything touches a sharded parameter
    if why is not None:
        return {**where, **_not_replayed_collective(why)}
    if not _all_finite(p.detach() for p in module.parameters()):
        return {**where, "op": None, "note": "its parameters hold NaN/Inf: they were made so "
                                             "outside the forward (the optimizer step before "
                                             "this one?)"}
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    cuda_rng = {d: torch.cuda.get_rng_state(d) for d in call.cuda_rng}
    args, kwargs = tree_map(lambda x: x.detach().clone().requires_grad_(
        backward and _floating(x) and x.requires_grad) if isinstance(x, torch.Tensor) else x,
        (call.args, call.kwargs))
    check, guard = _Check(call.caller), _NoCollective()
    try:
        torch.set_rng_state(call.rng)
        for d, state in call.cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
        with contextlib.ExitStack() as stack:
            # a replay is tensortape's machinery: what it makes warn (the user's code again,
            # anomaly mode when the check stops the backward) is not news (``_quiet``)
            stack.enter_context(quiet())
            stack.enter_context(paused())
            stack.enter_context(guard)      # the last line of defence (see ``collectives``)
            for device, (enabled, dtype) in call.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(torch.set_grad_enabled(call.grad or backward))
            if not backward:
                stack.enter_context(check)
                module.forward(*args, **kwargs)
            else:           # anomaly mode keeps each node's forward line (no NaN check)
                stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
                out = module.forward(*args, **kwargs)
                pairs = [(t, call.grads[p]) for p, t in leaves(out)
                         if p in call.grads and t.requires_grad]
                wrt = [t for t in _tensors((args, kwargs)) if t.requires_grad] + [
                    p for p in module.parameters() if p.requires_grad]
                if pairs and wrt:
                    with check:
                        torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs],
                                            allow_unused=True)
    except _Found:
        pass
    except _Collective:
        return {**where, **_not_replayed_collective(f"the collective {guard.op}", refused=True)}
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)
        for d, state in cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
        random.setstate(py_rng)             # the user's code may draw from these too
        np.random.set_state(np_rng)
    if check.found is None:
        return {**where, "op": None, "note": "the replay made no NaN/Inf (the call depends on "
                                             "state the replay does not restore)"}
    return {**where, **check.found}


# --- the replay bundle: a call as arrays and JSON (no pickle) -----------------------------
def bundle(call: Call) -> tuple[dict, dict[str, torch.Tensor]]:
    """The call as JSON attributes and host tensors: its inputs' structure (each
    tensor a ``{"tensor": i}`` placeholder), parameters, buffers, output gradients,
    RNG and autocast state, grad mode, module path and class, torch version."""
    arrays: dict[str, torch.Tensor] = {}

    def put(x):
        if isinstance(x, torch.Tensor):
            i = len([k for k in arrays if k.startswith("input_")])
            arrays[f"input_{i}"] = x.detach().to("cpu", copy=True)
            return {"tensor": i, "requires_grad": bool(x.requires_grad)}
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [put(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": {str(k): put(v) for k, v in x.items()}}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        return {"value": None, "dropped": type(x).__qualname__}
    structure = {"args": put(list(call.args)), "kwargs": put(dict(call.kwargs))}
    for name, p in call.module.named_parameters():
        arrays[f"param_{name}"] = p.detach().to("cpu", copy=True)
    for name, b in call.module.named_buffers():
        arrays[f"buffer_{name}"] = b.detach().to("cpu", copy=True)
    for path, g in (call.grads or {}).items():
        arrays[f"grad_{path}"] = g.detach().to("cpu", copy=True)
    arrays["rng_cpu"] = call.rng.clone()
    for d, state in call.cuda_rng.items():
        arrays[f"rng_cuda{torch.device(d).index or 0}"] = state.clone()
    attrs = {"module": call.name, "module_class": type(call.module).__qualname__,
             "micro": call.micro, "grad": call.grad, "structure": structure,
             "autocast": {d: [bool(on), str(dt).removeprefix("torch.")]
                          for d, (on, dt) in call.autocast.items()},
             "grads": sorted((call.grads or {})), "torch_version": torch.__version__,
             "caller": list(call.caller) if call.caller else None}
    return attrs, arrays


def from_bundle(attrs: dict, arrays, model: torch.nn.Module) -> Call:
    """The call of a bundle, in ``model``: its submodule at the bundle's path gets
    the recorded parameters and buffers; the inputs come on that module's device.
    ``arrays(name)`` gives a stored tensor (on the CPU)."""
    module = model.get_submodule(split_call(attrs["module"])[0])
    device = next(iter(module.parameters()), torch.zeros(0)).device
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(arrays(f"param_{name}"))
        for name, b in module.named_buffers():
            b.copy_(arrays(f"buffer_{name}"))

    def get(node):
        if "tensor" in node:
            t = arrays(f"input_{node['tensor']}").to(device)
            return t.requires_grad_(node.get("requires_grad", False) and _floating(t))
        if "list" in node:
            return [get(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(get(v) for v in node["tuple"])
        if "dict" in node:
            return {k: get(v) for k, v in node["dict"].items()}
        return node.get("value")
    args, kwargs = tuple(get(attrs["structure"]["args"])), get(attrs["structure"]["kwargs"])
    grads = {p: arrays(f"grad_{p}").to(device) for p in attrs.get("grads", [])}
    return Call(attrs["module"], attrs.get("micro", 0), module, args, kwargs,
                [t._version for t in _tensors((args, kwargs))], None, arrays("rng_cpu"), {},
                {d: (on, getattr(torch, dt)) for d, (on, dt) in attrs["autocast"].items()},
                attrs.get("grad", True), grads=grads or None,
                caller=tuple(attrs["caller"]) if attrs.get("caller") else None)
