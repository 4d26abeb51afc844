"""Replay: the aten op, and the line of code, that made a step's first NaN/Inf.

Under ``on_nonfinite="replay"`` the keeper (``_keeper``) holds, for every call
of a recorded module in the step, references to its inputs, outputs and
output gradients, with the state to run it again.  ``Replayer`` is the one
entry the Recorder calls: ``on_step_end`` takes the step's calls and, at the
run's first step with a non-finite capture (its summaries, read at the step's
end: the one wait of this mode), investigates it.

``find`` looks for the *producer*: the first call, in completion order (so
the deepest module first), whose outputs held NaN/Inf (by the capture's own
counts: an output cleaned in place after the call still counts) while its
inputs are finite; modules that only passed a NaN on are not producers.
``replay`` runs that call again (``module.forward`` on copies of the inputs,
the recorder paused) under a ``TorchDispatchMode`` that checks every aten op:
the first op whose floating inputs are finite and whose output is not is
named, with the Python line that called it and its inputs' statistics.  The
line is the innermost of the user's code inside the replay; for a library's
module (torch's ``LayerNorm``) it is the user's line that called the module,
with the op's line in the library as ``library_source``.  The module's buffers
(BatchNorm's running statistics), torch's, Python's and numpy's RNG states and
the grad mode are restored, so training is untouched.  A replay never runs a
collective (``_collectives``).

When the step's first NaN/Inf is in backward, the output gradients of the
calls find the backward producer (``find_backward``): a call whose output
gradients are finite and whose backward, replayed from them (its forward again
under anomaly mode, which notes each autograd node's forward line, then
``autograd.grad``), makes a non-finite gradient, the deepest first.  The check
then also names the autograd node (``SqrtBackward0``) and the forward line
that made it, which is then the ``source``.

An input changed in place after the call (its version moved) is not replayed:
the replay would not be faithful, and the event says so.  The producer call
is stored with the step as a bundle (``_bundle``) for an offline replay.

Training thread (``Replayer``); ``replay`` also on the reader's (``replay``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .. import format as fmt
from ._bundle import bundle
from ._collectives import Collective, NoCollective, collectives, not_replayed
from ._keeper import REPLAY_CAP, Call, Keeper, all_finite, floating, tensors
from ..hooks._naming import leaves
from ..quiet import quiet
from ._sources import kind as _kind_of, line as _line

__all__ = ["Replayer", "investigate", "replay"]


class Replayer:
    """The replay's wiring (``on_nonfinite="replay"``): what the Recorder calls when
    a step ends.  ``keeper``: the step buffer's; ``paused``: a context manager
    that silences the recorder's hooks; ``fault(error, kind, name)``: the step
    buffer's guard."""

    def __init__(self, keeper: Keeper, rank: int, paused, fault):
        self._keeper, self._rank, self._paused, self._fault = keeper, rank, paused, fault

    def on_step_end(self, record) -> None:
        """At the run's first step with a NaN/Inf, replay the call that made it and
        attach what it found to that call's event in ``record`` (a ``StepRecord``,
        not yet handed on), with the call's bundle; later steps keep nothing.
        Calls not kept for the cap are counted in the record's drops.  It waits
        for the step's summaries; it never raises into training."""
        calls, dropped = self._keeper.take(), self._keeper.take_dropped()
        if dropped:
            record.drops[REPLAY_CAP] = record.drops.get(REPLAY_CAP, 0) + dropped
        if not calls:
            return
        try:
            events = record.resolve().events
            if not events:
                return
            self._keeper.finish()               # the run's first NaN/Inf: the one replayed
            i, found, call = investigate(calls, events, self._paused)
            if call is not None:                # the bundle, for run.replay(model)
                path = fmt.replay_group(self._rank, record.step)
                attrs, arrays = bundle(call)
                record.bundle = (path, {**attrs, "phase": found["phase"]}, arrays)
                found = {**found, "bundle": path}
            events[i] = dataclasses.replace(events[i], replay=found)
        except Exception as e:                  # the guard: a failed replay is counted
            self._fault(e, "replay", "(the step's producer)")


