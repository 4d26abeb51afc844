"""Export a run to one HDF5 file (h5py, a group per table, chunked, gzip-1).

Streams a block of rows at a time, or one chunk at a time where a block of rows
would be large, so memory stays bounded by ``BLOCK_BYTES`` or a chunk of the store.
``open_run("run.h5")`` reads it back with the same API.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np

from recorder import format as fmt

from ._source import JSON_ATTR

__all__ = ["to_hdf5"]

BLOCK_BYTES = 64 << 20           # the most one copy holds in memory, unless one chunk is more


def to_hdf5(run, path, progress=None) -> str:
    import h5py
    tables = []
    for r in run.ranks:
        tables += [(p, run.checked_rows(p, r)) for p, n in run.state(r).committed.items() if n]
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"      # the file appears whole, or not at all
    try:
        _write(run, h5py, partial, tables, progress)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def _write(run, h5py, path: str, tables, progress) -> None:
    with h5py.File(path, "w") as f:
        f.attrs[JSON_ATTR] = json.dumps(run.attrs)
        for r in run.ranks:
            g = f.require_group(fmt.rank_group(r))
            g.attrs[JSON_ATTR] = json.dumps(run.state(r).to_json())
        bar = progress(tables) if progress else tables
        for path_, n in bar:
            group = f.require_group(path_)
            group.attrs[JSON_ATTR] = json.dumps(run.source.attrs(path_))
            table = fmt.parse_path(path_)
            for name in run.columns(path_) + (fmt.BIN_COLUMNS if table.section == "stats" else ()):
                src = run.source.array(f"{path_}/{name}")
                rows = n if src.ndim and name not in fmt.BIN_COLUMNS else src.shape[0]
                shape = (rows, *src.shape[1:]) if src.ndim else ()
                chunks = tuple(max(1, min(c, s)) for c, s in zip(src.chunks, shape)) or None
                dst = group.create_dataset(name, shape=shape, dtype=src.dtype, chunks=chunks,
                                           compression="gzip", compression_opts=1,
                                           fillvalue=src.fill_value)
                dst.attrs[JSON_ATTR] = json.dumps(dict(src.attrs))
                for k, v in dict(src.attrs).items():
                    dst.attrs[k] = v
                for block in _blocks(shape, src.chunks, np.dtype(src.dtype).itemsize):
                    dst[block] = np.asarray(src[block])


def _blocks(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int):
    """The regions of an array of ``shape`` to copy one at a time: a chunk of rows
    whole when it is at most ``BLOCK_BYTES``, else chunk by chunk."""
    if not shape:
        yield ()
        return
    chunks = tuple(max(1, c) for c in chunks)
    whole = chunks[0] * math.prod(shape[1:]) * itemsize <= BLOCK_BYTES
    steps = (chunks[0], *(shape[1:] if whole else chunks[1:]))
    for corner in itertools.product(*(range(0, n, max(1, c)) for n, c in zip(shape, steps))):
        yield tuple(slice(lo, min(lo + c, n)) for lo, c, n in zip(corner, steps, shape))
