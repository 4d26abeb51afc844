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

import fnmatch

import numpy as np

from recorder import format as fmt
from recorder.histogram import ZERO_BIN
from recorder.errors import RecorderError

from ._numbers import number
from ._stats import Statistics
from ._tables import as_slice

__all__ = ["GRAIN", "Grains", "MAP_STATS", "NotFound", "compare_map", "histogram", "map_", "runs", "scalars",
           "stats"]

MAP_STATS = ("abs_max", "std", "norm", "rms", "nonfinite")
BLOCK = 4096            # rows read at a time (a multiple of the stats shards' 1024 steps)
NONFINITE = fmt.COUNT_STATS[1:]          # nan, posinf, neginf
MAP_NEEDS = {"nonfinite": NONFINITE, "rms": ("count", "norm", *NONFINITE),
             **{s: (s, *NONFINITE) for s in ("abs_max", "std", "norm")}}
GRAIN_NEEDS = ("count", "abs_max", "std", "norm", *NONFINITE)
GRAIN = 64              # rows a grain (``Grains``); BLOCK is a multiple of it


class NotFound(RecorderError):
    """An unknown run, layer, kind, rank, step or statistic (HTTP 404)."""


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
def _rank(run, rank) -> int:
    if rank is None:
        return run.ranks[0] if run.ranks else 0
    if rank not in run.ranks:
        raise NotFound(f"no rank {rank}; the run has ranks {run.ranks}")
    return rank


def _kind(run, kind: str, rank: int) -> None:
    if kind not in run.kinds_of(rank):
        raise NotFound(f"no kind {kind!r} on rank {rank}; the run has {run.kinds_of(rank)}")


def _layer(run, layer: str, kind: str, rank: int) -> int:
    names = run.index.stats_layers(kind, rank)
    if layer not in names:
        raise NotFound(f"no layer {layer!r} with {kind} statistics")
    return names.index(layer)


def _stat(stat: str, allowed) -> None:
    if stat not in allowed:
        raise NotFound(f"no statistic {stat!r}; one of {', '.join(allowed)}")


# --- /api/runs ----------------------------------------------------------------------------
def runs(served: list) -> list[dict]:
    """One object per run served: what it holds and its first non-finite event."""
    return [_run(run, size) for run, size in served]


def _run(run, size) -> dict:
    kinds = run.kinds
    rank = _rank(run, None)
    steps = [run.steps(k, rank=rank) for k in run.kinds_of(rank)]
    steps = [s for s in steps if len(s)]
    first = run.first_nonfinite(history=0)
    event = None
    if first is not None:
        event = {k: v for k, v in first.to_json().items() if k not in ("history", "same_step")}
        event["same_step"] = len(first.same_step)
    has_scalars = bool(len(scalars(run)["step"]))
    return {"path": run.path, "name": run.name, "status": run.status, "kinds": kinds,
            "layers": run.layers, "ranks": run.ranks,
            "steps": [int(min(s[0] for s in steps)), int(max(s[-1] for s in steps))] if steps else None,
            "step_count": int(max(len(s) for s in steps)) if steps else 0,
            "size_bytes": size, "first_nonfinite": event, "events": len(run.events),
            "scalars": has_scalars, "model_class": run.attrs.get("model_class"),
            "map_stats": list(MAP_STATS), "stats": [*fmt.STATS, "rms"]}


# --- the map --------------------------------------------------------------------------------
def _columns(n: int, width: int) -> np.ndarray:
    """Edges (``cols + 1`` row offsets) that split ``n`` rows into at most ``width``
    columns of consecutive rows, as even as can be."""
    cols = max(1, min(width, n))
    return (np.arange(cols + 1) * n) // cols


def _window(steps: np.ndarray, start, stop) -> tuple[int, int]:
    i0 = 0 if start is None else int(np.searchsorted(steps, start, "left"))
    i1 = len(steps) if stop is None else int(np.searchsorted(steps, stop, "left"))
    return i0, max(i0, i1)


def _reduce(block: np.ndarray, b0: int, edges: np.ndarray, out: np.ndarray, op) -> None:
    """Fold rows ``b0 : b0 + len(block)`` of a window into its columns (``out``)."""
    b1 = b0 + len(block)
    c0 = int(np.searchsorted(edges, b0, "right")) - 1
    c1 = int(np.searchsorted(edges, b1 - 1, "right")) - 1
    starts = np.maximum(edges[c0:c1 + 1], b0) - b0
    out[c0:c1 + 1] = op(out[c0:c1 + 1], op.reduceat(block, starts, axis=0))


