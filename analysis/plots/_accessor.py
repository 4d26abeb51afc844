"""``run.plot``: a run's pictures, in the style of xarray's plot accessor
(``run.plot.histogram(...)``, ``run.plot.evolution(...)``,
``run.plot.distribution(...)``).  Each reads one rank (default: the first) and
returns a matplotlib Figure; matplotlib loads at the first picture."""

from __future__ import annotations

from typing import Generic, TypeVar

from tensortape.recorder.errors import ConfigError

from ._plot_histogram import SCALES
from .._select import Names, one_layer, within

__all__ = ["RunPlotAccessor", "UncachedAccessor"]

_A = TypeVar("_A")


class UncachedAccessor(Generic[_A]):
    """An accessor made anew at each access (``run.plot``), as xarray's: the class
    itself on the class (so its methods' docs show), bound to the run on a run."""

    def __init__(self, accessor: type[_A]):
        self._accessor = accessor

    def __get__(self, obj, cls) -> type[_A] | _A:
        if obj is None:
            return self._accessor
        return self._accessor(obj)


def with_range(h, st):
    """Histogram ``h`` with each step's true ``min`` and ``max`` (from ``st``) as coords."""
    return h.assign_coords(min=("step", st["min"].values.astype(float)),
                           max=("step", st["max"].values.astype(float)))


class RunPlotAccessor:
    """The pictures of a run: ``run.plot.histogram``, ``run.plot.evolution`` and
    ``run.plot.distribution`` (``run.plot_histogram`` and the others are the same)."""

    __slots__ = ("_run",)

    def __init__(self, run):
        self._run = run

    def histogram(self, layer, kind="activations", steps=None, rank=None, ax=None,
                  density: bool = True, scale: str = "linear"):
        """Histogram of ``layer`` at some steps (an int or a list; default: the last
        with finite values) over values -> Figure.  Each bar is a density, so that
        the picture's shape is the data's: ``scale="linear"`` (the default), a
        linear value axis and density per unit of value (a Gaussian is one bell);
        ``scale="symlog"``, a symmetric-log axis and density per decade of |value|
        (for heavy tails: a log-normal is one bell).  The axis labels say which.
        ``density=False``: the count in each bar instead.  Exact zeros are marked
        lines; NaN/+Inf/-Inf are counted in bars beside, never drawn as values."""
        if scale not in SCALES:
            raise ConfigError(f"scale {scale!r}: use one of {', '.join(SCALES)}")
        run = self._run
        rank = run.index.rank(rank)                   # one rank's picture (default: the first)
        from . import _plots
        h = run.histogram(layer, kind, rank=rank).compute()
        st = one_layer(run.stats(kind, Names([layer]), rank=rank)).compute()
        return _plots.histogram(with_range(h, st), steps, ax, density=density, scale=scale)

    def evolution(self, layers=None, kind="activations", stat="std", rank=None, ax=None,
                  steps: slice | None = None):
        """One statistic over the steps (``steps``: a slice of step numbers, half-open;
        default all), a line per layer (past 6 layers, a panel per layer, at most 40,
        each titled with the layer's full name), each layer's NaN/Inf steps marked on a
        strip below or shaded, never drawn as values, with their counts -> Figure."""
        run = self._run
        rank = run.index.rank(rank)
        from . import _plots
        ds = within(run.stats(kind, layers, rank=rank), steps)
        if stat not in ds:
            raise ConfigError(f"stat {stat!r} is not recorded; use one of {', '.join(ds.data_vars)}")
        return _plots.evolution(ds.compute().assign_attrs(run=run.name), stat, ax)

    def distribution(self, layer, kind="activations", rank=None, ax=None,
                     steps: slice | None = None):
        """Step x value picture of ``layer``'s histogram (``steps``: a half-open slice of
        step numbers; default all): bands from the true min and max and the
        percentiles, the median, NaN/Inf counts below -> Figure."""
        run = self._run
        rank = run.index.rank(rank)
        from . import _plots
        h = within(run.histogram(layer, kind, rank=rank), steps).compute()
        st = one_layer(within(run.stats(kind, Names([layer]), rank=rank), steps))
        return _plots.distribution(with_range(h, st), ax)
