"""How a table's arrays are made: chunks, shards, codecs and fill values.

``format`` names the groups, arrays and attributes of a store; this module
makes the arrays behind those names as the recorder writes them: a statistics
table's packed ``stats`` and sharded ``hist`` (with their bins) and its
pyramid's levels (``pyramid_columns``), a kind's NaN/Inf counts at steps
without statistics (``nonfinite_columns``), a full-tensor
table's ``data`` (chunked by rows to about ``CHUNK_BYTES``, compressed at the
level ``zstd_level`` picks) and its small columns, and the columns an older
table gains (``existing_columns``).  ``to_numpy`` is a host tensor as those
arrays hold it.

Runs on the writer thread (a table's first row makes its arrays), and on the
caller's thread for a tool that writes a run (``migrate``).  No state.
"""

from __future__ import annotations

import numpy as np
import zarr
from numcodecs import Zstd
from zarr.codecs import Crc32cCodec, ZstdCodec

from .. import format as fmt
from ..dtypes import nan_bits
from ..histogram import NBINS, bin_edges

__all__ = ["existing_columns", "fill_for", "new_array", "nonfinite_columns", "pyramid_columns",
           "stats_columns", "step_column",
           "tensor_columns", "to_numpy", "zstd_level"]

CHUNK_BYTES = 8 << 20          # target size of one data chunk, uncompressed
SMALL_CHUNK_ROWS = 1024        # rows per chunk of small columns (step, extent)
STATS_CHUNK_ROWS = 1024      # format 3: statistics (step, layer, stat) in shards of 1024
LAYER_CHUNK = 256            # steps x 256 layers x every statistic, whose inner chunks are
STATS_LAYER_CHUNK = 16       # one statistic of 16 layers (a layer's evolution reads little);
HIST_SHARD_ROWS = 256        # histograms in shards of 256 steps x 256 layers, whose inner
                             # chunks are 16 steps x 8 layers
PYRAMID_CHUNK = 128          # grains a shard of a pyramid level (x 256 layers x every
                             # statistic), whose inner chunks are one statistic
HIST_CHUNK_ROWS = 16
HIST_LAYER_CHUNK = 8
SAMPLE_BYTES = 1 << 20         # how much of a tensor's first step picks its zstd level
PAYS = 0.9                     # level 1 if it makes that sample at least 10% smaller


def new_array(group: zarr.Group, name: str, shape, chunks, dtype, fill, dims, attrs=None,
              level: int | None = 1, shards=None) -> zarr.Array:
    """A new array, zstd-compressed at ``level`` (``None``: uncompressed), its
    chunks packed into ``shards`` when given.  Every chunk carries a crc32c: a
    flipped bit is damage the reader names (zstd's fast mode stores blocks raw,
    which would decode to wrong numbers), and a shard, read in two moves, is
    caught if the writer replaced it between them."""
    compressors = ([] if level is None else [ZstdCodec(level=level)]) + [Crc32cCodec()]
    return group.create_array(
        name, shape=shape, chunks=chunks, shards=shards, dtype=dtype, fill_value=fill,
        dimension_names=dims, compressors=compressors or None,
        attributes=attrs or {}, overwrite=True, config={"write_empty_chunks": True})


def step_column(group: zarr.Group, name: str, rows: int = 0, fill: int = 0) -> zarr.Array:
    """A new small int64 column along ``step`` (``step``, ``micro``, ``recording``)."""
    return new_array(group, name, (rows,), (SMALL_CHUNK_ROWS,), "int64", fill, ["step"])