def _read(run, kind: str, rank: int, names: tuple, rows, cols) -> dict:
    """Statistics ``names`` at ``rows`` (a slice where they are consecutive) and layer
    columns ``cols``; only the chunks they touch are read.  A format-3 table read at
    a slice of rows is sliced directly (no task graph); anything else through dask."""
    path = fmt.stats_group(rank, kind)
    tables = run.index.tables
    if isinstance(rows, slice) and tables.version == 3:
        run.index.checked_rows(path, rank)
        arr = tables.source.array(f"{path}/stats")
        return {s: np.asarray(arr[rows, cols, fmt.STATS.index(s)], np.float64) for s in names}
    import dask
    lazy = [tables.stat(path, s, rows, cols) for s in names]
    return dict(zip(names, dask.compute(*lazy, scheduler="threads")))


def _map_values(got: dict, stat: str) -> np.ndarray:
    """One block's values of ``stat`` (rows x layers): NaN where the layer did not run."""
    bad = sum(np.nan_to_num(got[k], nan=0.0) for k in NONFINITE)
    if stat == "nonfinite":
        return np.where(np.isnan(got["nan"]), np.nan, bad)
    if stat == "rms":
        finite = got["count"] - bad
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(finite > 0, got["norm"] / np.sqrt(finite), np.nan)
    return got[stat]


