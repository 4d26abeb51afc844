"""Replay: the aten op, and the line of code, that made a step's first NaN/Inf.

Under ``on_nonfinite="replay"`` the hooks keep, for every call of a recorded
module in the step, references to its inputs (args and kwargs) and outputs,
with the RNG and autocast state and the grad mode at the call (``Keeper``):
no copy, and no check while the step runs, so no device sync.  The bytes
kept are bounded by ``max_replay_bytes`` (past it calls are no longer kept,
and that is counted).

When the step ends with a non-finite capture (its summaries, read at the
step's end: the one wait of this mode), ``find`` looks for the *producer*:
the first call, in completion order (so the deepest module first), whose
outputs hold NaN/Inf while its inputs are finite; modules that only passed a
NaN on are not producers.  ``replay`` runs that call again (``module.forward``
on copies of the inputs, the recorder paused) under a ``TorchDispatchMode``
that checks every aten op: the first op whose floating inputs are finite and
whose output is not is named, with the Python line that called it and its
inputs' statistics.  The module's buffers (BatchNorm's running statistics),
the RNG states and the grad mode are restored, so training is untouched.

An input changed in place after the call (its version moved) is not replayed:
the replay would not be faithful, and the event says so.  Backward replay is
not built: a NaN first made in backward is found (the event), not named.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Keeper", "find", "replay"]

REPLAY_CAP = "replay inputs past max_replay_bytes"
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _all_finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if _floating(t) and t.numel())


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


class Keeper:
    """A step's module calls, kept by reference (see the module)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.calls: list[Call] = []
        self._open: dict[int, list[Call]] = {}
        self.nbytes = 0
        self.dropped = 0
        self._seen: set[int] = set()

    def enter(self, name: str, micro: int, module, args, kwargs) -> None:
        """A recorded module's call begins (its pre-hook)."""
        ts = _tensors((args, kwargs))
        new = [t for t in ts if t.untyped_storage().data_ptr() not in self._seen]
        n = sum(t.untyped_storage().nbytes() for t in new)
        if self.nbytes + n > self.max_bytes:
            self.dropped += 1
            return
        self.nbytes += n
        self._seen.update(t.untyped_storage().data_ptr() for t in new)
        devices = {t.device for t in ts if t.device.type == "cuda"}
        call = Call(name, micro, module, args, kwargs, [t._version for t in ts], None,
                    torch.get_rng_state(),
                    {d: torch.cuda.get_rng_state(d) for d in devices},
                    {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                     for d in ("cpu", "cuda")},
                    torch.is_grad_enabled())
        self._open.setdefault(id(module), []).append(call)

    def leave(self, module, output) -> None:
        """The call ends (its post-hook): it is complete, in completion order."""
        stack = self._open.get(id(module))
        if stack:
            call = stack.pop()
            call.outputs = _tensors(output)
            self.calls.append(call)

    def take(self) -> list[Call]:
        calls, self.calls, self._open = self.calls, [], {}
        self.nbytes, self._seen = 0, set()
        return calls


def find(calls: list[Call]) -> Call | None:
    """The producer: the first call (completion order) whose outputs hold NaN/Inf
    and whose inputs are finite."""
    for call in calls:
        if call.outputs and not _all_finite(call.outputs) and _all_finite(
                _tensors((call.args, call.kwargs))):
            return call
    return None


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


def _user_line() -> tuple[str, str]:
    """The innermost frame of the user's code on the stack: ``file:line`` and its code."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if not (f.startswith(_TORCH) or f.startswith(_HERE) or "/contextlib.py" in f):
            return f"{frame.filename}:{frame.lineno}", (frame.line or "").strip()
    return "?", ""


class _Check(TorchDispatchMode):
    """Stops at the first aten op whose floating inputs are finite and whose
    floating output is not."""

    def __init__(self):
        super().__init__()
        self.found: dict | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            outs = [t for t in _tensors(out) if _floating(t)]
            if outs and not _all_finite(outs):
                ins = _tensors((args, kwargs))
                if _all_finite(ins):
                    where, code = _user_line()
                    self.found = {"op": func.name(), "source": where, "code": code,
                                  "inputs": [_statistics(t) for t in ins]}
                    raise _Found
        return out


def replay(call: Call, paused) -> dict:
    """Run ``call`` again and name the op that made its NaN/Inf (see the module);
    ``paused`` silences the recorder's hooks meanwhile.  The answer as JSON."""
    where = {"module": call.name, "module_class": type(call.module).__qualname__,
             "micro": call.micro, "torch_version": torch.__version__}
    if [t._version for t in _tensors((call.args, call.kwargs))] != call.versions:
        return {**where, "op": None, "note": "its inputs were changed in place after the call; "
                                             "not replayed"}
    module = call.module
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = {d: torch.cuda.get_rng_state(d) for d in call.cuda_rng}
    args, kwargs = tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x,
                            (call.args, call.kwargs))
    check = _Check()
    try:
        torch.set_rng_state(call.rng)
        for d, state in call.cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
        with contextlib.ExitStack() as stack:
            stack.enter_context(paused())
            for device, (enabled, dtype) in call.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(torch.set_grad_enabled(call.grad))
            stack.enter_context(check)
            module.forward(*args, **kwargs)
    except _Found:
        pass
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)
        for d, state in cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
    if check.found is None:
        return {**where, "op": None, "note": "the replay made no NaN/Inf (the call depends on "
                                             "state the replay does not restore)"}
    return {**where, **check.found}
