"""One rank's part of a run on disk: its tables, its bundles, and the commit.

``RunStore`` opens a rank's tables (``_table.Table``, made by ``_layout`` on
their first row, or reopened at their committed rows), appends the rows the
writer hands it, writes replay bundles whole, and commits: a reader trusts only
the committed row counts that ``commit`` writes into the rank group's
attributes *after* every write they count has finished (``flush``).  What those
attributes say (the rank's state) is ``_ranklog.RankLog``'s: the store writes
them as given.

The rooms of the store: ``_root`` (what is at a location, opening the root),
``_pool`` (the write threads, one write in flight per array), ``_table``
(columns and rows), ``_layout`` (how arrays are made).  ``RunStore`` is the one
writer of a rank's tables: the recorder appends through ``append_stats`` and
``append_tensor``, and ``recorder.migrate`` opens a table of the layout it
copies (``stats_table``, ``tensor_table``) and appends its rows.

Threads: made on the training thread at attach (which reads the rank's
attributes and may ``commit`` the first state), then used by the writer thread alone; its
``WritePool``'s threads write the chunks.  **Who stops them**: ``close`` (the
writer at its close; the Recorder when attach fails after making the store;
the migration when its copy ends), else a finaliser when a store
forgotten without ``close`` is garbage collected.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype

from .. import format as fmt
from ._layout import (STATS_CHUNK_ROWS, existing_columns, fill_for, new_array, nonfinite_columns,
                      pyramid_columns, stats_columns, step_column, tensor_columns, to_numpy,
                      zstd_level)
from ._pool import WritePool, write_threads
from ._table import Pyramid, Rows, StatsTable, Table
from ..histogram import NBINS

__all__ = ["Compression", "RunStore"]

# a resumed pyramid's partial grains are folded again from the stats column's last chunk
# (``_pyramid``), which must then begin on a grain of every level
assert STATS_CHUNK_ROWS % math.lcm(*fmt.PYRAMID_GRAINS) == 0

Compression = Literal["auto"] | int | None    # "auto": ``zstd_level`` per table; a level; none


class RunStore:
    """One rank's part of a store: its tables and its committed state."""

    def __init__(self, root: zarr.Group, rank: int, compression: Compression = "auto"):
        self.root = root
        self.rank = rank
        self.compression = compression     # of full tensors: "auto", a zstd level, or None
        self.rank_group = root.require_group(fmt.rank_group(rank))
        self.pyramids: dict[str, int] = {}   # stats table -> the rows its stored pyramid
                                             # covers, as last committed (``_pyramid``)
        self.tables: dict[str, Table] = {}
        self.pool = WritePool(write_threads())
        # a store forgotten without ``close`` ends its threads when it is collected
        # (not at exit: the writer's own close decides what is written then)
        self._finalizer = weakref.finalize(self, self.pool.shutdown, False)
        self._finalizer.atexit = False

    def attributes(self) -> dict:
        """The rank group's attributes as stored (its committed state; empty for a new
        rank)."""
        return dict(self.rank_group.attrs)

    # --- tables --------------------------------------------------------------
    def stats_table(self, path: str, width: int, committed: int = 0,
                    recording: int = 0) -> Table:
        """The open statistics table at ``path`` (``format.stats_group``): the
        store's arrays when it has ``committed`` rows, else new ones ``width``
        layers wide, with its pyramid (``_pyramid``).  ``recording``: as ``_open``."""
        table = self.tables.get(path)
        if table is None:
            table = self._open(path, committed, recording,
                               lambda g: stats_columns(g, fmt.parse_path(path).kind, width),
                               StatsTable)
            table.pyramid = self._pyramid(table, path, width, committed)
        return table

    def _pyramid(self, table: StatsTable, path: str, width: int, committed: int) -> Pyramid | None:
        """A new table's new pyramid; a stored table's stored one, when its rank state
        says it covers every committed row (its partial grains folded again from
        the table's last rows), else none (a table made before pyramids)."""
        g = table.group
        if not committed:
            return Pyramid(g, pyramid_columns(g, width), 0, self.pool)
        names = {grain: fmt.pyramid_level(grain) for grain in fmt.PYRAMID_GRAINS}
        if self.pyramids.get(path, 0) < committed or not all(
                n in g and g[n].shape[0] >= committed // grain for grain, n in names.items()):
            return None
        col = table.columns["stats"]          # its buffer holds the rows of its last chunk
        start = committed - committed % math.lcm(*fmt.PYRAMID_GRAINS)
        tail = col.buf[start - col.start: committed - col.start].copy()
        levels = {grain: g[n].with_config({"write_empty_chunks": True}) for grain, n in names.items()}
        return Pyramid(g, levels, committed, self.pool, tail)

    def tensor_table(self, path: str, layer: str, sample: np.ndarray, logical: str | None,
                     committed: int = 0, recording: int = 0) -> Table:
        """The open full-tensor table of ``layer`` at ``path`` (``format.tensor_group``):
        the store's arrays when it has ``committed`` rows, else new ones shaped, typed
        and compressed after ``sample``, its first row (numpy; ``logical``: the dtype
        of bits, as ``_layout.to_numpy`` gives).  ``recording``: as ``_open``."""
        return self._open(path, committed, recording, lambda g: tensor_columns(
            g, fmt.parse_path(path).kind, layer, sample, logical, self._level(sample)))

    def scalars_table(self, committed: int = 0, recording: int = 0) -> Table:
        """The open table of the rank's logged scalars (``format.scalars_table``).
        ``recording``: as ``_open``."""
        from ..step._scalars import columns
        return self._open(fmt.scalars_table(self.rank), committed, recording, columns)

    def _open(self, path: str, committed: int, recording: int,
              create: Callable[[zarr.Group], dict[str, zarr.Array]], cls=Table) -> Table:
        """The open table at ``path``: the store's arrays when it has committed
        rows, else new ones made by ``create(group)``.  A recording after the first
        (``recording`` > 0, a resumed job) gives the table its ``recording`` column,
        whose committed rows so far are recording 0's (``fmt.RECORDING``)."""
        table = self.tables.get(path)
        if table is None:
            if committed:
                g = self.root[path]
                cols = existing_columns(g, list(fmt.parse_path(path).columns), committed,
                                        recording)
            else:
                g = self.root.require_group(path)
                stale = fmt.RECORDING in g                # of rows never committed
                cols = create(g)
                if recording or stale:
                    cols[fmt.RECORDING] = step_column(g, fmt.RECORDING)
            table = self.tables[path] = cls(g, cols, committed, self.pool)
        return table

    # --- rows -------------------------------------------------------------------
    def append_stats(self, kind: str, step: int, names: list[str], layers: list[str],
                     stats: dict[str, np.ndarray], hist: np.ndarray, committed: int,
                     recording: int = 0) -> None:
        """One step's statistics of ``layers`` as a row of the kind's table, whose
        layer axis is ``names`` (the run's rows so far); absent layers are NaN.
        ``recording``: the rank's recording that records it (``fmt.RECORDING``)."""
        n = len(names)
        table = self.stats_table(fmt.stats_group(self.rank, kind), n, committed, recording)
        k = len(layers)
        if names[:k] == layers:                  # the table's first layers, in order
            rows = slice(0, k)
        else:
            index = {name: i for i, name in enumerate(names)}
            rows = np.array([index[layer] for layer in layers], dtype=np.int64)
        row = np.full((n, len(fmt.STATS)), np.nan)
        row[rows] = np.stack([np.asarray(stats[s], np.float64) for s in fmt.STATS], axis=1)
        table.columns["stats"].grow_inner((n, len(fmt.STATS)))
        table.columns["hist"].grow_inner((n, NBINS))
        table.append(_tagged({"step": np.int64(step), "stats": row, "hist": Rows(rows, hist)},
                             table, recording))

    def append_nonfinite(self, kind: str, step: int, layers: list[str], counts: dict,
                         committed: int, recording: int = 0) -> None:
        """The NaN/Inf counts of ``kind`` at a step without statistics as a row of its
        ``nonfinite`` table, whose layer axis is ``layers`` (the rank's, by position):
        ``counts`` maps a layer to its (nan, posinf, neginf); the others are 0."""
        n = len(layers)
        table = self._open(fmt.nonfinite_table(self.rank, kind), committed, recording,
                           lambda g: nonfinite_columns(g, kind, n))
        index = {name: i for i, name in enumerate(layers)}
        row = np.zeros((n, len(fmt.COUNT_STATS) - 1), np.int64)
        for layer, c in counts.items():
            row[index[layer]] = c
        table.columns["counts"].grow_inner(row.shape)
        table.append(_tagged({"step": np.int64(step), "counts": row}, table, recording))

    def append_tensor(self, kind: str, layer: str, step: int, micro: int, t,
                      committed: int, recording: int = 0) -> int | None:
        """One step's full tensor (a host torch tensor) as a row of its table; the
        bytes written, or None when its rank or dtype differs from the table's."""
        arr, logical = to_numpy(t)
        table = self.tensor_table(fmt.tensor_group(self.rank, kind, layer), layer, arr, logical,
                                  committed, recording)
        data = table.columns["data"].array
        if data.ndim - 1 != arr.ndim or data.dtype != arr.dtype:
            return None
        extent = np.array(arr.shape if arr.ndim else (1,), dtype=np.int64)
        table.append(_tagged({"data": arr, "step": np.int64(step), "micro": np.int64(micro),
                              "extent": extent}, table, recording))
        return arr.nbytes

    def append_scalars(self, step: int, ids: np.ndarray, values: np.ndarray, committed: int,
                       recording: int = 0) -> None:
        """One step's logged scalars (``rec.log``), a row each: the name's index in the
        rank state's ``scalar_names``, and its value."""
        table = self.scalars_table(committed, recording)
        for i, v in zip(ids, values):
            table.append(_tagged({"step": np.int64(step), "name": np.int64(i),
                                  "value": np.float64(v)}, table, recording))

    def write_bundle(self, path: str, attrs: dict, arrays: dict) -> None:
        """A replay bundle (``format.replay_group``): each host tensor an array (its
        node name encoded, bfloat16 and float8 as bits with ``logical_dtype``), the
        JSON in the group's attributes.  Written whole; the event that names it is
        committed after.  A bundle of an older recording at the same step (a job
        resumed from before it) is replaced whole, none of its arrays or keys kept."""
        g = self.root.create_group(path, overwrite=True)
        for name, t in arrays.items():
            arr, logical = to_numpy(t)
            a = new_array(g, fmt.node_name(name), arr.shape, arr.shape or (), arr.dtype,
                          fill_for(arr.dtype), [f"dim_{i}" for i in range(arr.ndim)],
                          {fmt.LOGICAL_ATTR: logical} if logical else None)
            a[...] = arr
        g.update_attributes(fmt.to_json(attrs))

    def _level(self, sample: np.ndarray) -> int | None:
        """The zstd level of a new full-tensor table whose first row is ``sample``."""
        return zstd_level(sample) if self.compression == "auto" else self.compression

    # --- commit ---------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """End the write threads (``wait=False``: without waiting for a store that
        does not answer)."""
        self._finalizer.detach()
        self.pool.shutdown(wait=wait)

    def flush(self) -> dict[str, int]:
        """Write every buffered chunk and wait for every write; return the row
        counts now safe to commit (the data is on the store before them), but
        the ``nonfinite`` tables' (``commit`` writes those)."""
        for t in self.tables.values():
            t.flush()
        return {path: t.rows for path, t in self.tables.items() if not _nonfinite(path)}

    def covered(self) -> tuple[dict[str, int], dict[str, int | None]]:
        """What the open tables hold besides ``flush``'s counts: each ``nonfinite``
        table's rows, and the rows each stats table's pyramid covers (None: a table
        without one)."""
        nonfinite = {p: t.rows for p, t in self.tables.items() if _nonfinite(p)}
        pyramids = {p: t.pyramid.rows if t.pyramid is not None else None
                    for p, t in self.tables.items() if isinstance(t, StatsTable)}
        return nonfinite, pyramids

    def commit(self, rank_attrs: dict[str, Any] | None, root_attrs: dict[str, Any] | None,
               put: Callable[[str, bytes], bool] | None = None) -> bool:
        """Advance the commit counters after the data: the rank's attributes (its
        state) in one write of its ``zarr.json``, then (rank 0) the root's in one
        write; both JSON as given (None: not written).  ``put(path, doc)`` writes
        a group's ``zarr.json`` instead of zarr (``claim._fenced``); once it writes
        nothing (False), nothing after it is written, and False is returned."""
        for group, attrs in ((self.rank_group, rank_attrs), (self.root, root_attrs)):
            if attrs is None:
                continue
            if put is None:
                group.update_attributes(attrs)
                continue
            group.metadata.attributes.update(attrs)        # as zarr's update_attributes
            doc = group.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"]
            if not put(group.path, doc.to_bytes()):
                return False
        return True

    def trim(self) -> None:
        """Cut every table to its rows (at close, after the last flush)."""
        for t in self.tables.values():
            t.trim()
        for t in self.tables.values():
            t.drain()

    def reset(self, pyramids: dict[str, int]) -> None:
        """Forget every open table (after a failed write): each is opened again at
        its committed rows (its pyramid's at ``pyramids``), overwriting whatever was
        written past them."""
        self.pyramids = dict(pyramids)
        for t in self.tables.values():
            t.settle()
        self.tables = {}


def _nonfinite(path: str) -> bool:
    return fmt.parse_path(path).section == "nonfinite"


def _tagged(values: dict[str, np.ndarray], table: Table, recording: int) -> dict:
    """A row's values, with its recording where its table has that column."""
    if fmt.RECORDING in table.columns:
        values[fmt.RECORDING] = np.int64(recording)
    return values


