"""The in-memory, one-batch sibling of the Recorder, for notebooks.

It registers hooks with the recorder's own ``HookSet`` and summarises with the
recorder's statistics engine, so its numbers are the store's numbers.  For one
batch it runs the eager kernels: compiling them would cost seconds.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr
from torch import nn

from recorder import format as fmt
from recorder._config import RecorderConfig
from recorder._engines import summarize
from recorder._hooks import HookSet
from recorder._naming import leaves
from recorder._selection import select_layers
from recorder.errors import ConfigError, LayerNotFoundError

__all__ = ["Inspector"]


class _Sink:
    """What the recorder's ``HookSet`` hands its captures to: here, memory."""

    micro = 0

    def __init__(self, inspector: "Inspector"):
        self._inspector = inspector
        self.token: object | None = None

    def current_token(self) -> object:
        return self.token

    def begin_pass(self) -> None:
        return None

    def fault(self, error, kind, name) -> None:
        raise error

    def add(self, kind, name, tensor, token, micro=0) -> None:
        if token is None or token is not self.token:
            return
        t = tensor.detach()
        self._inspector.captured_data[(name, kind)] = t.to("cpu", copy=True)
        s = summarize(t, compile=False)
        stats = {k: (int(v[0]) if k in fmt.COUNT_STATS else float(v[0])) for k, v in s.stats.items()}
        self._inspector._stats[(name, kind)] = (stats, s.hist[0])


class Inspector:
    """One batch through a model, in memory, with the recorder's hooks and
    statistics (the numbers a store would hold), for notebooks.

    ``Inspector(model)``, then ``watch(pattern, what=...)`` once or more, then
    ``run_inspection(data, target, loss_fn)``; then ``get_statistics``,
    ``get_histogram``, ``plot_histogram`` and ``captured_data`` (a dict
    ``{(layer, kind): tensor on the CPU}``).  Nothing is written to disk.
    """

    def __init__(self, model: nn.Module):
        """model: any ``nn.Module``; it is not changed (hooks live only inside
        ``run_inspection``, and parameters' ``.grad`` are restored)."""
        self.model = model
        self._watched: list[tuple[list[str], tuple[str, ...]]] = []
        self.captured_data: dict[tuple[str, str], torch.Tensor] = {}
        self._stats: dict[tuple[str, str], tuple[dict, np.ndarray]] = {}
        self._sink = _Sink(self)

    def watch(self, pattern, what=("activations", "gradients"), *, capture=None) -> list[str]:
        """Watch the layers a glob pattern (or list of them) selects; returns their names.

        what: the kinds to capture, any of ``activations``, ``gradients``,
        ``inputs``, ``weights``, ``weight_grads`` (``capture=`` is a synonym, as in
        ``Recorder``).  A pattern that matches no layer raises
        ``LayerNotFoundError`` naming the closest."""
        if capture is not None:
            what = capture
        kinds = RecorderConfig.build(capture=what).capture
        names = select_layers(self.model, pattern)
        self._watched.append((names, kinds))
        return names

    def run_inspection(self, data, target=None, loss_fn=None):
        """One forward (and backward, when a backward kind is watched); returns the output.

        data: the model's input: a tensor, a tuple/list (positional arguments) or a
        dict (keyword arguments).  target, loss_fn: the backward pass runs on
        ``loss_fn(output, target)``; without ``loss_fn``, on the sum of every
        floating-point tensor in the output that requires grad (so each output
        element's gradient is 1).  Parameters' ``.grad`` are as they were before
        the call, and the hooks are removed in a ``finally``.  Raises
        ``ConfigError`` when nothing is watched (call ``watch()`` first).
        """
        if not self._watched:
            raise ConfigError("nothing is watched; call inspector.watch(pattern) before "
                              "run_inspection")
        self.captured_data, self._stats = {}, {}
        self._sink.token = token = object()
        backward = any(k in fmt.BACKWARD_KINDS for _, kinds in self._watched for k in kinds)
        saved = {p: p.grad for p in self.model.parameters()} if backward else {}
        hooksets = [HookSet(self.model, names, kinds, self._sink) for names, kinds in self._watched]
        try:
            for h in hooksets:
                h.attach()
            if isinstance(data, dict):
                out = self.model(**data)
            elif isinstance(data, (tuple, list)):
                out = self.model(*data)
            else:
                out = self.model(data)
            if backward:
                for p in saved:
                    p.grad = None
                if loss_fn is not None:
                    loss = loss_fn(out, target)
                else:
                    loss = sum(t.float().sum() for _, t in leaves(out) if t.requires_grad)
                loss.backward()
                for h, (_, kinds) in zip(hooksets, self._watched):
                    if "weight_grads" in kinds:
                        for name, g in h.weight_grads():
                            self._sink.add("weight_grads", name, g, token, 0)
        finally:
            self._sink.token = None
            for h in hooksets:
                h.detach()
            for p, g in saved.items():
                p.grad = g
        return out

    def _key(self, layer: str, what: str) -> tuple[str, str]:
        if (layer, what) not in self._stats:
            names = sorted({n for n, k in self._stats if k == what})
            shown = fmt.closest(layer, names) if names else "none yet (call run_inspection first)"
            raise LayerNotFoundError(f"no {what} captured for layer {layer!r}; captured: {shown}")
        return layer, what

    def get_statistics(self, layer: str, what: str = "activations") -> dict[str, float]:
        """The statistics of one capture (the store's names; counts are ints).
        layer: a watched layer's name; what: its kind."""
        return dict(self._stats[self._key(layer, what)][0])

    def get_histogram(self, layer: str, what: str = "activations") -> xr.DataArray:
        """The histogram of one capture in the shared bins: dims (bin,), coords
        ``bin_lo``/``bin_hi``, and the ``nan``/``posinf``/``neginf`` counts."""
        stats, hist = self._stats[self._key(layer, what)]
        lo, hi = fmt.bin_edges()
        coords = {"bin": fmt.bin_centers(), "bin_lo": ("bin", lo), "bin_hi": ("bin", hi)}
        coords.update({k: int(stats[k]) for k in ("nan", "posinf", "neginf")})
        return xr.DataArray(hist, dims=("bin",), coords=coords, name=f"{layer} {what}",
                            attrs={"layer": layer, "kind": f"{what} (one batch)"})

    def plot_histogram(self, layer: str, what: str = "activations", ax=None):
        """The histogram of one capture -> Figure."""
        from . import _plots
        h = self.get_histogram(layer, what).expand_dims(step=[0])
        for k in ("nan", "posinf", "neginf"):
            h.coords[k] = ("step", [int(h.coords[k])])
        return _plots.histogram(h, steps=[0], ax=ax)

