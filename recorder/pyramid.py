"""The arithmetic of a stats table's summary pyramid (its layout: ``format``).

A row of a stats table gives each layer's value of every map statistic
(``map_value``: what the browser view's map colours) and whether it is
non-finite (``any_nonfinite``); a grain of rows gives their maxima
(``grain_maxima``, a fold in row order, so the writer's stored pyramid and a
reader's own computation from the rows are the same numbers).

Public: the writer (``_table.Pyramid``) and the reader (``analysis``) import
it.  Pure numpy, no state; any thread.
"""

from __future__ import annotations

import numpy as np

from . import format as fmt

__all__ = ["any_nonfinite", "grain_maxima", "map_value", "pyramid_values"]


def map_value(got: dict, stat: str) -> np.ndarray:
    """The map statistic ``stat`` (``format.MAP_STATS``) of rows of a stats table (``got``:
    each statistic needed, rows x layers): NaN where a layer did not run."""
    bad = sum(np.nan_to_num(got[k], nan=0.0) for k in fmt.COUNT_STATS[1:])
    if stat == "nonfinite":
        return np.where(np.isnan(got["nan"]), np.nan, bad)
    if stat == "rms":
        finite = got["count"] - bad
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(finite > 0, got["norm"] / np.sqrt(finite), np.nan)
    return got[stat]


def any_nonfinite(got: dict) -> np.ndarray:
    """Whether each row and layer of ``got`` (as ``map_value``'s) holds NaN or Inf."""
    return sum(np.nan_to_num(got[k], nan=0.0) for k in fmt.COUNT_STATS[1:]) > 0


def pyramid_values(packed: np.ndarray) -> np.ndarray:
    """Rows of a stats table (rows, layer, ``format.STATS``) as a pyramid's values (rows,
    layer, ``format.PYRAMID_STATS``)."""
    got = {s: packed[..., i] for i, s in enumerate(fmt.STATS)}
    return np.stack([*(map_value(got, s) for s in fmt.MAP_STATS), any_nonfinite(got)], axis=-1)


def grain_maxima(values: np.ndarray, grain: int) -> np.ndarray:
    """The maxima of each whole grain of ``grain`` rows of ``values`` (rows first):
    each a fold of its rows in order (``np.fmax``: NaN only where every row is)."""
    return np.fmax.reduce(values.reshape(-1, grain, *values.shape[1:]), axis=1)
