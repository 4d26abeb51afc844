"""Convert a Zarr store of an older format (1 or 2) to the current one:
``tensortape migrate OLD NEW``.

Every committed row is copied as it is (a step recorded twice stays twice, with
its ``recording`` column where a resumed recording gave it one), so
the ranks' commit counters stay true: statistics into the packed array and the
sharded histograms (``_store.RunStore``'s own layout), full-tensor tables
array by array with their chunks, codecs and attributes (format 1's tables gain
their ``micro`` column).  The data goes first, each rank's state after it, the
root's last: a conversion that stops half way is not a run (no root yet), and
``OLD`` is never changed.
"""

from __future__ import annotations

import os

import numpy as np

from recorder import format as fmt

from ._run import open_run

__all__ = ["migrate"]

BLOCK_ROWS = 1024


def migrate(old, new, progress=None) -> str:
    """Write ``old`` (a path or URL) to ``new`` in the current format; ``new``."""
    import zarr

    from recorder._store import SMALL_CHUNK_ROWS, RunStore, _array, check_mode
    run = open_run(old)
    new = os.fspath(new)
    check_mode(new, "w-")                     # never over anything
    root = zarr.open_group(new, mode="w-", zarr_format=3)
    tables = [(r, p, run.checked_rows(p, r)) for r in run.ranks
              for p, n in run.state(r).committed.items() if n]
    for rank, path, n in (progress(tables) if progress else tables):
        g = root.require_group(path)
        table = fmt.parse_path(path)
        recorded = run.source.has(f"{path}/{fmt.RECORDING}")    # a resumed recording's
        if table.section == "stats":
            width = int(run.source.array(f"{path}/hist").shape[1])
            cols = RunStore._new_stats(g, table.kind, width)
            if recorded:
                cols[fmt.RECORDING] = _array(g, fmt.RECORDING, (0,), (SMALL_CHUNK_ROWS,),
                                             "int64", 0, ["step"])
            for a in cols.values():
                a.resize((n, *a.shape[1:]))
            for lo in range(0, n, BLOCK_ROWS):
                hi = min(lo + BLOCK_ROWS, n)
                rows = np.arange(lo, hi)
                cols["step"][lo:hi] = np.asarray(run.source.array(f"{path}/step")[lo:hi])
                if recorded:
                    cols[fmt.RECORDING][lo:hi] = np.asarray(
                        run.source.array(f"{path}/{fmt.RECORDING}")[lo:hi])
                cols["hist"][lo:hi] = np.asarray(run.source.array(f"{path}/hist")[lo:hi])
                cols["stats"][lo:hi] = np.stack(
                    [np.asarray(run._stat(path, s, rows, slice(None))) for s in fmt.STATS], axis=2)
        else:
            g.update_attributes(run.source.attrs(path))
            for name in fmt.TENSOR_COLUMNS + ((fmt.RECORDING,) if recorded else ()):
                if not run.source.has(f"{path}/{name}"):          # format 1: no micro
                    _array(g, name, (n,), (SMALL_CHUNK_ROWS,), "int64",
                           fmt.OPTIONAL_COLUMNS[name], ["step"])[:] = 0
                    continue
                src = run.source.array(f"{path}/{name}")
                dst = g.create_array(
                    name, shape=(n, *src.shape[1:]), chunks=src.chunks, dtype=src.dtype,
                    fill_value=src.fill_value, attributes=dict(src.attrs),
                    dimension_names=getattr(src.metadata, "dimension_names", None),
                    compressors=getattr(src, "compressors", None) or None,
                    config={"write_empty_chunks": True})
                step = max(1, int(src.chunks[0]))
                for lo in range(0, n, step):
                    dst[lo: lo + step] = np.asarray(src[lo: min(lo + step, n)])
    for rank in run.ranks:                    # the counters after the data
        root.require_group(fmt.rank_group(rank)).update_attributes(run.state(rank).to_json())
    root.update_attributes({**run.attrs, "tensortape_format": fmt.FORMAT_VERSION})
    return new