def zstd_level(sample: np.ndarray) -> int:
    """The level of ``compression="auto"``: zstd level 1 where it pays on
    ``sample``, else zstd's fast mode.

    Dense float activations shrink by about 8% at level 1, at a cost per byte
    that exceeds writing them; zstd's fast mode (level -1) stores such blocks
    raw at memory speed, and still shrinks sparse data (post-ReLU) by ~40%.
    """
    head = np.ascontiguousarray(sample).reshape(-1)[: SAMPLE_BYTES // max(sample.itemsize, 1)]
    if head.nbytes == 0:
        return 1
    return 1 if len(Zstd(1).encode(head)) <= PAYS * head.nbytes else -1


def fill_for(dtype: np.dtype):
    """The fill value of data of ``dtype``: NaN where it has one, else zero (False)."""
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "c":
        return complex(np.nan, np.nan)
    return False if dtype.kind == "b" else 0


def stats_columns(g: zarr.Group, kind: str, n_layers: int) -> dict[str, zarr.Array]:
    """A new statistics table of ``kind`` in ``g``, ``n_layers`` wide: its bins and
    its columns ``step``, ``stats`` (step, layer, statistic) and ``hist``."""
    lo, hi = bin_edges()
    new_array(g, "bin_lo", lo.shape, lo.shape, "float64", np.nan, ["bin"])[:] = lo
    new_array(g, "bin_hi", hi.shape, hi.shape, "float64", np.nan, ["bin"])[:] = hi
    cols = {"step": step_column(g, "step", fill=-1),
            "stats": new_array(g, "stats", (0, n_layers, len(fmt.STATS)),
                               (STATS_CHUNK_ROWS, STATS_LAYER_CHUNK, 1), "float64",
                               np.nan, ["step", "layer", fmt.STAT_AXIS],
                               shards=(STATS_CHUNK_ROWS, LAYER_CHUNK, len(fmt.STATS))),
            "hist": new_array(g, "hist", (0, n_layers, NBINS),
                              (HIST_CHUNK_ROWS, HIST_LAYER_CHUNK, NBINS), "int64", 0,
                              ["step", "layer", "bin"],
                              shards=(HIST_SHARD_ROWS, LAYER_CHUNK, NBINS))}
    g.update_attributes({"kind": kind, fmt.EVERY_CHUNK: True, "stats": list(fmt.STATS)})
    return cols


def pyramid_columns(g: zarr.Group, n_layers: int) -> dict[int, zarr.Array]:
    """A new statistics table's pyramid in ``g``, ``n_layers`` wide: an array
    (grain, layer, ``format.PYRAMID_STATS``) per level, by its grain."""
    return {grain: new_array(g, fmt.pyramid_level(grain), (0, n_layers, len(fmt.PYRAMID_STATS)),
                             (PYRAMID_CHUNK, LAYER_CHUNK, 1), "float64", np.nan,
                             [f"grain{grain}", "layer", "grain_stat"],
                             {"grain": grain, "stats": list(fmt.PYRAMID_STATS)},
                             shards=(PYRAMID_CHUNK, LAYER_CHUNK, len(fmt.PYRAMID_STATS)))
            for grain in fmt.PYRAMID_GRAINS}


def nonfinite_columns(g: zarr.Group, kind: str, n_layers: int) -> dict[str, zarr.Array]:
    """A new table of ``kind``'s NaN/Inf counts at steps without statistics in ``g``,
    ``n_layers`` wide (the rank's layers): its columns ``step`` and ``counts`` (step,
    layer, ``format.COUNT_STATS[1:]``), in shards as the statistics are."""
    g.update_attributes({"kind": kind, fmt.EVERY_CHUNK: True,
                         "counts": list(fmt.COUNT_STATS[1:])})
    nc = len(fmt.COUNT_STATS) - 1
    return {"step": step_column(g, "step", fill=-1),
            "counts": new_array(g, "counts", (0, n_layers, nc),
                                (STATS_CHUNK_ROWS, STATS_LAYER_CHUNK, nc), "int64", 0,
                                ["step", "layer", "count_stat"],
                                shards=(STATS_CHUNK_ROWS, LAYER_CHUNK, nc))}


def tensor_columns(g: zarr.Group, kind: str, layer: str, sample: np.ndarray,
                   logical: str | None, level: int | None) -> dict[str, zarr.Array]:
    """A new full-tensor table of (``kind``, ``layer``) in ``g``, its ``data``
    shaped, typed and compressed (at ``level``) after ``sample``, the first row."""
    g.update_attributes({"name": layer, "kind": kind, fmt.EVERY_CHUNK: True})
    k = int(min(64, max(1, CHUNK_BYTES // max(sample.nbytes, 1))))
    inner = tuple(max(d, 1) for d in sample.shape)
    attrs = {fmt.LOGICAL_ATTR: logical} if logical else {}
    dims = ["step", *(f"dim_{i}" for i in range(sample.ndim))]
    return {
        "data": new_array(g, "data", (0, *sample.shape), (k, *inner), sample.dtype,
                          fill_for(sample.dtype) if not logical else nan_bits(logical),
                          dims, attrs, level=level),
        "step": step_column(g, "step", fill=-1),
        "micro": step_column(g, "micro"),
        "extent": new_array(g, "extent", (0, max(sample.ndim, 1)),
                            (SMALL_CHUNK_ROWS, max(sample.ndim, 1)), "int64", -1,
                            ["step", "axis"]),
    }


def existing_columns(g: zarr.Group, names: list[str], committed: int,
                     recording: int) -> dict[str, zarr.Array]:
    """The columns ``names`` of a table that has ``committed`` rows, each to be
    written in whole chunks.  A table of an older format gains the optional
    columns it lacks; a recording after the first (``recording`` > 0) gives it
    its ``recording`` column, whose committed rows are recording 0's, every
    chunk of them stored."""
    rows = g["step"].shape[0]
    for n, fill in fmt.OPTIONAL_COLUMNS.items():
        if n in names and n not in g:
            step_column(g, n, rows, fill)
    if recording and fmt.RECORDING not in g:
        step_column(g, fmt.RECORDING, rows)[:committed] = np.zeros(committed, np.int64)
    names = names + ([fmt.RECORDING] if fmt.RECORDING in g else [])
    return {n: g[n].with_config({"write_empty_chunks": True}) for n in names}


def to_numpy(t) -> tuple[np.ndarray, str | None]:
    """A host torch tensor as numpy, and its logical dtype when numpy has none:
    bfloat16 and the 8-bit floats become their unsigned bits, complex32 becomes
    complex64 (exactly)."""
    import torch
    name = str(t.dtype).removeprefix("torch.")
    if name in fmt.BITS_DTYPES:
        bits = fmt.BITS_DTYPES[name]
        return t.view(torch.int16 if bits == "uint16" else torch.uint8).numpy().view(bits), name
    if t.dtype == torch.complex32:
        return t.to(torch.complex64).numpy(), None
    return t.numpy(), None
