"""Tables: columns that share the ``step`` dimension, appended one row at a time.

A *table* is one zarr group whose arrays (columns) share a leading ``step``
dimension: the statistics of one kind, or the full tensors of one (kind,
layer).  Rows are buffered per column until a chunk is whole, and a chunk is
written whole through the column's ``_pool.Lane`` (a partial one is padded
with the fill value and written at a flush, then written again when it
fills).  Capacity grows in blocks of whole chunks of every column; ``trim``
cuts each column to its rows at close.

A sharded column whose codecs are the ones ``_layout`` makes (bytes, zstd,
crc32c; the index at the end) has its blocks encoded here (``_Shards``): each
inner chunk compressed with the same zstd and checksum, the shard laid out as
zarr lays it out (byte for byte, tests/test_writer.py checks), the untouched
chunks of a shard kept from the stored one.  zarr's own writer spends about
0.2 ms of Python holding the GIL per inner chunk, which a statistics table of
201 layers pays 143 times at every commit; any other array, or a block that is
not whole inner chunks over the array's full width, is written by zarr.

A statistics table (``StatsTable``) also keeps its ``Pyramid``: the maxima of
each grain of its rows, at each level of ``format.PYRAMID_GRAINS``.

Runs on the writer thread; the pool's threads only read a block once it is
submitted (a new buffer takes its place).
"""

from __future__ import annotations

import math

import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

try:                        # zarr's own pieces (not its public API): without them, zarr writes
    import google_crc32c
    from numcodecs import Zstd
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.indexing import morton_order_iter
    from zarr.core.sync import sync
except ImportError:         # pragma: no cover - another zarr
    Zstd = None

from . import format as fmt
from ._pool import Lane, WritePool

__all__ = ["Column", "Pyramid", "StatsTable", "Table"]


_ABSENT = 2 ** 64 - 1                 # a shard index's entry for a chunk not stored


def _crc(data) -> bytes:
    """zarr's crc32c codec: the checksum of ``data``, 4 bytes little-endian."""
    return np.uint32(google_crc32c.value(data)).tobytes()


