"""Tables: columns that share the ``step`` dimension, appended one row at a time.

A *table* is one zarr group whose arrays (columns) share a leading ``step``
dimension: the statistics of one kind, or the full tensors of one (kind,
layer).  Rows are buffered per column until a chunk is whole, and a chunk is
written whole through the column's ``_pool.Lane`` (a partial one is padded
with the fill value and written at a flush, then written again when it
fills).  Capacity grows in blocks of whole chunks of every column; ``trim``
cuts each column to its rows at close.

Runs on the writer thread; the pool's threads only read a block once it is
submitted (a new buffer takes its place).
"""

from __future__ import annotations

import math

import numpy as np
import zarr

from ._pool import Lane, WritePool

__all__ = ["Column", "Table"]


class Column:
    """One array of a table and the buffer of its current chunk.

    Each whole chunk goes to the array's ``Lane`` (a new buffer takes its place
    when a pool writes it); ``drain`` waits for this column's writes, as every
    resize and every commit must."""

    def __init__(self, array: zarr.Array, rows: int, pool: WritePool):
        self.array = array
        self.lane = Lane(pool)
        self.chunk_rows = array.chunks[0]
        self.fill = array.fill_value
        self.start = rows - rows % self.chunk_rows
        self.buf = np.full((self.chunk_rows, *array.shape[1:]), self.fill, dtype=array.dtype)
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
        buf = np.full((self.chunk_rows, *inner), self.fill, dtype=self.buf.dtype)
        buf[(slice(None), *map(slice, self.buf.shape[1:]))] = self.buf
        self.buf = buf

    def resize(self, rows: int) -> None:
        """Make room for ``rows`` rows, once every write in flight is made."""
        self.drain()
        self.array.resize((rows, *self.array.shape[1:]))

    def put(self, row: int, value: np.ndarray) -> None:
        """The value of ``row`` (a smaller one is padded with the fill value)."""
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
        self.dirty = True
        if row + 1 - self.start == self.chunk_rows:
            self._submit(self.start, self.buf)
            self.dirty = False
            self.start += self.chunk_rows
            if self.lane.inline:
                self.buf.fill(self.fill)
            else:                                      # the pool still reads the old one
                self.buf = np.full_like(self.buf, self.fill)

    def write(self) -> None:
        """Write the current chunk whole (padded with the fill value past its rows)."""
        if self.dirty:
            self._submit(self.start, self.buf if self.lane.inline else self.buf.copy())
            self.dirty = False

    def _submit(self, start: int, block: np.ndarray) -> None:
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
