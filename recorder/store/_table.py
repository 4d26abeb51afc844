"""Tables: columns that share the ``step`` dimension, appended one row at a time.

A *table* is one zarr group whose arrays (columns) share a leading ``step``
dimension: the statistics of one kind, or the full tensors of one (kind,
layer).  Rows are buffered per column until a chunk is whole, and a chunk is
written whole through the column's ``_pool.Lane`` (a partial one is padded
with the fill value and written at a flush, then written again when it
fills).  Capacity grows in blocks of whole chunks of every column; ``trim``
cuts each column to its rows at close.

A whole chunk is encoded by ``_shards.Chunks`` (an unsharded column: one store
write from the column's buffer) or ``_shards.Shards`` (a sharded column's whole
inner chunks), as zarr would write it, without zarr's codec pipeline; zarr
writes the rest.

A statistics table (``StatsTable``) also keeps its ``Pyramid``: the maxima of
each grain of its rows, at each level of ``format.PYRAMID_GRAINS``.

Runs on the writer thread; the pool's threads only read a block once it is
submitted (a new buffer takes its place).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import zarr

from .. import format as fmt, pyramid
from ._pool import Lane, WritePool
from ._shards import Chunks, Shards

__all__ = ["Column", "Pyramid", "Rows", "StatsTable", "Table"]


class Rows(NamedTuple):
    """A row given by some of its entries along its first axis (a statistics row's
    layers): ``values[i]`` at ``index[i]``, the rest the fill value.  Put straight
    into the column's buffer, converted there (a histogram's float64 counts become
    int64): no dense row is made first."""
    index: "np.ndarray | slice"
    values: np.ndarray


class Column:
    """One array of a table and the buffer of its current chunk.

    Each whole chunk goes to the array's ``Lane`` (a new buffer takes its place
    when a pool writes it); ``drain`` waits for this column's writes, as every
    resize and every commit must."""

    def __init__(self, array: zarr.Array, rows: int, pool: WritePool):
        self.array = array
        self.shards = Shards.of(array)
        self.chunks = Chunks.of(array) if self.shards is None else None
        self.lane = Lane(pool)
        self.chunk_rows = array.chunks[0]
        self.fill = array.fill_value
        self.start = rows - rows % self.chunk_rows
        self.buf = self._new(array.shape[1:])
        if rows > self.start:
            self.buf[: rows - self.start] = array[self.start: rows]
        self.dirty = False

    def grow_inner(self, shape: tuple[int, ...]) -> None:
        """Widen the array past the step axis to hold ``shape`` (never narrower)."""
        inner = tuple(max(a, b) for a, b in zip(self.array.shape[1:], shape))
        if inner == self.array.shape[1:]:
            return
        self.drain()
        self.array.resize((self.array.shape[0], *inner))
        buf = self._new(inner)
        buf[(slice(None), *map(slice, self.buf.shape[1:]))] = self.buf
        self.buf = buf

    def resize(self, rows: int) -> None:
        """Make room for ``rows`` rows, once every write in flight is made."""
        self.drain()
        self.array.resize((rows, *self.array.shape[1:]))

    def put(self, row: int, value: "np.ndarray | Rows") -> None:
        """The value of ``row`` (a smaller one is padded with the fill value)."""
        if isinstance(value, Rows):      # a row not put before: its buffer row holds the fill
            self.buf[row - self.start, value.index] = value.values
            self._filled(row)
            return
        value = np.asarray(value)
        if self.chunk_rows == 1 and value.shape == self.buf.shape[1:]:
            self._submit(row, value[None])             # a whole chunk: no copy into the buffer
            self.start += 1
            return
        if value.shape != self.buf.shape[1:]:
            self.grow_inner(value.shape)
            self.buf[row - self.start] = self.fill
            self.buf[(row - self.start, *map(slice, value.shape))] = value
        else:
            self.buf[row - self.start] = value
        self._filled(row)

    def _filled(self, row: int) -> None:
        """``row`` is in the buffer: a whole chunk is written, a new buffer begun."""
        self.dirty = True
        if row + 1 - self.start == self.chunk_rows:
            self._submit(self.start, self.buf)
            self.dirty = False
            self.start += self.chunk_rows
            if self.lane.inline:
                self.buf.fill(self.fill)
            else:                                      # the pool still reads the old one
                self.buf = self._new(self.buf.shape[1:])

    def _new(self, inner: tuple[int, ...]) -> np.ndarray:
        """A chunk's buffer of rows ``inner`` wide, filled with the fill value."""
        shape, dtype = (self.chunk_rows, *inner), self.array.dtype
        if self.chunks is not None:
            return self.chunks.buffer(shape, dtype, self.fill)
        return np.full(shape, self.fill, dtype=dtype)

    def write(self) -> None:
        """Write the current chunk whole (padded with the fill value past its rows)."""
        if self.dirty:
            block = self.buf
            if not self.lane.inline:                   # the writer fills it on
                block = self._new(self.buf.shape[1:])
                block[...] = self.buf
            self._submit(self.start, block)
            self.dirty = False

    def _submit(self, start: int, block: np.ndarray) -> None:
        if self.shards is not None and self.shards.fits(start, block):
            self.lane.submit(self.shards.write, start, block)
        elif self.chunks is not None and self.chunks.fits(start, block):
            self.lane.submit(self.chunks.write, start, block)
        else:
            self.lane.submit(self.array.__setitem__, slice(start, start + len(block)), block)

    def trim(self, rows: int) -> None:
        """Cut the array to ``rows`` rows, in its lane after its writes."""
        if self.array.shape[0] != rows:
            self.lane.submit(self.array.resize, (rows, *self.array.shape[1:]))

    def drain(self) -> None:
        """Wait for this column's chunk writes; raise the first that failed."""
        self.lane.drain()


