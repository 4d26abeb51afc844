"""Chunks and shards of a column written as zarr writes them, without zarr's
codec pipeline.

``Chunks``: an unsharded column whose codecs are the ones ``_layout`` makes
(bytes, zstd or none, crc32c) has each whole chunk encoded here and stored in
one write of the store: uncompressed, its checksum goes in the four bytes
``Chunks.buffer`` leaves after the chunk's buffer, so a full tensor's chunk
reaches the store without a copy (zarr's pipeline copies it twice, into new
memory, for the checksum).

``Shards``: a sharded column whose codecs are the ones ``_layout`` makes (bytes, zstd,
crc32c; the index at the end) has its blocks of whole inner chunks encoded
here: each inner chunk compressed with the same zstd and checksum, the shard
laid out as zarr lays it out (byte for byte: tests/test_writer.py checks), the
untouched chunks of a stored shard kept.  zarr's own writer spends about 0.2 ms
of Python holding the GIL per inner chunk, which a statistics table of 201
layers pays 143 times at every commit.

``of`` gives None for any other array (or without zarr's pieces used here), and
``fits`` is false for a block that is not whole chunks over the array's full
width: zarr writes those.

Runs on the write pool's threads (``_table.Column`` submits ``write`` to its lane).
"""

from __future__ import annotations

import math

import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec
from zarr.codecs.bytes import Endian

try:                        # zarr's own pieces (not its public API): without them, zarr writes
    import google_crc32c
    from numcodecs import Zstd
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.indexing import morton_order_iter
    from zarr.core.sync import sync
except ImportError:         # pragma: no cover - another zarr
    Zstd = None

__all__ = ["Chunks", "Shards"]

_ABSENT = 2 ** 64 - 1                 # a shard index's entry for a chunk not stored


def _crc(data) -> bytes:
    """zarr's crc32c codec: the checksum of ``data``, 4 bytes little-endian."""
    return np.uint32(google_crc32c.value(data)).tobytes()


def _codecs(codecs: tuple) -> tuple[bool, int | None] | None:
    """Whether ``codecs`` (of an array or a shard's inner chunks) are bytes (little
    endian, or none for one-byte types), zstd at some level or none, then crc32c:
    (True, the zstd level or None); None for any other."""
    if (Zstd is None or not codecs or not isinstance(codecs[0], BytesCodec)
            or codecs[0].endian not in (None, Endian.little) or codecs[-1] != Crc32cCodec()):
        return None
    middle = codecs[1:-1]
    if not middle:
        return True, None
    zstd = middle[0]
    if len(middle) == 1 and isinstance(zstd, ZstdCodec) and zstd == ZstdCodec(
            level=zstd.level, checksum=False):
        return True, zstd.level
    return None


def _plain(array: zarr.Array) -> bool:
    """Whether ``array``'s chunks are stored as zarr v3 writes C-ordered, little-endian
    data, every chunk written."""
    return (getattr(array.metadata, "zarr_format", 2) == 3 and array.dtype.byteorder != ">"
            and array.order == "C" and array.config.write_empty_chunks)


class Chunks:
    """Whole chunks of an unsharded array written as zarr writes them (see the
    module); ``of`` gives None for an array it cannot write."""

    def __init__(self, array: zarr.Array, level: int | None):
        self.array = array
        self.chunk = array.chunks
        self.zstd = None if level is None else Zstd(level=level)
        self.prototype = default_buffer_prototype()

    @classmethod
    def of(cls, array: zarr.Array) -> "Chunks | None":
        codecs = _codecs(tuple(getattr(array.metadata, "codecs", ())))
        if codecs is None or array.shards is not None or not _plain(array):
            return None
        return cls(array, codecs[1])

    @staticmethod
    def buffer(shape: tuple, dtype: np.dtype, fill) -> np.ndarray:
        """A chunk's buffer filled with ``fill``, four bytes of room after it (its
        checksum's, for ``write``)."""
        n = math.prod(shape) * dtype.itemsize
        buf = np.empty(n + 4, np.uint8)[:n].view(dtype).reshape(shape)
        buf.fill(fill)
        return buf

    def fits(self, start: int, block: np.ndarray) -> bool:
        """Whether ``block`` (rows from ``start``) is one whole chunk, the array's
        whole width."""
        return (start % self.chunk[0] == 0 and block.shape == self.chunk
                and start + len(block) <= self.array.shape[0]
                and block.shape[1:] == self.array.shape[1:] and block.dtype == self.array.dtype)

    def write(self, start: int, block: np.ndarray) -> None:
        """The chunk of rows ``start`` on: its bytes (compressed), then their
        checksum, in one write."""
        if self.zstd is not None:
            data = bytes(self.zstd.encode(np.ascontiguousarray(block)))
            raw = data + _crc(data)
        else:
            raw = _room(block)
            if raw is None:
                raw = np.empty(block.nbytes + 4, np.uint8)
                raw[:-4] = np.ascontiguousarray(block).view(np.uint8).reshape(-1)
            raw[-4:] = np.frombuffer(_crc(raw[:-4]), np.uint8)
        key = self.array.metadata.encode_chunk_key((start // self.chunk[0],) + (0,) * (block.ndim - 1))
        buf = (self.prototype.buffer.from_bytes(raw) if isinstance(raw, bytes)
               else self.prototype.buffer.from_array_like(raw))
        sync((self.array.store_path / key).set(buf))


def _room(block: np.ndarray) -> np.ndarray | None:
    """The bytes of ``block`` and the four after it, when ``block`` is a whole buffer
    that ``Chunks.buffer`` made; else None."""
    base = block.base
    if (isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1
            and base.nbytes == block.nbytes + 4 and block.flags.c_contiguous
            and base.ctypes.data == block.ctypes.data):
        return base
    return None


class Shards:
    """Blocks of whole inner chunks written into an array's shards, as zarr writes
    them (see the module); ``of`` gives None for an array it cannot write."""

    def __init__(self, array: zarr.Array, codec: ShardingCodec, level: int):
        self.array = array
        self.inner = codec.chunk_shape
        self.shard = array.shards
        self.zstd = Zstd(level=level)
        self.prototype = default_buffer_prototype()

    @classmethod
    def of(cls, array: zarr.Array) -> "Shards | None":
        codecs = getattr(array.metadata, "codecs", ())
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec) or not _plain(array):
            return None
        sc = codecs[0]
        inner = _codecs(tuple(sc.codecs))
        if (inner is None or inner[1] is None
                or sc.index_codecs != (BytesCodec(endian="little"), Crc32cCodec())
                or sc.index_location.value != "end"):
            return None
        return cls(array, sc, inner[1])

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
