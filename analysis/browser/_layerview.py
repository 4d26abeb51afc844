"""The browser view's answers about one layer (``/api/histogram``,
``/api/distribution``, ``/api/stats``), as pure functions of an open run, as
``_api``'s are: one step's histogram as the picture draws it, the histograms
over steps, and every statistic over steps, each column the largest of its
steps (the map's statistics of a long window from its grains)."""

from __future__ import annotations

import numpy as np

from tensortape.recorder import format as fmt, pyramid

from ._api import (MAP_STATS, NONFINITE, NotFound, column_edges, fill_columns, grid_of, checked_kind, checked_layer, checked_rank,
                   checked_stat, checked_width, window_of, ints, numbers)
from ._grains import BLOCK, MAP_NEEDS, Grains, MapColumns, read as _read, reduce as _reduce
from .._stats import Statistics
from .._tables import as_slice

__all__ = ["STAT_CHOICES", "distribution", "histogram", "stats"]

_map_values = pyramid.map_value
SCALES = ("linear", "symlog")


def _step(run, kind: str, rank: int, step) -> int:
    """``step``, checked: one with statistics of ``kind`` (its index among them)."""
    if step is None:
        raise NotFound("no step asked (step=N)")
    steps = run.steps(kind, rank=rank)
    at = np.searchsorted(steps, int(step))
    if at >= len(steps) or steps[at] != int(step):
        raise NotFound(f"step {step} has no {kind} statistics")
    return int(at)


def _scale(scale: str) -> str:
    if scale not in SCALES:
        raise NotFound(f"no scale {scale!r}; one of {', '.join(SCALES)}")
    return scale


def _ticks(values, lt) -> list[dict]:
    """Ticks of a symmetric-log axis: each value's place on the drawn axis, its label."""
    from ..plots._axes import value_text
    from ..plots._plot_histogram import to_axis
    return [{"t": float(to_axis(v, lt)), "label": value_text(v)} for v in values]


def histogram(run, layer: str, kind: str = "activations", step=None, rank=None,
              scale: str = "linear") -> dict:
    """The layer's histogram at ``step``: its counts over the bins that hold any (the
    bins outside ``[first_bin, first_bin + len(counts))`` hold none), its NaN/Inf
    counts, and ``bars`` as the picture draws them (``_plot_histogram.layout``: the
    density on a ``scale`` "linear" or "symlog" axis; ``masses``: exact zeros)."""
    from ..plots._accessor import with_range
    from ..plots._plot_histogram import to_axis, layout
    rank = checked_rank(run, rank)
    checked_kind(run, kind, rank)
    checked_layer(run, layer, kind, rank)
    i = _step(run, kind, rank, step)
    h = run.histogram(layer, kind, rank=rank).isel(step=[i]).compute()
    st = run.stats(kind, [layer], rank=rank).isel(layer=0, step=[i]).compute()
    h = with_range(h, st)
    counts = np.asarray(h.values[0], np.int64)
    held = np.nonzero(counts > 0)[0]
    a, b = (int(held[0]), int(held[-1]) + 1) if len(held) else (0, 0)
    drawn = layout(h, [int(step)], True, _scale(scale))
    bars = drawn["bars"][0] if drawn["bars"] else None
    lt = drawn["linthresh"]
    return {"layer": layer, "kind": kind, "step": int(step), "rank": rank,
            "absent": bool((counts < 0).all()), "first_bin": a, "bins": int(len(counts)),
            "bin_lo": numbers(h.bin_lo.values[a:b]), "bin_hi": numbers(h.bin_hi.values[a:b]),
            "counts": ints(np.maximum(counts[a:b], 0)),
            **{k: int(h[k].values[0]) for k in NONFINITE},
            "scale": scale, "total": bars["total"] if bars else 0,
            "bars": {k: (ints(bars[k]) if k == "count" else numbers(bars[k])) if bars else []
                     for k in ("lo", "hi", "t_lo", "t_hi", "count", "height")},
            "masses": [{"value": float(m["value"]), "t": float(to_axis(m["value"], lt)),
                        "count": int(m["count"])} for m in drawn["masses"]],
            "linthresh": lt, "xlim": numbers(drawn["xlim"]) if drawn["xlim"] else None,
            "t_xlim": numbers(to_axis(drawn["xlim"], lt)) if drawn["xlim"] else None,
            "ticks": _ticks(drawn["ticks"], lt) if drawn["ticks"] else None,
            "xlabel": drawn["xlabel"].split("\n")[0], "ylabel": drawn["ylabel"],
            "bulk": bool(drawn["bulk"])}


