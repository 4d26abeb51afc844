"""Export a run to one HDF5 file (h5py, a group per table, chunked, gzip-1).

Streams one chunk at a time, so memory stays bounded by a chunk of the store.
``open_run("run.h5")`` reads it back with the same API.
"""

from __future__ import annotations

import itertools
import json

import numpy as np

from recorder import format as fmt

from ._source import JSON_ATTR

__all__ = ["to_hdf5"]


def to_hdf5(run, path, progress=None) -> str:
    import h5py
    tables = []
    for r in run.ranks:
        tables += [(p, run.checked_rows(p, r)) for p, n in run.state(r).committed.items() if n]
    with h5py.File(path, "w") as f:
        f.attrs[JSON_ATTR] = json.dumps(run.attrs)
        for r in run.ranks:
            g = f.require_group(f"rank{r}")
            g.attrs[JSON_ATTR] = json.dumps(run.state(r).to_json())
        bar = progress(tables) if progress else tables
        for path_, n in bar:
            group = f.require_group(path_)
            group.attrs[JSON_ATTR] = json.dumps(run.source.attrs(path_))
            table = fmt.parse_path(path_)
            for name in table.columns + (fmt.BIN_COLUMNS if table.section == "stats" else ()):
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
                for block in _blocks(shape, src.chunks):
                    dst[block] = np.asarray(src[block])
    return str(path)


def _blocks(shape: tuple[int, ...], chunks: tuple[int, ...]):
    """The regions of an array of ``shape``, one chunk each."""
    if not shape:
        yield ()
        return
    ranges = [range(0, n, max(1, c)) for n, c in zip(shape, chunks)]
    for corner in itertools.product(*ranges):
        yield tuple(slice(lo, min(lo + max(1, c), n)) for lo, c, n in zip(corner, chunks, shape))