class Table:
    """Columns that share the ``step`` dimension, appended one row at a time."""

    def __init__(self, group: zarr.Group, columns: dict[str, zarr.Array], rows: int,
                 pool: WritePool):
        self.group = group
        self.rows = rows
        self.columns = {name: Column(a, rows, pool) for name, a in columns.items()}
        self.block = math.lcm(*(c.chunk_rows for c in self.columns.values()))

    @property
    def capacity(self) -> int:
        return next(iter(self.columns.values())).array.shape[0]

    def append(self, values: dict[str, np.ndarray]) -> None:
        """One row: a value for each column named (those not named keep their fill)."""
        if self.rows == self.capacity:
            cap = max(self.block, -(-2 * self.capacity // self.block) * self.block)
            for c in self.columns.values():
                c.resize(cap)
        for name, value in values.items():
            self.columns[name].put(self.rows, value)
        self.rows += 1

    def flush(self) -> None:
        """Write every buffered chunk and wait until all of them are written."""
        for c in self.columns.values():
            c.write()
        self.drain()

    def trim(self) -> None:
        """Cut every column to its rows, each in its lane (in parallel with a pool);
        ``drain`` waits for them."""
        for c in self.columns.values():
            c.trim(self.rows)

    def drain(self) -> None:
        """Wait for every column's writes; raise the first that failed."""
        for c in self.columns.values():
            c.drain()

    def settle(self) -> None:
        """Wait for every column's writes, whatever failed (after a failed write:
        the table is then forgotten and opened again at its committed rows)."""
        for c in self.columns.values():
            try:
                c.drain()
            except Exception:       # the write that failed, or one after it
                pass


class Pyramid:
    """A stats table's pyramid (``format``): at each level, the maxima of each whole
    grain of its rows, appended as the table's rows come, a batch at a time
    (``BATCH`` rows, and at a flush: a few numpy calls a batch).  The partial last
    grain of each level is kept in memory as the fold of its rows so far; only
    whole grains are written, so a level holds the grains of ``rows // grain``."""

    BATCH = 64

    def __init__(self, group: zarr.Group, levels: dict[int, zarr.Array], rows: int,
                 pool: WritePool, tail: np.ndarray | None = None):
        """``rows``: the table's rows the levels hold (a stored table's committed
        rows, whose whole grains are stored); ``tail``: its last rows since a grain
        boundary of every level (row, layer, statistic), folded again into the
        partial grains."""
        self.levels = {g: Table(group, {fmt.pyramid_level(g): a}, rows // g, pool)
                       for g, a in levels.items()}
        self.partial: dict[int, np.ndarray | None] = {g: None for g in levels}
        self.pending: list[np.ndarray] = []
        self.rows = rows
        if tail is not None and len(tail):
            self.rows -= len(tail)
            self._fold(pyramid.pyramid_values(tail))

    def append(self, row: np.ndarray, width: int) -> None:
        """The table's next row of statistics (layer, statistic); ``width``: the
        table's layers now (each level is as wide)."""
        for t in self.levels.values():
            c = next(iter(t.columns.values()))
            if c.buf.shape[1] < width:
                c.grow_inner((width, len(fmt.PYRAMID_STATS)))
        self.pending.append(row)
        if len(self.pending) >= self.BATCH:
            self.fold()

    def fold(self) -> None:
        """Fold the rows appended since the last fold into every level."""
        if not self.pending:
            return
        width = max(r.shape[0] for r in self.pending)
        packed = np.full((len(self.pending), width, len(fmt.STATS)), np.nan)
        for i, r in enumerate(self.pending):
            packed[i, : r.shape[0]] = r
        self.pending = []
        self._fold(pyramid.pyramid_values(packed))

    def _fold(self, values: np.ndarray) -> None:
        """Fold rows' pyramid values (row, layer, statistic) in order: complete each
        level's partial grain, append the whole grains, keep the rest partial."""
        k = len(values)
        for g, table in self.levels.items():
            pos, i, acc = self.rows, 0, self.partial[g]
            if acc is not None:                     # pos is inside a grain
                if acc.shape[0] < values.shape[1]:
                    acc = np.concatenate([acc, np.full((values.shape[1] - acc.shape[0],
                                                        acc.shape[1]), np.nan)])
                i = min(-pos % g, k)
                acc = np.fmax.reduce(np.concatenate([acc[None], values[:i]]), axis=0)
                if (pos + i) % g == 0:
                    self._emit(table, g, (pos + i) // g - 1, acc)
                    acc = None
            whole = (k - i) // g
            for j, grain in enumerate(pyramid.grain_maxima(values[i: i + whole * g], g)):
                self._emit(table, g, (pos + i) // g + j, grain)
            i += whole * g
            self.partial[g] = np.fmax.reduce(values[i:], axis=0) if i < k else acc
        self.rows += k

    @staticmethod
    def _emit(table: Table, grain: int, index: int, value: np.ndarray) -> None:
        if index >= table.rows:                     # not one a stored level already holds
            table.append({fmt.pyramid_level(grain): value})

    def flush(self) -> None:
        self.fold()
        for t in self.levels.values():
            t.flush()

    def trim(self) -> None:
        for t in self.levels.values():
            t.trim()

    def drain(self) -> None:
        for t in self.levels.values():
            t.drain()

    def settle(self) -> None:
        for t in self.levels.values():
            t.settle()


class StatsTable(Table):
    """A statistics table and its ``pyramid`` (None: a table made before pyramids,
    or appended to by a tensortape without them)."""

    pyramid: Pyramid | None = None

    def append(self, values: dict[str, np.ndarray]) -> None:
        super().append(values)
        if self.pyramid is not None:
            self.pyramid.append(np.asarray(values["stats"], np.float64),
                                self.columns["stats"].buf.shape[1])

    def flush(self) -> None:
        if self.pyramid is not None:
            self.pyramid.flush()
        super().flush()

    def trim(self) -> None:
        super().trim()
        if self.pyramid is not None:
            self.pyramid.trim()

    def drain(self) -> None:
        super().drain()
        if self.pyramid is not None:
            self.pyramid.drain()

    def settle(self) -> None:
        super().settle()
        if self.pyramid is not None:
            self.pyramid.settle()
