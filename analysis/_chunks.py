"""Rows of an array read a whole chunk file at a time, without zarr's pipeline.

A full-tensor table's ``data`` is unsharded, one chunk across its width, its
chunks encoded bytes (little-endian), zstd or none, then crc32c
(``recorder.store._layout``).  Rows of such an array in a local store are read
here: each chunk file read whole into one buffer (``readinto``), its checksum
checked, then decoded (``numpy.frombuffer`` when uncompressed: no copy); a chunk
not stored reads as the fill value, as in zarr.  ``rows`` gives None for any
other array, store or key, and for a chunk that does not read back whole (a
wrong size or checksum, a file that is not a regular one): the caller then
reads through zarr, which names or salvages the damage as it always does.

Runs on the reader's thread (``_source.Guarded.__getitem__``).
"""

from __future__ import annotations

import os
import stat

import numpy as np

__all__ = ["rows"]


def _plan(array) -> int | None | bool:
    """The zstd level of ``array``'s chunks, None when uncompressed, False when its
    chunks are not the ones read here (an HDF5 data set's too)."""
    meta = getattr(array, "metadata", None)
    if getattr(meta, "zarr_format", 2) != 3:
        return False
    import zarr
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
    codecs = tuple(getattr(meta, "codecs", ()))
    if (array.shards is not None or array.order != "C"
            or array.dtype.byteorder == ">" or not isinstance(array.store, zarr.storage.LocalStore)
            or len(codecs) not in (2, 3) or not isinstance(codecs[0], BytesCodec)
            or getattr(codecs[0].endian, "value", codecs[0].endian) not in (None, "little")
            or codecs[-1] != Crc32cCodec()
            or tuple(array.chunks[1:]) != tuple(array.shape[1:])):
        return False
    if len(codecs) == 2:
        return None
    zstd = codecs[1]
    return zstd.level if isinstance(zstd, ZstdCodec) else False


def rows(array, key) -> np.ndarray | None:
    """``array[key]`` for ``key`` a slice of rows (step None), read a chunk file at
    a time; None where it is not read here (see the module)."""
    if isinstance(key, tuple) and len(key) == 1:
        key = key[0]
    if not isinstance(key, slice) or key.step not in (None, 1) or array.ndim < 1:
        return None
    level = _plan(array)
    if level is False:
        return None
    start, stop, _ = key.indices(array.shape[0])
    stop = max(start, stop)
    k = array.chunks[0]
    first, last = start // k, -(-stop // k)
    chunks = [_chunk(array, c, level) for c in range(first, last)]
    if any(c is None for c in chunks):
        return None
    if len(chunks) == 1:
        return chunks[0][start - first * k: stop - first * k]
    out = np.empty((stop - start, *array.shape[1:]), array.dtype)
    for c, chunk in zip(range(first, last), chunks):
        lo, hi = max(start, c * k), min(stop, (c + 1) * k)
        out[lo - start: hi - start] = chunk[lo - c * k: hi - c * k]
    return out


def _chunk(array, index: int, level: int | None) -> np.ndarray | None:
    """Chunk ``index`` (along the rows) decoded, or None where it does not read back
    whole."""
    import google_crc32c
    shape = tuple(int(c) for c in array.chunks)
    raw = int(np.prod(shape)) * array.dtype.itemsize
    key = array.metadata.encode_chunk_key((index,) + (0,) * (array.ndim - 1))
    path = os.path.join(str(array.store.root), array.store_path.path, key)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return np.full(shape, array.fill_value, array.dtype)
    except OSError:
        return None
    try:                        # an I/O error (EIO, NFS's ESTALE): zarr's read, with its retries
        st = os.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode) or size < 4 or (
                size != raw + 4 if level is None else size > raw + raw // 64 + (1 << 16)):
            return None
        buf = np.empty(size, np.uint8)
        view, got = memoryview(buf), 0
        while got < size and (n := os.readv(fd, [view[got:]])):
            got += n
        if got != size:
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    body = buf[:-4]
    if np.uint32(google_crc32c.value(body)).tobytes() != buf[-4:].tobytes():
        return None
    if level is not None:
        from numcodecs import Zstd
        try:
            body = np.frombuffer(Zstd().decode(body), np.uint8)
        except Exception:                   # not zstd
            return None
        if body.size != raw:                # not this chunk's size (metadata changed under it)
            return None
    return body.view(array.dtype).reshape(shape)
