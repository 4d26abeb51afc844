"""The keeper: a step's module calls, held by reference until the step ends.

Under ``on_nonfinite="replay"`` the hooks hand the ``Keeper`` every call of a
recorded module in the step: references to its inputs (args and kwargs) and
outputs, with the RNG and autocast state, the grad mode and the user's line
that called the module (``_sources.caller``), and, when backward hands them to
the recorder, its outputs' gradients.  No copy, and no check while the step
runs, so no device sync.  The bytes kept, inputs, outputs and output
gradients alike, are bounded by ``max_replay_bytes``: past it calls are no
longer kept, and that is counted (``take_dropped``).

The step buffer owns the keeper (``StepBuffer.keeper``); the replay
(``_replayer.Replayer``) takes the step's calls when it ends.  Training thread;
``grad`` on autograd's threads too (one call at a time: the hooks' own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from . import _sources

__all__ = ["REPLAY_CAP", "Call", "Keeper", "all_finite", "floating", "tensors"]

REPLAY_CAP = "replay inputs past max_replay_bytes"   # (inputs, outputs and output gradients)


def tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own reductions would be collectives), else ``t``."""
    return getattr(t, "_local_tensor", t) if type(t).__name__ == "DTensor" else t


def all_finite(ts) -> bool:
    return all(bool(torch.isfinite(_local(t)).all()) for t in ts if floating(t) and t.numel())


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
    path: str | None = None             # the module's path in the model ("": the root)


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
        ts = tensors((args, kwargs))
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
                    torch.is_grad_enabled(), order=self._tick(), caller=_sources.caller(),
                    path=module_name)
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
            outputs = tensors(output)
            if not self._fits(outputs):
                return
            call.outputs = outputs
            call.end = self._tick()
            self.calls.append(call)

    def take(self) -> list[Call]:
        """The step's kept calls, in completion order; the keeper starts afresh."""
        calls, self.calls, self._open, self._serials = self.calls, [], {}, {}
        self.nbytes, self._seen, self._clock = 0, {}, 0
        return calls

    def take_dropped(self) -> int:
        """The calls not kept for the cap since the last time asked."""
        dropped, self.dropped = self.dropped, 0
        return dropped

    def finish(self) -> None:
        """The run's first NaN/Inf was replayed: keep nothing from now on."""
        self.done = True