class _Shards:
    """Blocks of whole inner chunks written into an array's shards, as zarr writes
    them (see the module); ``of`` gives None for an array it cannot write."""

    def __init__(self, array: zarr.Array, codec: ShardingCodec, level: int):
        self.array = array
        self.inner = codec.chunk_shape
        self.shard = array.shards
        self.zstd = Zstd(level=level)
        self.prototype = default_buffer_prototype()

    @classmethod
    def of(cls, array: zarr.Array) -> "_Shards | None":
        meta = array.metadata
        codecs = getattr(meta, "codecs", ())
        if (Zstd is None or getattr(meta, "zarr_format", 2) != 3 or len(codecs) != 1
                or not isinstance(codecs[0], ShardingCodec) or array.dtype.byteorder == ">"
                or array.order != "C" or not array.config.write_empty_chunks):
            return None
        sc = codecs[0]
        zstd = sc.codecs[1] if len(sc.codecs) == 3 else None
        little = BytesCodec(endian="little")
        if (not isinstance(zstd, ZstdCodec)
                or sc.codecs != (little, ZstdCodec(level=zstd.level, checksum=False), Crc32cCodec())
                or sc.index_codecs != (little, Crc32cCodec())
                or sc.index_location.value != "end"):
            return None
        return cls(array, sc, zstd.level)

    def fits(self, start: int, block: np.ndarray) -> bool:
        """Whether ``block`` (rows from ``start``) is whole inner chunks along the
        rows and the array's whole width."""
        rows = self.inner[0]
        return (start % rows == 0 and len(block) % rows == 0
                and start + len(block) <= self.array.shape[0]
                and block.shape[1:] == self.array.shape[1:] and block.dtype == self.array.dtype)

    def write(self, start: int, block: np.ndarray) -> None:
        """Rows ``start`` on: each shard they touch, its other chunks kept."""
        shape, shard = self.array.shape, self.shard
        stop = start + len(block)
        grid = [range(start // shard[0], -(-stop // shard[0]))]
        grid += [range(-(-n // s)) for n, s in zip(shape[1:], shard[1:])]
        for coords in np.ndindex(*map(len, grid)):
            origin = tuple(g[c] * s for g, c, s in zip(grid, coords, shard))
            self._shard(origin, start, block)

    def _shard(self, origin: tuple, start: int, block: np.ndarray) -> None:
        shape, shard, inner = self.array.shape, self.shard, self.inner
        cps = tuple(s // c for s, c in zip(shard, inner))
        extent = tuple(min(s, n - o) for s, n, o in zip(shard, shape, origin))
        lo = max(start, origin[0]) - origin[0]              # the block's rows in the shard
        hi = min(start + len(block), origin[0] + shard[0]) - origin[0]
        key = self.array.metadata.encode_chunk_key(tuple(o // s for o, s in zip(origin, shard)))
        path = self.array.store_path / key
        old, where = self._stored(path, cps) if (lo, hi) != (0, extent[0]) else (b"", None)
        parts, at = [], 0
        index = np.full((*cps, 2), _ABSENT, dtype="<u8")
        for cc in morton_order_iter(cps):
            first = [c * n for c, n in zip(cc, inner)]
            if any(f >= e for f, e in zip(first, extent)):
                continue                                  # wholly outside the array
            if lo <= first[0] < hi:
                data = self._encode(block, [o + f for o, f in zip(origin, first)], start)
            else:                                     # kept from the stored shard
                at_old, size = (_ABSENT, 0) if where is None else where[cc]
                if at_old == _ABSENT or not size:
                    continue
                data = old[int(at_old): int(at_old + size)]
            index[cc] = (at, len(data))
            at += len(data)
            parts.append(data)
        raw = index.tobytes()
        parts.append(raw + _crc(raw))
        sync(path.set(self.prototype.buffer.from_bytes(b"".join(parts))))

    def _encode(self, block: np.ndarray, first: list[int], start: int) -> bytes:
        """The inner chunk whose first element is at ``first`` (in the array), from
        ``block``, padded with the fill value past the array's edge: compressed,
        then its checksum."""
        shape, inner = self.array.shape, self.inner
        stop = [min(f + n, e) for f, n, e in zip(first, inner, shape)]
        part = block[(slice(first[0] - start, stop[0] - start),
                      *(slice(f, t) for f, t in zip(first[1:], stop[1:])))]
        if part.shape == tuple(inner):
            chunk = np.ascontiguousarray(part)
        else:
            chunk = np.full(inner, self.array.fill_value, dtype=self.array.dtype)
            chunk[tuple(slice(0, n) for n in part.shape)] = part
        data = bytes(self.zstd.encode(chunk))
        return data + _crc(data)

    def _stored(self, path, cps: tuple) -> tuple[bytes, np.ndarray | None]:
        """The stored shard's bytes and its index (each chunk's offset and length;
        None: no shard stored)."""
        buf = sync(path.get(prototype=self.prototype))
        if buf is None:
            return b"", None
        data = buf.to_bytes()
        size = math.prod(cps) * 16
        raw, crc = data[-size - 4: -4], data[-4:]
        if len(raw) != size or _crc(raw) != crc:
            raise ValueError(f"the shard index of {path} does not match its checksum")
        return data, np.frombuffer(raw, dtype="<u8").reshape(*cps, 2)


class Column:
    """One array of a table and the buffer of its current chunk.

    Each whole chunk goes to the array's ``Lane`` (a new buffer takes its place
    when a pool writes it); ``drain`` waits for this column's writes, as every
    resize and every commit must."""

    def __init__(self, array: zarr.Array, rows: int, pool: WritePool):
        self.array = array
        self.shards = _Shards.of(array)
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
        if self.shards is not None and self.shards.fits(start, block):
            self.lane.submit(self.shards.write, start, block)
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
            self._fold(fmt.pyramid_values(tail))

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
        self._fold(fmt.pyramid_values(packed))

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
            for j, grain in enumerate(fmt.grain_maxima(values[i: i + whole * g], g)):
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