def map_(run, kind: str = "activations", stat: str = "abs_max", rank=None, start=None,
         stop=None, width: int = 1000, grains: "Grains | None" = None) -> dict:
    """The layer x step map of ``stat`` over steps [start, stop), in at most ``width``
    columns; rows in execution order.  ``grains``: a cache of each layer's maxima
    per ``GRAIN`` rows, used when a column spans whole grains (its columns then
    hold whole grains, and the window's partial grains at either end).  Memory: a
    block of ``BLOCK`` rows read at a time, whatever the window."""
    _stat(stat, MAP_STATS)
    rank = _rank(run, rank)
    _kind(run, kind, rank)
    _, rows, steps = Statistics(run.index).rows(kind, rank)
    names = run.index.stats_layers(kind, rank)
    order = {n: i for i, n in enumerate(run.layers_of(rank))}
    cols = sorted(range(len(names)), key=lambda i: order.get(names[i], len(order) + i))
    i0, i1 = _window(steps, start, stop)
    n, width = i1 - i0, max(1, int(width))
    g0, g1 = -(-i0 // GRAIN), i1 // GRAIN
    # a window of many grains a column is made of whole grains: at most ``width`` columns
    # and at least one grain each (fewer columns than ``width`` below width x GRAIN steps)
    coarse = grains is not None and g1 - g0 >= max(1, width // 4)
    if coarse:
        edges = np.concatenate([[0], _columns(g1 - g0, width)[1:-1] * GRAIN + g0 * GRAIN - i0, [n]])
        edges = edges.astype(np.int64)
    else:
        edges = _columns(n, width)
    ncol = len(edges) - 1 if n else 0
    values = np.full((ncol, len(names)), np.nan)
    bad = np.zeros((ncol, len(names)), bool)
    need = MAP_NEEDS[stat]
    spans = [(0, n)]
    if coarse:
        gv, gb = grains.get(run, kind, rank, rows, g1)
        first = edges[:-1] + i0
        at = np.maximum(-(-first // GRAIN), g0) - g0
        values[:] = np.fmax.reduceat(gv[stat][g0:g1], at, axis=0)
        bad[:] = np.logical_or.reduceat(gb[g0:g1], at, axis=0)
        spans = [(0, g0 * GRAIN - i0), (g1 * GRAIN - i0, n)]          # the partial grains
    for a, b in spans:
        for b0 in range(a, b, BLOCK):
            got = _read(run, kind, rank, need, as_slice(rows[i0 + b0: i0 + min(b, b0 + BLOCK)]),
                        slice(None))
            _reduce(_map_values(got, stat), b0, edges, values, np.fmax)
            _reduce(_nonfinite(got), b0, edges, bad, np.logical_or)
    lo = steps[i0 + edges[:-1]] if n else np.zeros(0, np.int64)
    hi = steps[i0 + edges[1:] - 1] if n else np.zeros(0, np.int64)
    return {"kind": kind, "stat": stat, "rank": rank, "layers": [names[i] for i in cols],
            "step_lo": ints(lo), "step_hi": ints(hi), "steps_in_window": int(n),
            "values": numbers(values.T[cols]), "nonfinite": bad.T[cols].tolist(),
            "steps": [int(steps[0]), int(steps[-1])] if len(steps) else None}


def _nonfinite(got: dict) -> np.ndarray:
    return sum(np.nan_to_num(got[k], nan=0.0) for k in NONFINITE) > 0


class Grains:
    """Each layer's largest value of every map statistic, and whether any is
    non-finite, per grain of ``GRAIN`` consecutive rows of a stats table: what a
    map of many steps a column is made of (about 50 bytes a layer per grain).
    Only whole grains are kept, so a live run's new rows add grains; rows that
    change (a step recorded again) start the table's grains anew."""

    def __init__(self):
        self.tables: dict = {}

    def filled(self, run, kind: str, rank: int, rows: np.ndarray) -> int:
        """How many grains of (kind, rank) are kept for these rows."""
        have = self.tables.get((run.path, kind, rank))
        return len(have[2]) // GRAIN if have and np.array_equal(have[2], rows[:len(have[2])]) else 0

    def get(self, run, kind: str, rank: int, rows: np.ndarray, upto: int):
        """The grains of (kind, rank) up to grain ``upto``, read where not yet."""
        key = (run.path, kind, rank)
        have = self.tables.get(key)
        if have is None or not np.array_equal(have[2], rows[:len(have[2])]):
            have = ({s: np.zeros((0, len(run.index.stats_layers(kind, rank)))) for s in MAP_STATS},
                    np.zeros((0, len(run.index.stats_layers(kind, rank))), bool), rows[:0].copy())
        values, bad, done = have
        g = len(done) // GRAIN
        if g < upto:
            add_v, add_b = {s: [] for s in MAP_STATS}, []
            for r0 in range(g * GRAIN, upto * GRAIN, BLOCK):
                r1 = min(upto * GRAIN, r0 + BLOCK)
                got = _read(run, kind, rank, GRAIN_NEEDS, as_slice(rows[r0:r1]), slice(None))
                k = (r1 - r0) // GRAIN
                for s in MAP_STATS:
                    v = _map_values(got, s).reshape(k, GRAIN, -1)
                    add_v[s].append(np.fmax.reduce(v, axis=1))
                add_b.append(_nonfinite(got).reshape(k, GRAIN, -1).any(axis=1))
            values = {s: np.concatenate([values[s], *add_v[s]]) for s in MAP_STATS}
            bad = np.concatenate([bad, *add_b])
            done = rows[:upto * GRAIN].copy()
        self.tables[key] = (values, bad, done)
        return values, bad


# --- one layer: its histogram and its statistics --------------------------------------------
def histogram(run, layer: str, kind: str = "activations", step=None, rank=None) -> dict:
    """The layer's counts at ``step`` over the bins that hold any (the bins outside
    ``[first_bin, first_bin + len(counts))`` hold none), with its NaN/Inf counts."""
    rank = _rank(run, rank)
    _kind(run, kind, rank)
    _layer(run, layer, kind, rank)
    if step is None:
        raise NotFound("no step asked (step=N)")
    if int(step) not in set(run.steps(kind, rank=rank).tolist()):
        raise NotFound(f"step {step} has no {kind} statistics")
    h = run.histogram(layer, kind, step=int(step), rank=rank).compute()
    counts = np.asarray(h.values, np.int64)
    held = np.nonzero(counts > 0)[0]
    a, b = (int(held[0]), int(held[-1]) + 1) if len(held) else (ZERO_BIN, ZERO_BIN)
    return {"layer": layer, "kind": kind, "step": int(step), "rank": rank,
            "absent": bool((counts < 0).all()), "first_bin": a, "bins": int(len(counts)),
            "bin_lo": numbers(h.bin_lo.values[a:b]), "bin_hi": numbers(h.bin_hi.values[a:b]),
            "counts": ints(np.maximum(counts[a:b], 0)),
            **{k: int(h[k].item()) for k in NONFINITE}}


def stats(run, layer: str, kind: str = "activations", rank=None, start=None, stop=None,
          width=None) -> dict:
    """Every statistic of the layer (and ``rms``) at each step of [start, stop).  With
    ``width``, at most that many columns, each the largest of its steps'
    (``step`` is each column's first step, ``step_hi`` its last)."""
    rank = _rank(run, rank)
    _kind(run, kind, rank)
    col = _layer(run, layer, kind, rank)
    _, rows, steps = Statistics(run.index).rows(kind, rank)
    i0, i1 = _window(steps, start, stop)
    n = i1 - i0
    edges = _columns(n, int(width) if width else max(n, 1))
    out = {s: np.full(len(edges) - 1, np.nan) for s in (*fmt.STATS, "rms")}
    for b0 in range(0, n, BLOCK):
        got = _read(run, kind, rank, fmt.STATS, as_slice(rows[i0 + b0: i0 + min(n, b0 + BLOCK)]),
                    col)
        got["rms"] = _map_values(got, "rms")
        for s, v in got.items():
            _reduce(np.asarray(v, np.float64), b0, edges, out[s], np.fmax)
    body = {s: (ints(np.nan_to_num(v, nan=-1)) if s in fmt.COUNT_STATS else numbers(v))
            for s, v in out.items()} if n else {s: [] for s in out}
    lo = steps[i0 + edges[:-1]] if n else []
    hi = steps[i0 + edges[1:] - 1] if n else []
    return {"layer": layer, "kind": kind, "rank": rank, "step": ints(lo), "step_hi": ints(hi),
            **body}


# --- scalars ------------------------------------------------------------------------------------
def scalars(run, rank=None) -> dict:
    """The run's logged scalars (``run.scalars()`` where this tensortape has it) of
    ``rank`` (default: the first): ``step`` and one list per scalar, NaN (``"nan"``)
    where a name has no value at a step; none: ``{"step": []}``."""
    read = getattr(run, "scalars", None)
    if read is None:
        return {"step": []}
    ds = read(rank=_rank(run, rank)) if len(run.ranks) > 1 else read()
    out = {"step": ints(ds["step"].values) if "step" in ds.coords else []}
    for name in ds.data_vars:
        out[str(name)] = numbers(ds[name].values)
    if out["step"]:
        out["nonfinite"] = _scalars_nonfinite(run, _rank(run, rank))
    return out


def _scalars_nonfinite(run, rank: int) -> dict:
    """{name: the steps where the value logged is NaN or +-Inf}: a NaN logged, not a
    step where the name has no value (``scalars`` shows both as NaN)."""
    from ._scalars import logged
    return {name: ints(steps[~np.isfinite(values)])
            for name, (steps, values) in logged(run.index, rank).items()}


# --- two runs ----------------------------------------------------------------------------------
def _compare_nonfinite(ds, names: list, metric: str, i0: int, i1: int) -> np.ndarray:
    """(step, layer) where the difference is not a finite number: infinite, NaN
    where the layer ran in either run, or either run holding a NaN or an Inf (NaN
    against NaN is no difference to ``stat_rel`` (0), yet it is no agreement)."""
    sel = lambda v: ds[v].sel(layer=names).values[i0:i1]
    raw = sel(metric).astype(np.float64)
    ran = ~(sel("absent_a") & sel("absent_b"))
    return np.isinf(raw) | (ran & (np.isnan(raw) | sel("nonfinite")))


COMPARE_METRICS = ("stat_rel", "rel_l2", "max_abs", *(f"delta_{s}" for s in fmt.STATS))


def compare_map(a, b, kind: str = "activations", metric: str = "stat_rel", rank=None,
                start=None, stop=None, width: int = 1000, rtol: float = 1e-3,
                layers=None, cache=None) -> dict:
    """The map of the two runs' difference under ``compare_runs``' ``metric`` (its
    absolute value; the largest of a column's steps), over their common steps and
    layers, and ``first_divergence`` of ``kind``.  ``cache``: a dict that keeps
    the comparison between calls (the caller clears it when a run changes)."""
    from ._compare import compare_runs, first_divergence
    _stat(metric, COMPARE_METRICS)
    key = (kind, rank, rtol)
    if cache is not None and key in cache:
        ds, first = cache[key]
    else:
        for r in (a, b):
            if kind not in r.kinds:
                raise NotFound(f"no kind {kind!r} in {r.path}")
        ds = compare_runs(a, b, kind, rank=rank)
        first = first_divergence(a, b, rtol=rtol, kinds=[kind], rank=rank)
        if cache is not None:
            cache[key] = (ds, first)
    if metric not in ds:
        raise NotFound(f"no metric {metric!r}: the runs do not both hold full tensors")
    order = {n: i for i, n in enumerate(a.layers)}
    names = sorted(ds.layer.values.tolist(), key=lambda n: order.get(n, len(order)))
    if layers:
        names = [n for n in names if fnmatch.fnmatchcase(n, layers)]
    steps = ds.step.values
    i0, i1 = _window(steps, start, stop)
    n = i1 - i0
    edges = _columns(n, max(1, int(width)))
    raw = np.abs(ds[metric].sel(layer=names).values[i0:i1].astype(np.float64))
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
            "covers": ds[metric].attrs.get("covers", "")}
