"""The in-memory, one-batch sibling of the Recorder, for notebooks.

It uses the recorder's own hook machinery (``recorder.hooks.HookSet``) and
statistics (``recorder.summary``), so its numbers are the store's numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from recorder.config import RecorderConfig
from recorder.errors import LayerNotFoundError
from recorder.hooks import HookSet
from recorder.naming import leaves
from recorder.selection import select_layers
from recorder.summary import summarize

__all__ = ["Inspector"]


class Inspector:
    def __init__(self, model: nn.Module):
        self.model = model
        self._watched: list[tuple[list[str], tuple[str, ...]]] = []
        self.captured_data: dict[tuple[str, str], torch.Tensor] = {}
        self._stats: dict[tuple[str, str], tuple[dict, object]] = {}

    def watch(self, pattern, what=("activations", "gradients")) -> list[str]:
        """Watch the layers a glob pattern (or list) selects; returns their names."""
        kinds = RecorderConfig.build(
            capture=what, tensors_every=1, stats_every=1, ring=0, on_nonfinite="record",
            max_samples=None, tensor_dtype=None, mode="w-", flush_interval=1.0,
            max_pending_bytes=1).capture
        names = select_layers(self.model, pattern)
        self._watched.append((names, kinds))
        return names

    def _capture(self, kind, name, tensor, token) -> None:
        t = tensor.detach()
        self.captured_data[(name, kind)] = t.to("cpu", copy=True)
        self._stats[(name, kind)] = summarize(t)

    def run_inspection(self, data, target=None, loss_fn=None):
        """One forward (and backward, when gradients are watched); returns the output."""
        self.captured_data, self._stats = {}, {}
        token = object()
        hooksets = [HookSet(self.model, names, kinds, self._capture, lambda: token)
                    for names, kinds in self._watched]
        try:
            for h in hooksets:
                h.attach()
            if isinstance(data, dict):
                out = self.model(**data)
            elif isinstance(data, (tuple, list)):
                out = self.model(*data)
            else:
                out = self.model(data)
            if any(k in ("gradients", "weight_grads") for _, kinds in self._watched for k in kinds):
                if loss_fn is not None:
                    loss = loss_fn(out, target)
                else:
                    loss = sum(t.float().sum() for _, t in leaves(out) if t.requires_grad)
                loss.backward()
                for h, (_, kinds) in zip(hooksets, self._watched):
                    if "weight_grads" in kinds:
                        for name, g in h.weight_grads():
                            self._capture("weight_grads", name, g, token)
        finally:
            for h in hooksets:
                h.detach()
        return out

    def _key(self, layer: str, what: str) -> tuple[str, str]:
        if (layer, what) not in self._stats:
            import difflib
            names = sorted({n for n, k in self._stats if k == what})
            close = difflib.get_close_matches(layer, names, n=3, cutoff=0.3) or names[:3]
            raise LayerNotFoundError(f"no {what} captured for layer {layer!r}; captured: "
                                     f"{', '.join(close) or 'none (call run_inspection first)'}")
        return layer, what

    def get_statistics(self, layer: str, what: str = "activations") -> dict[str, float]:
        return dict(self._stats[self._key(layer, what)][0])

    def plot_histogram(self, layer: str, what: str = "activations"):
        import numpy as np
        from recorder import format as fmt
        from .plots import _centers, _figure
        stats, hist = self._stats[self._key(layer, what)]
        fig, ax = _figure()
        lo, hi = fmt.bin_edges()
        if hist is not None:
            x = _centers(lo, hi)
            ax.step(x, np.where(hist > 0, hist, np.nan), where="mid",
                    label=f"nan {int(stats['nan'])}, +inf {int(stats['posinf'])}, -inf {int(stats['neginf'])}")
            used = x[hist > 0]
            if used.size:
                ax.set_xscale("symlog", linthresh=max(np.abs(used).max() * 1e-6, 1e-30))
            ax.set_yscale("log")
            ax.legend(fontsize="small")
        ax.set_xlabel("value")
        ax.set_ylabel("count")
        ax.set_title(f"{layer} · {what} (one batch)")
        return fig