def _made(events) -> set | None:
    """The forward captures that held NaN/Inf, as the capture counted them
    ((micro, layer) pairs), or None where the step's outputs were not captured
    (no activations counted: the live outputs are judged instead)."""
    acts = [e for e in events if e.kind == fmt.Kind.ACTIVATIONS and e.phase == "forward"]
    return {(e.micro, e.layer) for e in acts} if acts else None


def _outputs_nonfinite(call: Call, made: set | None) -> bool:
    """The call's outputs held NaN/Inf when it returned: by the capture's own counts
    (an output cleaned in place afterwards, ``y.nan_to_num_()``, still counts),
    else (outputs not captured) by the kept outputs."""
    if made is None:
        return bool(call.outputs) and not all_finite(call.outputs)
    return any(m == call.micro and (layer == call.name or layer.startswith(call.name + ":"))
               for m, layer in made)


def find(calls: list[Call], events=()) -> Call | None:
    """The producer: the first call (completion order) whose outputs held NaN/Inf
    (``events``: the step's, the capture's counts) and whose inputs are finite."""
    made = _made(events)
    for call in calls:
        if call.outputs is not None and _outputs_nonfinite(call, made) and all_finite(
                tensors((call.args, call.kwargs))):
            return call
    return None


def find_backward(calls: list[Call], paused) -> tuple[Call, dict] | None:
    """The backward producer: a call whose output gradients are finite and whose
    replayed backward makes a non-finite gradient, the deepest first (calls with
    the shortest span, then the latest); with what its replay found."""
    tried = sorted((c for c in calls if c.grads and all_finite(c.grads.values())),
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
    if floating(t) and t.numel():
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
        kind = _kind_of(f)
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
            out["forward_library_source"], out["forward_library_code"] = _line(library)
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
            outs = [t for t in tensors(out) if floating(t)]
            if outs and not all_finite(outs):
                ins = tensors((args, kwargs))
                if all_finite(ins):
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


def replay(call: Call, paused, backward: bool = False) -> dict:
    """Run ``call`` again and name the op that made its NaN/Inf (see the module);
    ``paused`` silences the recorder's hooks meanwhile.  With ``backward``, run its
    forward and then its backward from the kept output gradients, checking the
    backward's ops.  The answer as JSON."""
    where = {"module": call.name, "module_class": type(call.module).__qualname__,
             "micro": call.micro, "phase": "backward" if backward else "forward",
             "torch_version": torch.__version__}
    if [t._version for t in tensors((call.args, call.kwargs))] != call.versions:
        return {**where, "op": None, "note": "its inputs were changed in place after the call; "
                                             "not replayed"}
    module = call.module
    why = collectives(module)               # before anything touches a sharded parameter
    if why is not None:
        return {**where, **not_replayed(why)}
    if not all_finite(p.detach() for p in module.parameters()):
        return {**where, "op": None, "note": "its parameters hold NaN/Inf: they were made so "
                                             "outside the forward (the optimizer step before "
                                             "this one?)"}
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    cuda_rng = {d: torch.cuda.get_rng_state(d) for d in call.cuda_rng}
    args, kwargs = tree_map(lambda x: x.detach().clone().requires_grad_(
        backward and floating(x) and x.requires_grad) if isinstance(x, torch.Tensor) else x,
        (call.args, call.kwargs))
    check, guard = _Check(call.caller), NoCollective()
    try:
        torch.set_rng_state(call.rng)
        for d, state in call.cuda_rng.items():
            torch.cuda.set_rng_state(state, d)
        with contextlib.ExitStack() as stack:
            # a replay is tensortape's machinery: what it makes warn (the user's code again,
            # anomaly mode when the check stops the backward) is not news (``quiet``)
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
                wrt = [t for t in tensors((args, kwargs)) if t.requires_grad] + [
                    p for p in module.parameters() if p.requires_grad]
                if pairs and wrt:
                    with check:
                        torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs],
                                            allow_unused=True)
    except _Found:
        pass
    except Collective:
        return {**where, **not_replayed(f"the collective {guard.op}", refused=True)}
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

