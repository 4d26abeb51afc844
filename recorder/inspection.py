"""One batch through a model with the recorder's hooks and statistics, in
memory: the torch side of ``analysis.Inspector``.

The hooks are the recorder's own ``HookSet`` and the statistics its own
engine (eager kernels: compiling them for one batch would cost seconds), so
an inspection's numbers are the numbers a store would hold.  Nothing is
written anywhere; the hooks live only inside ``inspect_batch``.

Runs on the caller's thread (``Inspector``), and on autograd's threads for the
gradient hooks of the backward pass it runs; it starts none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import format as fmt
from ._config import RecorderConfig
from .capture._engines import summarize
from .hooks._hooks import HookSet
from .hooks._naming import leaves

__all__ = ["Capture", "inspect_batch", "watched_kinds"]


@dataclass(frozen=True)
class Capture:
    """One tensor a hook saw: a copy on the CPU, its statistics (the store's
    names; counts are ints) and its histogram in the shared bins."""
    tensor: torch.Tensor
    stats: dict
    hist: np.ndarray


def watched_kinds(what) -> tuple[str, ...]:
    """The kinds ``what`` names (as ``Recorder(capture=...)`` reads them); a
    ``ConfigError`` for an unknown one."""
    return RecorderConfig.build(capture=what).capture


class _Sink:
    """What the hooks hand their captures to: here, a dict."""

    micro = 0

    def __init__(self):
        self.token: object | None = None
        self.captures: dict[tuple[str, str], Capture] = {}
        self.on_end: list = []                  # no step ends: the hooks' cleanup is never due

    def current_token(self) -> object:
        return self.token

    def begin_pass(self) -> None:
        return None

    def eval_pass(self) -> bool:
        """A pass without grad is the one inspected: never an evaluation pass."""
        return False

    def fault(self, error, kind, name) -> None:
        raise error

    def add(self, kind, name, tensor, token, micro=0) -> None:
        if token is None or token is not self.token:
            return
        t = tensor.detach()
        s = summarize(t, compile=False)
        stats = {k: (int(v[0]) if k in fmt.COUNT_STATS else float(v[0])) for k, v in s.stats.items()}
        self.captures[(name, kind)] = Capture(t.to("cpu", copy=True), stats, s.hist[0].astype(np.int64))


def inspect_batch(model: nn.Module, watched, data, target=None, loss_fn=None, into=None):
    """One forward of ``model`` on ``data`` (and backward, when a backward kind is
    watched) with hooks on ``watched``, a list of (layer names, kinds); returns
    the output and ``{(layer, kind): Capture}``.

    data: a tensor, a tuple/list (positional arguments) or a dict (keywords).
    The backward pass runs on ``loss_fn(output, target)``, or without ``loss_fn``
    on the sum of every floating-point output tensor that requires grad.
    Parameters' ``.grad`` are as they were before the call, and the hooks are
    removed in a ``finally``.  into: the dict to fill (it holds what was
    captured before an error)."""
    sink = _Sink()
    if into is not None:
        sink.captures = into
    sink.token = token = object()
    backward = any(k in fmt.BACKWARD_KINDS for _, kinds in watched for k in kinds)
    saved = {p: p.grad for p in model.parameters()} if backward else {}
    hooksets = [HookSet(model, names, kinds, sink, keeper=None) for names, kinds in watched]
    try:
        for h in hooksets:
            h.attach()
        if isinstance(data, dict):
            out = model(**data)
        elif isinstance(data, (tuple, list)):
            out = model(*data)
        else:
            out = model(data)
        if backward:
            for p in saved:
                p.grad = None
            if loss_fn is not None:
                loss = loss_fn(out, target)
            else:
                loss = sum(t.float().sum() for _, t in leaves(out) if t.requires_grad)
            loss.backward()
            for h, (_, kinds) in zip(hooksets, watched):
                if "weight_grads" in kinds:
                    for name, g in h.weight_grads():
                        sink.add("weight_grads", name, g, token, 0)
    finally:
        sink.token = None
        for h in hooksets:
            h.detach()
        for p, g in saved.items():
            p.grad = g
    return out, sink.captures
