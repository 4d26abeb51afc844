"""The map's columns, read from a stats table's rows or from grains of them: the
stored pyramid's levels (``RunIndex.pyramid``) where a reader may trust them,
``Grains`` (the server's cache of the coarse level), or grains computed from
the rows.  A grain is the fold of its rows in order, and lies in one column, so
a column is the largest of its rows, bit for bit, whichever way they come.
Memory: a block of ``BLOCK`` rows read at a time."""

from __future__ import annotations

import numpy as np

from tensortape.recorder import format as fmt, pyramid
from tensortape.recorder.errors import StoreFormatError

from .._tables import as_slice

__all__ = ["BLOCK", "GRAIN", "Grains", "MapColumns", "read", "reduce"]

MAP_STATS = fmt.MAP_STATS
BLOCK = 4096            # rows read at a time (a multiple of the stats shards' 1024 steps)
NONFINITE = fmt.COUNT_STATS[1:]          # nan, posinf, neginf
MAP_NEEDS = {"nonfinite": NONFINITE, "rms": ("count", "norm", *NONFINITE),
             **{s: (s, *NONFINITE) for s in ("abs_max", "std", "norm")}}
GRAIN_NEEDS = ("count", "abs_max", "std", "norm", *NONFINITE)
GRAIN = fmt.PYRAMID_GRAINS[0]    # rows a grain (``Grains``); BLOCK is a multiple of it


def reduce(block: np.ndarray, b0: int, edges: np.ndarray, out: np.ndarray, op) -> None:
    """Fold rows ``b0 : b0 + len(block)`` of a window into its columns (``out``)."""
    b1 = b0 + len(block)
    c0 = int(np.searchsorted(edges, b0, "right")) - 1
    c1 = int(np.searchsorted(edges, b1 - 1, "right")) - 1
    starts = np.maximum(edges[c0:c1 + 1], b0) - b0
    out[c0:c1 + 1] = op(out[c0:c1 + 1], op.reduceat(block, starts, axis=0))


def read(run, kind: str, rank: int, names: tuple, rows, cols) -> dict:
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
    return dask.compute(tables.stats(path, names, rows, cols), scheduler="threads")[0]


