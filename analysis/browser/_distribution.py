"""A layer's histograms over steps, the browser view's step x value picture.

Each column holds consecutive steps and is the **sum** of their counts (never a
sample, never re-binned): a one-step outlier is in its column.  Rows are the
shared bins in value order, neighbouring ones summed where they are narrower
than the eye sees on the drawn axis, as the histogram picture sums them
(``_plot_histogram``): a linear value axis (each cell the column's density per
unit of value), or a symmetric-log one (density per decade of |value|).  A
cell's density is its count over the column's finite values and the row's
width on the drawn axis, so a column integrates to its share of finite non-zero
values.  Exact zeros (a point mass: no density), NaN, +Inf and -Inf are counts
per column of their own.  Memory: a block of ``BLOCK`` rows read at a time.
"""

from __future__ import annotations

import numpy as np

from tensortape.recorder import format as fmt

from ._grains import BLOCK, read, reduce
from ..plots._plot_histogram import RESOLUTION, edges_closed, bin_groups, linthresh_of, to_axis
from .._tables import as_slice

__all__ = ["distribution"]

NONFINITE = fmt.COUNT_STATS[1:]


def _hist(run, path: str, rank: int, rows: np.ndarray, col: int) -> np.ndarray:
    """The layer's histogram rows at ``rows`` (block, bin); a row where it did not run: 0."""
    sel = as_slice(rows)
    if isinstance(sel, slice) and run.index.tables.version == 3:
        run.index.checked_rows(path, rank)
        return np.maximum(np.asarray(run.index.source.array(f"{path}/hist")[sel, col]), 0)
    return np.maximum(np.asarray(run.index.tables.lazy(f"{path}/hist")[sel, col]), 0)


def distribution(run, kind: str, rank: int, rows: np.ndarray, edges: np.ndarray, col: int,
                 h, scale: str = "linear") -> dict:
    """Columns (``edges``: offsets into ``rows``, the window's rows of the stats table) of
    layer column ``col``'s histograms; ``h``: the layer's ``Run.histogram`` (its bins).
    ``row_lo``/``row_hi``: each value row's edges, ``row_t_lo``/``row_t_hi`` on the drawn
    axis; ``density`` (row x column); ``finite``, ``zeros``, ``nan``, ``posinf``,
    ``neginf`` (per column); ``linthresh`` (symlog); ``lo``/``hi``: the true range."""
    path = fmt.stats_group(rank, kind)
    n, ncol = int(edges[-1]), len(edges) - 1
    lo_e, hi_e = edges_closed(h)
    sums = np.zeros((ncol, len(lo_e)), np.int64)
    bad = {k: np.zeros(ncol, np.int64) for k in NONFINITE}
    vmin, vmax = np.full(ncol, np.nan), np.full(ncol, np.nan)
    for b0 in range(0, n, BLOCK):
        ids = rows[b0:min(n, b0 + BLOCK)]
        reduce(_hist(run, path, rank, ids, col), b0, edges, sums, np.add)
        got = read(run, kind, rank, (*NONFINITE, "min", "max"), as_slice(ids), col)
        for k in NONFINITE:
            reduce(np.maximum(np.nan_to_num(got[k], nan=0), 0).astype(np.int64), b0, edges,
                   bad[k], np.add)
        reduce(np.asarray(got["min"], float), b0, edges, vmin, np.fmin)
        reduce(np.asarray(got["max"], float), b0, edges, vmax, np.fmax)
    zero = (lo_e == 0) & (hi_e == 0)
    finite = sums.sum(axis=1)
    total = sums.sum(axis=0)
    out = {"scale": scale, "finite": finite, "zeros": sums[:, zero].sum(axis=1), **bad,
           "linthresh": None, "lo": np.nanmin(vmin) if np.isfinite(vmin).any() else np.nan,
           "hi": np.nanmax(vmax) if np.isfinite(vmax).any() else np.nan}
    used = np.nonzero(total * ~zero)[0]
    if not used.size:
        empty = np.zeros(0)
        return {**out, "row_lo": empty, "row_hi": empty, "row_t_lo": empty, "row_t_hi": empty,
                "density": np.zeros((0, ncol))}
    mid = np.where(lo_e * hi_e > 0, np.sign(lo_e) * np.sqrt(np.abs(lo_e * hi_e)), 0.0)
    lt = linthresh_of(total, mid) if scale == "symlog" else None
    rng = (out["lo"], out["hi"]) if np.isfinite(out["lo"]) else (lo_e[used].min(),
                                                                    hi_e[used].max())
    group, g_lo, g_hi, _ = bin_groups(lo_e, hi_e, used, lt, rng)
    g_lo, g_hi = np.maximum(g_lo, rng[0]), np.minimum(g_hi, rng[1])   # the true range
    per = np.zeros((len(g_lo), ncol), np.int64)
    inside = group >= 0
    np.add.at(per, group[inside], sums[:, inside].T)
    keep = per.any(axis=1)
    g_lo, g_hi, per = g_lo[keep], g_hi[keep], per[keep]
    t_lo, t_hi = to_axis(g_lo, lt), to_axis(g_hi, lt)
    width = np.maximum(t_hi - t_lo, (t_hi.max() - t_lo.min()) / RESOLUTION / 1e6)
    with np.errstate(invalid="ignore", divide="ignore"):
        density = per / (finite[None, :] * width[:, None])
    return {**out, "linthresh": lt, "row_lo": g_lo, "row_hi": g_hi, "row_t_lo": t_lo,
            "row_t_hi": t_hi, "density": np.where(finite[None, :] > 0, density, np.nan)}
