"""The browser view's JSON API as pure functions: a run (or two) and the query's
arguments in, a JSON-able dict out (``tensortape serve`` encodes it).

JSON has no NaN or Inf: they are the strings ``"nan"``, ``"inf"`` and
``"-inf"``.  Counts are ints; every other number is the stored float64 itself
(``json`` writes ``repr``, the shortest text that reads back bit-exact).

A map column holds several steps when a window holds more steps than columns:
its value is the largest of its steps' (never a sample), and it is
non-finite when any of them holds a NaN or an Inf.  The map reads only the
rows of its window, a block of rows at a time, so its memory does not grow
with the run's steps.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import RecorderError
from tensortape.recorder.patterns import match_layers

from ._between import Between
from ._comparison import Comparison
from .._events import replay_lines
from .._numbers import number
from .._select import layer_coord
from .._stats import Statistics
from ._grains import GRAIN, Grains, MapColumns, reduce as _reduce

__all__ = ["BadRequest", "GRAIN", "Grains", "MAP_STATS", "NotFound", "compare_map", "map_",
           "runs", "scalars"]

MAP_STATS = fmt.MAP_STATS
NONFINITE = fmt.COUNT_STATS[1:]          # nan, posinf, neginf


class NotFound(RecorderError):
    """An unknown run, layer, kind, rank, step or statistic (HTTP 404)."""


class BadRequest(ValueError):
    """An argument that is not valid: not a number, a width of no columns (HTTP 400)."""


# --- numbers ---------------------------------------------------------------------------
def numbers(a) -> list:
    """A float array (any shape) as nested lists of ``number``s."""
    a = np.asarray(a, np.float64)
    out = a.tolist()
    if np.isfinite(a).all():
        return out
    def fix(x):
        return [fix(y) for y in x] if isinstance(x, list) else number(x)
    return fix(out)


def ints(a) -> list:
    return np.asarray(a, np.int64).tolist()


# --- checks ----------------------------------------------------------------------------
def checked_rank(run, rank) -> int:
    if rank is None:
        return run.ranks[0] if run.ranks else 0
    if rank not in run.ranks:
        raise NotFound(f"no rank {rank}; the run has ranks {run.ranks}")
    return rank


def checked_kind(run, kind: str, rank: int) -> None:
    if kind not in run.kinds_of(rank):
        raise NotFound(f"no kind {kind!r} on rank {rank}; the run has {run.kinds_of(rank)}")


def checked_layer(run, layer: str, kind: str, rank: int) -> int:
    names = run.index.stats_layers(kind, rank)
    if layer not in names:
        raise NotFound(f"no layer {layer!r} with {kind} statistics")
    return names.index(layer)


def checked_stat(stat: str, allowed) -> None:
    if stat not in allowed:
        raise NotFound(f"no statistic {stat!r}; one of {', '.join(allowed)}")


# --- /api/runs ----------------------------------------------------------------------------
def runs(served: list) -> list[dict]:
    """One object per run served: what it holds and its first non-finite event."""
    return [_run(run, size) for run, size in served]


def _run(run, size) -> dict:
    kinds = run.kinds
    held = [run.steps(k, rank=r) for r in run.ranks for k in run.kinds_of(r)]
    steps = np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64)
    first = run.first_nonfinite(history=0)
    event = None
    if first is not None:
        event = {k: v for k, v in first.to_json().items() if k not in ("history", "same_step")}
        event["same_step"] = len(first.same_step)
        if first.replay:            # as ``tensortape nan`` prints it: both lines
            event["replay_lines"] = replay_lines(first.replay)
    has_scalars = bool(len(scalars(run)["step"]))
    return {"path": run.path, "name": run.name, "status": run.status, "kinds": kinds,
            "layers": run.layers, "ranks": run.ranks,
            "steps": [int(steps[0]), int(steps[-1])] if len(steps) else None,
            "step_count": int(len(steps)),
            "size_bytes": size, "first_nonfinite": event,
            "events": sum(run.state(r).events_total for r in run.ranks),   # all, not the kept
            "scalars": has_scalars, "model_class": run.attrs.get("model_class"),
            "map_stats": list(MAP_STATS), "stats": [*fmt.STATS, "rms"]}


# --- the map --------------------------------------------------------------------------------
def checked_width(width) -> int:
    """``width``, checked: a number of columns, at least 1 (a bad one is the asker's: 400)."""
    if int(width) < 1:
        raise BadRequest(f"width={width} is not valid; use a number of columns, at least 1")
    return int(width)


def column_edges(n: int, width: int) -> np.ndarray:
    """Edges (``cols + 1`` row offsets) that split ``n`` rows into at most ``width``
    columns of consecutive rows, as even as can be."""
    cols = max(1, min(width, n))
    return (np.arange(cols + 1) * n) // cols


def window_of(steps: np.ndarray, start, stop) -> tuple[int, int]:
    i0 = 0 if start is None else int(np.searchsorted(steps, start, "left"))
    i1 = len(steps) if stop is None else int(np.searchsorted(steps, stop, "left"))
    return i0, max(i0, i1)


def grid_of(i0: int, i1: int, width: int, grains) -> tuple:
    """How a window of rows ``i0:i1`` is cut into at most ``width`` columns: (level,
    edges, g0, g1).  With ``grains`` (the server's cache), a window of at least
    ``width / 4`` grains of a pyramid level (``fmt.PYRAMID_GRAINS``: 64, else 8
    rows) has columns of whole grains of that level, ``g0:g1``, and the window's
    partial grains at either end; else (level None) columns of rows, as even as
    can be.  ``edges``: row offsets from ``i0``."""
    n = i1 - i0
    level = next((g for g in fmt.PYRAMID_GRAINS if i1 // g + i0 // -g >= max(1, width // 4)),
                 None) if grains is not None else None
    if not level:
        return None, column_edges(n, width), 0, 0
    g0, g1 = -(i0 // -level), i1 // level
    edges = np.concatenate([[0], column_edges(g1 - g0, width)[1:-1] * level + g0 * level - i0,
                            [n]]).astype(np.int64)
    return level, edges, g0, g1


def fill_columns(out: MapColumns, grid: tuple, grains, rows: np.ndarray, i0: int, i1: int) -> None:
    """``out``'s columns from the grains of ``grid`` (``grid_of``), the pyramid, the rows."""
    level, _, g0, g1 = grid
    if level == GRAIN:
        got = grains.get(out.run, out.kind, out.rank, rows, g1)[g0:g1, out.cols]
        out.fold(got[..., MAP_STATS.index(out.stat)], got[..., -1], np.arange(g0, g1) * GRAIN)
        out.fine(i0, g0 * GRAIN)                              # the partial grains
        out.fine(g1 * GRAIN, i1)
    elif level:
        out.fine(i0, i1)
    else:
        out.rows(i0, i1)


def map_(run, kind: str = "activations", stat: str = "abs_max", rank=None, start=None,
         stop=None, width: int = 1000, grains: "Grains | None" = None) -> dict:
    """The layer x step map of ``stat`` over steps [start, stop), in at most ``width``
    columns; rows in execution order.  ``grains``: a cache of each layer's maxima
    per ``GRAIN`` rows; with it, a window of at least ``width / 4`` grains of a
    pyramid level has columns of whole grains of that level (``grid_of``), read
    from the cache (64), the stored pyramid where it holds them, or the rows.
    Every column is the largest of its rows however it is read, bit for bit.
    Memory: a block of ``BLOCK`` rows read at a time, whatever the window."""
    checked_stat(stat, MAP_STATS)
    rank = checked_rank(run, rank)
    checked_kind(run, kind, rank)
    _, rows, steps = Statistics(run.index).rows(kind, rank)
    names = run.index.stats_layers(kind, rank)
    i0, i1 = window_of(steps, start, stop)
    n = i1 - i0
    grid = grid_of(i0, i1, checked_width(width), grains)
    edges = grid[1]
    out = MapColumns(run, kind, rank, rows, stat, i0, edges, len(names))
    fill_columns(out, grid, grains, rows, i0, i1)
    lo = steps[i0 + edges[:-1]] if n else np.zeros(0, np.int64)
    hi = steps[i0 + edges[1:] - 1] if n else np.zeros(0, np.int64)
    between = Between(run, kind, rank, start, stop)     # NaN/Inf at steps without statistics
    values, bad, lo, hi, names = between.fold(out.values, out.bad, lo, hi, names, stat,
                                              lambda k: column_edges(k, width))
    order = {n: i for i, n in enumerate(run.layers_of(rank))}
    cols = sorted(range(len(names)), key=lambda i: order.get(names[i], len(order) + i))
    return {"kind": kind, "stat": stat, "rank": rank, "layers": [names[i] for i in cols],
            "step_lo": ints(lo), "step_hi": ints(hi), "steps_in_window": int(n),
            "values": numbers(values.T[cols]), "nonfinite": bad.T[cols].tolist(),
            "steps": [int(steps[0]), int(steps[-1])] if len(steps) else None,
            "unplaced_events": int(between.unplaced)}


# --- scalars ------------------------------------------------------------------------------------
def scalars(run, rank=None) -> dict:
    """The run's logged scalars (``run.scalars()`` where this tensortape has it) of
    ``rank`` (default: the first): ``step``; ``values``, {name: one number per step},
    NaN (``"nan"``) where a name has no value at a step; ``nonfinite``, {name: the
    steps whose logged value is NaN or an Inf}; ``series``, {name: its logged points
    alone (``step``, ``value``)}; ``once``: the names logged at one step only (a
    trainer's ``train_runtime``: a number, not a line).  A name is only ever a key of
    ``values``, ``nonfinite`` and ``series``, so any name keeps its values."""
    rank = checked_rank(run, rank)
    read = getattr(run, "scalars", None)
    if read is None:
        return {"step": [], "values": {}, "nonfinite": {}, "series": {}, "once": []}
    ds = read(rank=rank) if len(run.ranks) > 1 else read()
    steps = ints(ds["step"].values) if "step" in ds.coords else []
    out = {"step": steps, "values": {str(name): numbers(ds[name].values) for name in ds.data_vars},
           "nonfinite": {}, "series": {}, "once": []}
    if steps:
        from .._scalars import logged
        points = logged(run.index, rank)
        out["nonfinite"] = {name: ints(s[~np.isfinite(v)]) for name, (s, v) in points.items()}
        out["series"] = {name: {"step": ints(s), "value": numbers(v)}
                         for name, (s, v) in points.items()}
        out["once"] = [name for name, (s, _) in points.items() if len(s) == 1]
    return out


# --- two runs ----------------------------------------------------------------------------------
def _compare_nonfinite(ds, names: list, metric: str, i0: int, i1: int) -> np.ndarray:
    """(step, layer) where the difference is not a finite number: infinite, NaN
    where the layer ran in either run, or either run holding a NaN or an Inf (NaN
    against NaN is no difference to ``stat_rel`` (0), yet it is no agreement)."""
    sel = lambda v: ds[v].sel(layer=layer_coord(names)).values[i0:i1]
    raw = sel(metric).astype(np.float64)
    if metric in TENSOR_METRICS:     # NaN: no full tensor in both runs there, not compared
        return np.isinf(raw) | (~np.isnan(raw) & sel("nonfinite"))
    ran = ~(sel("absent_a") & sel("absent_b")) & ~sel("unreadable")   # a missing chunk:
    # not compared, no difference
    return np.isinf(raw) | (ran & (np.isnan(raw) | sel("nonfinite")))


TENSOR_METRICS = ("rel_l2", "max_abs")       # of full tensors: only where both runs hold one
COMPARE_METRICS = ("stat_rel", *TENSOR_METRICS, *(f"delta_{s}" for s in fmt.STATS))


def compare_map(a, b, kind: str = "activations", metric: str = "stat_rel", rank=None,
                start=None, stop=None, width: int = 1000, rtol: float = 1e-3,
                layers=None, cache=None) -> dict:
    """The map of the two runs' difference under ``compare_runs``' ``metric`` (its
    absolute value; the largest of a column's steps), over their common steps and
    layers, and ``first_divergence`` of ``kind``.  ``cache``: a dict that keeps
    the comparison between calls (a run opened again, with more commits, is
    followed: ``Comparison.then``); with it, the first answer is the statistics'
    comparison, and ``pending`` says how many layers' full tensors are compared so
    far and which steps' the answer holds (``Comparison``), until the answer is
    whole (``pending`` None); a full tensors' metric has no value at the steps not
    compared yet (``"nan"``: no request waits for the comparison).  ``unlike``:
    what makes the runs unlike (the full tensors' shapes only once they are
    compared)."""
    from .._compare import compare_runs, divergence
    checked_stat(metric, COMPARE_METRICS)
    key = (kind, rank, rtol)
    pending = None
    made = None if cache is None else cache.get(key)
    if made is None or not made.over(a, b):
        for r in (a, b):
            if kind not in r.kinds:
                raise NotFound(f"no kind {kind!r} in {r.path}")
    if cache is None:
        ds = compare_runs(a, b, kind, rank=rank)
        first = divergence(ds, rtol)
    else:
        if made is None:
            cache[key] = Comparison(a, b, kind, rank, rtol)
        elif not made.over(a, b):          # a run changed (``Served`` opened it again)
            cache[key] = made.then(a, b)
        ds, first, pending = cache[key].answer()
    if metric in TENSOR_METRICS and pending is not None and metric not in ds:   # no value yet
        ds = ds.assign({metric: xr.full_like(ds["stat_rel"], np.nan).assign_attrs(
            covers="full tensors: being compared")})
    if metric not in ds:
        raise NotFound(f"no metric {metric!r}: the runs do not both hold full tensors")
    order = {n: i for i, n in enumerate(a.layers)}
    names = sorted(ds.layer.values.tolist(), key=lambda n: order.get(n, len(order)))
    if layers:
        names = match_layers(names, layers, strict=False)
    steps = ds.step.values
    i0, i1 = window_of(steps, start, stop)
    n = i1 - i0
    edges = column_edges(n, checked_width(width))
    raw = np.abs(ds[metric].sel(layer=layer_coord(names)).values[i0:i1].astype(np.float64))
    values = np.full((len(edges) - 1, len(names)), np.nan)
    bad = np.zeros(values.shape, bool)
    if n:
        _reduce(np.where(np.isinf(raw), np.nan, raw), 0, edges, values, np.fmax)
        _reduce(_compare_nonfinite(ds, names, metric, i0, i1), 0, edges, bad, np.logical_or)
        values = np.where(bad, np.inf, values)
    return {"kind": kind, "metric": metric, "layers": names, "rtol": rtol,
            "step_lo": ints(steps[i0 + edges[:-1]]) if n else [],
            "step_hi": ints(steps[i0 + edges[1:] - 1]) if n else [],
            "values": numbers(values.T), "nonfinite": bad.T.tolist(),
            "first_divergence": None if first is None else {"step": int(first[0]),
                                                             "layer": first[1]},
            "steps": [int(steps[0]), int(steps[-1])] if len(steps) else None,
            "covers": ds[metric].attrs.get("covers", ""), "unlike": ds.attrs.get("unlike", []),
            "pending": pending}