class MapColumns:
    """A map's columns (``edges``: row offsets from the window's first row ``i0``),
    each folded from the rows, or from the grains of rows, it holds: every grain
    lies in one column, and each is the fold of its rows in order, so a column is
    the same whichever way its rows come."""

    def __init__(self, run, kind: str, rank: int, rows: np.ndarray, stat: str, i0: int,
                 edges: np.ndarray, width: int, first: int = 0):
        """``width`` layers of the table, from its column ``first`` on."""
        self.run, self.kind, self.rank, self.ids, self.stat = run, kind, rank, rows, stat
        self.i0, self.edges = i0, edges
        self.cols = slice(first, first + width)
        ncol = len(edges) - 1 if edges[-1] else 0
        self.values = np.full((ncol, width), np.nan)
        self.bad = np.zeros((ncol, width), bool)

    def fold(self, values: np.ndarray, flags: np.ndarray, first: np.ndarray) -> None:
        """Grains' ``values`` and non-finite ``flags`` (grain x layer; a flag is set
        where ``> 0``) whose first rows are ``first``."""
        if not len(values):
            return
        col = np.searchsorted(self.edges, first - self.i0, "right") - 1
        at = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
        c = col[at]
        self.values[c] = np.fmax(self.values[c], np.fmax.reduceat(values, at, axis=0))
        self.bad[c] |= np.logical_or.reduceat(flags > 0, at, axis=0)

    def fine(self, a: int, b: int) -> None:
        """Rows ``a:b`` (of the rows read): the whole fine grains among them from the
        stored pyramid where it holds them, else from their rows; the rest as rows."""
        fine = fmt.PYRAMID_GRAINS[-1]
        f0, f1 = -(a // -fine), b // fine
        if f0 >= f1:
            return self.rows(a, b)
        self.rows(a, f0 * fine)
        path = fmt.stats_group(self.rank, self.kind)
        arr, held = self.run.index.pyramid(path, self.rank, fine, self.ids)
        s1 = min(f1, max(f0, held))
        if s1 > f0:
            try:
                got = [np.asarray(arr[f0:s1, self.cols, i], np.float64)
                       for i in (MAP_STATS.index(self.stat), len(MAP_STATS))]
            except StoreFormatError as e:          # a level that cannot be read: the rows
                self.run.index.distrust(path, self.rank, fine, e)
                s1 = f0
            else:
                self.fold(*got, np.arange(f0, s1) * fine)
        for r0 in range(s1 * fine, f1 * fine, BLOCK):
            r1 = min(f1 * fine, r0 + BLOCK)
            got = self.block(r0, r1)
            self.fold(pyramid.grain_maxima(pyramid.map_value(got, self.stat), fine),
                      pyramid.grain_maxima(pyramid.any_nonfinite(got), fine), np.arange(r0, r1, fine))
        self.rows(f1 * fine, b)

    def rows(self, a: int, b: int) -> None:
        """Rows ``a:b`` (of the rows read), read a block at a time."""
        for r0 in range(a, b, BLOCK):
            got = self.block(r0, min(b, r0 + BLOCK))
            reduce(pyramid.map_value(got, self.stat), r0 - self.i0, self.edges, self.values, np.fmax)
            reduce(pyramid.any_nonfinite(got), r0 - self.i0, self.edges, self.bad, np.logical_or)

    def block(self, r0: int, r1: int) -> dict:
        """The statistics the map's ``stat`` needs of rows ``r0:r1`` (of the rows read)."""
        return read(self.run, self.kind, self.rank, MAP_NEEDS[self.stat],
                    as_slice(self.ids[r0:r1]), self.cols)


class Grains:
    """Each layer's largest value of every map statistic, and whether any is
    non-finite, per grain of ``GRAIN`` consecutive rows of a stats table: what a
    map of many steps a column is made of (48 bytes a layer per grain), as a
    pyramid level stores it (grain, layer, ``fmt.PYRAMID_STATS``).  Seeded from
    the stored pyramid where a reader may trust it (``RunIndex.pyramid``), the
    rest computed from the rows.  Only whole grains are kept, so a live run's new
    rows add grains; rows that change (a step recorded again) start the table's
    grains anew."""

    def __init__(self):
        self.tables: dict = {}

    def forget(self, path: str) -> None:
        """Drop the grains of the run at ``path`` (another run is recorded there now)."""
        self.tables = {k: v for k, v in self.tables.items() if k[0] != path}

    def filled(self, run, kind: str, rank: int, rows: np.ndarray) -> int:
        """How many grains of (kind, rank) are kept for these rows."""
        have = self.tables.get((run.path, kind, rank))
        return len(have[1]) // GRAIN if have and np.array_equal(have[1], rows[:len(have[1])]) else 0

    def get(self, run, kind: str, rank: int, rows: np.ndarray, upto: int) -> np.ndarray:
        """The grains of (kind, rank), at least up to grain ``upto``, read where not yet."""
        key = (run.path, kind, rank)
        have = self.tables.get(key)
        width = len(run.index.stats_layers(kind, rank))
        if have is None or have[0].shape[1] != width \
                or not np.array_equal(have[1], rows[:len(have[1])]):
            have = (np.zeros((0, width, len(fmt.PYRAMID_STATS))), rows[:0].copy())
        kept, done = have
        g = len(done) // GRAIN
        if g < upto:
            path = fmt.stats_group(rank, kind)
            arr, held = run.index.pyramid(path, rank, GRAIN, rows)
            add = []
            if held > g:
                try:
                    add = [np.asarray(arr[g:held, :width], np.float64)]
                except StoreFormatError as e:      # a level that cannot be read: the rows
                    run.index.distrust(path, rank, GRAIN, e)
                    held = g
            g = max(g, held)
            for r0 in range(g * GRAIN, upto * GRAIN, BLOCK):
                got = read(run, kind, rank, GRAIN_NEEDS,
                           as_slice(rows[r0:min(upto * GRAIN, r0 + BLOCK)]), slice(0, width))
                both = [*(pyramid.map_value(got, s) for s in MAP_STATS), pyramid.any_nonfinite(got)]
                add.append(pyramid.grain_maxima(np.stack(both, axis=-1), GRAIN))
            kept = add[0] if not len(kept) and len(add) == 1 else np.concatenate([kept, *add])
            done = rows[:len(kept) * GRAIN].copy()
        self.tables[key] = (kept, done)
        return kept
