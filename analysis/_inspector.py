"""The in-memory, one-batch sibling of the Recorder, for notebooks.

The batch runs on the torch side (``recorder.inspection``: the recorder's own
hooks and statistics engine, so its numbers are the store's numbers); this
module keeps what it captured and shows it as the reader shows a run (an
``xr.DataArray``, a Figure).  It imports no torch itself: the model's side
loads at the first ``watch``.
"""

from __future__ import annotations

import xarray as xr

from tensortape.recorder.errors import ConfigError, LayerNotFoundError
from tensortape.recorder.histogram import bin_centers, bin_edges
from tensortape.recorder.patterns import closest

__all__ = ["Inspector"]


class Inspector:
    """One batch through a model, in memory, with the recorder's hooks and
    statistics (the numbers a store would hold), for notebooks.

    ``Inspector(model)``, then ``watch(pattern, what=...)`` once or more, then
    ``run_inspection(data, target, loss_fn)``; then ``get_statistics``,
    ``get_histogram``, ``plot_histogram`` and ``captured_data`` (a dict
    ``{(layer, kind): tensor on the CPU}``).  Nothing is written to disk.
    """

    def __init__(self, model):
        """model: any ``nn.Module``; it is not changed (hooks live only inside
        ``run_inspection``, and parameters' ``.grad`` are restored)."""
        self.model = model
        self._watched: list[tuple[list[str], tuple[str, ...]]] = []
        self.captured_data: dict = {}          # (layer, kind) -> torch.Tensor on the CPU
        self._captures: dict = {}              # (layer, kind) -> recorder.inspection.Capture

    def watch(self, pattern, what=("activations", "gradients"), *, capture=None) -> list[str]:
        """Watch the layers a glob pattern (or list of them) selects; returns their names.

        what: the kinds to capture, any of ``activations``, ``gradients``,
        ``inputs``, ``weights``, ``weight_grads`` (``capture=`` is a synonym, as in
        ``Recorder``).  A pattern that matches no layer raises
        ``LayerNotFoundError`` naming the closest."""
        from tensortape.recorder import select_layers
        from tensortape.recorder.inspection import watched_kinds
        if capture is not None:
            what = capture
        kinds = watched_kinds(what)
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
        from tensortape.recorder.inspection import inspect_batch
        self._captures = {}
        try:
            out, _ = inspect_batch(self.model, self._watched, data, target, loss_fn,
                                   into=self._captures)
        finally:
            self.captured_data = {k: c.tensor for k, c in self._captures.items()}
        return out

    def _capture(self, layer: str, what: str):
        if (layer, what) not in self._captures:
            names = sorted({n for n, k in self._captures if k == what})
            shown = closest(layer, names) if names else "none yet (call run_inspection first)"
            raise LayerNotFoundError(f"no {what} captured for layer {layer!r}; captured: {shown}")
        return self._captures[(layer, what)]

    def get_statistics(self, layer: str, what: str = "activations") -> dict[str, float]:
        """The statistics of one capture (the store's names; counts are ints).
        layer: a watched layer's name; what: its kind."""
        return dict(self._capture(layer, what).stats)

    def get_histogram(self, layer: str, what: str = "activations") -> xr.DataArray:
        """The histogram of one capture in the shared bins: dims (bin,), coords
        ``bin_lo``/``bin_hi``, and the ``nan``/``posinf``/``neginf`` counts."""
        c = self._capture(layer, what)
        lo, hi = bin_edges()
        coords = {"bin": bin_centers(), "bin_lo": ("bin", lo), "bin_hi": ("bin", hi)}
        coords.update({k: int(c.stats[k]) for k in ("nan", "posinf", "neginf")})
        return xr.DataArray(c.hist, dims=("bin",), coords=coords, name=f"{layer} {what}",
                            attrs={"layer": layer, "kind": f"{what} (one batch)"})

    def plot_histogram(self, layer: str, what: str = "activations", ax=None):
        """The histogram of one capture -> Figure."""
        from .plots import _plots
        h = self.get_histogram(layer, what).expand_dims(step=[0])
        for k in ("nan", "posinf", "neginf"):
            h.coords[k] = ("step", [int(h.coords[k])])
        return _plots.histogram(h, steps=[0], ax=ax)