def distribution(run, layer: str, kind: str = "activations", rank=None, start=None, stop=None,
                 width: int = 400, scale: str = "linear") -> dict:
    """The layer's histograms over steps [start, stop) in at most ``width`` columns of
    consecutive steps, each the sum of its steps' counts (``_distribution``)."""
    from ._distribution import distribution as columns
    rank = checked_rank(run, rank)
    checked_kind(run, kind, rank)
    col = checked_layer(run, layer, kind, rank)
    _, rows, steps = Statistics(run.index).rows(kind, rank)
    i0, i1 = window_of(steps, start, stop)
    n = i1 - i0
    edges = column_edges(n, checked_width(width))
    h = run.histogram(layer, kind, rank=rank)
    got = columns(run, kind, rank, rows[i0:i1], edges if n else edges[:1], col, h,
                  _scale(scale))
    lt = got["linthresh"]
    ticks = None
    if lt is not None and np.isfinite(got["lo"]):
        from ..plots._axes import decade_ticks
        ticks = _ticks(decade_ticks(lt, got["lo"], got["hi"]), lt)
    return {"layer": layer, "kind": kind, "rank": rank, "scale": scale,
            "step_lo": ints(steps[i0 + edges[:-1]]) if n else [],
            "step_hi": ints(steps[i0 + edges[1:] - 1]) if n else [],
            "steps_in_window": int(n),
            "row_lo": numbers(got["row_lo"]), "row_hi": numbers(got["row_hi"]),
            "row_t_lo": numbers(got["row_t_lo"]), "row_t_hi": numbers(got["row_t_hi"]),
            "density": numbers(got["density"]),
            **{k: ints(got[k]) for k in ("finite", "zeros", *NONFINITE)},
            "linthresh": lt, "ticks": ticks, "lo": got["lo"] if np.isfinite(got["lo"]) else None,
            "hi": got["hi"] if np.isfinite(got["hi"]) else None}


def stats(run, layer: str, kind: str = "activations", rank=None, start=None, stop=None,
          width=None, only=None, grains: "Grains | None" = None) -> dict:
    """Every statistic of the layer (and ``rms``; ``only``: those named) at each step
    of [start, stop).  With ``width``, at most that many columns, each the largest
    of its steps' (``step`` is each column's first step, ``step_hi`` its last),
    cut as the map cuts them (``grid_of``): the map's statistics (``MAP_STATS``) of a
    long window are its grains' (``grains``, the pyramid), the others read from
    the rows.  ``nonfinite``: whether each column holds a step with a NaN or an Inf
    (where its other statistics cover only the finite values)."""
    rank = checked_rank(run, rank)
    checked_kind(run, kind, rank)
    col = checked_layer(run, layer, kind, rank)
    wanted = tuple(STAT_CHOICES) if only is None else tuple(dict.fromkeys(only))
    for s in wanted:
        checked_stat(s, STAT_CHOICES)
    _, rows, steps = Statistics(run.index).rows(kind, rank)
    i0, i1 = window_of(steps, start, stop)
    n = i1 - i0
    grid = grid_of(i0, i1, checked_width(width) if width is not None else max(n, 1),
                 grains if width is not None else None)
    edges = grid[1]
    out = {s: np.full(len(edges) - 1, np.nan) for s in wanted}
    bad = np.zeros(len(edges) - 1, bool)
    if grid[0]:                   # the map's statistics from its grains, the rest from rows
        for s in [s for s in wanted if s in MAP_STATS] or ["nonfinite"]:
            got = MapColumns(run, kind, rank, rows, s, i0, edges, 1, first=col)
            fill_columns(got, grid, grains, rows, i0, i1)
            out[s], bad = got.values[:, 0], got.bad[:, 0]
    rest = [s for s in wanted if not (grid[0] and s in MAP_STATS)]
    needs = [k for s in rest for k in (MAP_NEEDS[s] if s in MAP_STATS else (s,))]
    needs = tuple(dict.fromkeys([*needs, *NONFINITE]))
    for b0 in range(0, n if rest or not grid[0] else 0, BLOCK):
        got = _read(run, kind, rank, needs, as_slice(rows[i0 + b0: i0 + min(n, b0 + BLOCK)]), col)
        for s in rest:
            _reduce(np.asarray(_map_values(got, s) if s in MAP_STATS else got[s], np.float64),
                    b0, edges, out[s], np.fmax)
        _reduce(pyramid.any_nonfinite(got), b0, edges, bad, np.logical_or)
    body = {s: (ints(np.nan_to_num(v, nan=-1)) if s in fmt.COUNT_STATS else numbers(v))
            for s, v in out.items()} if n else {s: [] for s in wanted}
    lo = steps[i0 + edges[:-1]] if n else []
    hi = steps[i0 + edges[1:] - 1] if n else []
    return {"layer": layer, "kind": kind, "rank": rank, "step": ints(lo), "step_hi": ints(hi),
            "column_nonfinite": bad.tolist() if n else [], **body}


STAT_CHOICES = (*fmt.STATS, "rms", "nonfinite")
