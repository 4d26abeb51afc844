"""Export a run to one HDF5 file (h5py, a group per table, chunked, gzip-1).

Streams a block of rows at a time, or one chunk at a time where a block of rows
would be large, so memory stays bounded by ``BLOCK_BYTES`` or a chunk of the store.
``open_run("run.h5")`` reads it back with the same API.

Self-describing for readers without tensortape (``xr.open_dataset(path,
engine="h5netcdf", group=...)``, h5py): every dimension is a named HDF5
dimension scale with its coordinate values, the layer names are data, and the
variables carry CF-style attributes (``long_name``, ``units``, ``Conventions``).
The root holds the run's layers (``layer``, in execution order); a stats group
``rankR/stats/KIND`` has ``stats`` (step, layer, stat), ``hist`` (step, layer,
bin) with the coordinates ``step``, ``layer``, ``stat`` and ``bin`` (its edges in
``bin_lo``, ``bin_hi``); a tensor group has ``data`` (row, dim_0, ...), one row
per step and micro-batch, named by ``step`` and ``micro`` (row); the scalars
group ``rankR/scalars`` has ``step``, ``name`` and ``value`` (row), ``name``
an index into the coordinate ``scalar`` (the logged names); a group
``rankR/nonfinite/KIND`` has ``counts`` (step, layer, count_stat): the NaN/Inf
counts of the steps without statistics that held any.

Names are user data (any string: NUL, ``/``, lone surrogates), and HDF5 text
holds neither NUL nor a lone surrogate: a name is stored as itself, or, where
it holds one of those or begins with ``"``, as its JSON string literal (ASCII,
``json.dumps``).  ``json.loads(t) if t.startswith('"') else t`` gives it back.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np

from tensortape.recorder import format as fmt
from tensortape.recorder import histogram

from .._source import JSON_ATTR

__all__ = ["to_hdf5"]

BLOCK_BYTES = 64 << 20           # the most one copy holds in memory, unless one chunk is more


def to_hdf5(run, path, progress=None) -> str:
    import h5py
    tables = []
    for r in run.ranks:
        st = run.state(r)
        tables += [(p, run.checked_rows(p, r))
                   for p, n in {**st.committed, **(st.nonfinite or {})}.items() if n]
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"      # the file appears whole, or not at all
    try:
        with run.index.refusing("the HDF5 export"):
            _write(run, h5py, partial, tables, progress)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def _write(run, h5py, path: str, tables, progress) -> None:
    with h5py.File(path, "w") as f:
        f.attrs[JSON_ATTR] = json.dumps(run.attrs)
        _describe_root(f, run, h5py)
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
                # an empty dimension (every step's tensor had size 0 along it) is made
                # resizable there: HDF5 takes no chunk larger than a fixed dimension
                dst = group.create_dataset(name, shape=shape, dtype=src.dtype, chunks=chunks,
                                           maxshape=tuple(s or None for s in shape) or None,
                                           compression="gzip", compression_opts=1,
                                           fillvalue=src.fill_value)
                dst.attrs[JSON_ATTR] = json.dumps(dict(src.attrs))
                for k, v in dict(src.attrs).items():
                    dst.attrs[k] = v
                for block in _blocks(shape, src.chunks, np.dtype(src.dtype).itemsize):
                    dst[block] = np.asarray(src[block])
            _describe(group, table, run, h5py)


_LONG = {"stats": "per-step statistics of each layer (counts as whole numbers; NaN: not run)",
         "hist": "element counts per bin of the shared histogram bins",
         "bin_lo": "lower edge of the bin", "bin_hi": "upper edge of the bin",
         "step": "training step", "micro": "micro-batch within the step (0: the first)",
         "counts": "NaN, +Inf and -Inf elements at a step without statistics",
         "extent": "true extent of the row along each axis (the rest is NaN padding)",
         "data": "full tensor, NaN-padded to the largest shape",
         "name": "the logged scalar's name: an index into scalar", "value": "the logged value",
         "recording": "which recording of the run wrote the row (a resumed run: 1, 2, ...)"}


def _scale(group, name: str, values, long_name: str) -> None:
    """A dimension scale ``name`` with numeric ``values``."""
    group.create_dataset(name, data=values)
    _label(group, name, long_name)


def _names(group, name: str, names: list[str], h5py, long_name: str) -> None:
    """A dimension scale ``name`` of user names, each as ``_text``."""
    group.create_dataset(name, data=np.array([_text(n) for n in names], dtype=object),
                         dtype=h5py.string_dtype())
    _label(group, name, long_name)


def _label(group, name: str, long_name: str) -> None:
    group[name].attrs["long_name"] = long_name
    group[name].make_scale(name)


def _text(name: str) -> str:
    """A name as HDF5 text (see the module): itself, or its JSON string literal where
    HDF5 cannot hold it (a NUL, a lone surrogate) or it begins with ``"``."""
    if name.startswith('"') or "\0" in name or any("\ud800" <= c <= "\udfff" for c in name):
        return json.dumps(name)
    return name


def _attach(group, name: str, dims: tuple[str, ...]) -> None:
    var = group[name]
    for i, d in enumerate(dims):
        var.dims[i].attach_scale(group[d])
        var.dims[i].label = d


def _describe_root(f, run, h5py) -> None:
    f.attrs["Conventions"] = "CF-1.8"
    f.attrs["title"] = f"tensortape run {run.name}"
    f.attrs["source"] = "tensortape"
    for k in ("status", "model_class", "torch_version", "tensortape_format"):
        if isinstance(run.attrs.get(k), (str, int)):
            f.attrs[k] = run.attrs[k]
    _names(f, "layer", run.layers, h5py, "recorded layer (module name), in execution order")


def _describe(group, table, run, h5py) -> None:
    """Name the dimensions of one table's datasets and give them coordinates."""
    for name in group:
        if name in _LONG:
            group[name].attrs["long_name"] = _LONG[name]
    state = run.state(table.rank)
    if table.section == "stats":
        _describe_stats(group, state.stats_layers.get(table.kind, []), h5py)
    elif table.section == "nonfinite":
        _describe_nonfinite(group, state.layers, h5py)
    elif table.section == "scalars":
        _describe_scalars(group, state.scalar_names, h5py)
    else:
        _describe_tensor(group, table)


def _describe_stats(group, layers: list[str], h5py) -> None:
    group["step"].make_scale("step")
    _names(group, "layer", layers, h5py, "layer (module name)")
    _names(group, "stat", list(fmt.STATS), h5py, "statistic")
    _scale(group, "bin", histogram.bin_centers(), "bin centre")
    group["stats"].attrs["coordinates"] = "step layer stat"
    for name, dims in (("stats", ("step", "layer", "stat")), ("hist", ("step", "layer", "bin")),
                       ("bin_lo", ("bin",)), ("bin_hi", ("bin",)),
                       *((("recording", ("step",)),) if "recording" in group else ())):
        _attach(group, name, dims)


def _describe_nonfinite(group, layers: list[str], h5py) -> None:
    group["step"].make_scale("step")
    _names(group, "layer", layers[:group["counts"].shape[1]], h5py, "layer (module name)")
    _names(group, "count_stat", list(fmt.COUNT_STATS[1:]), h5py, "count")
    for name, dims in (("counts", ("step", "layer", "count_stat")),
                       *((("recording", ("step",)),) if "recording" in group else ())):
        _attach(group, name, dims)


def _describe_scalars(group, names: list[str], h5py) -> None:
    _names(group, "scalar", names, h5py, "logged scalar's name")
    _rows(group, fmt.SCALAR_COLUMNS, "row: one per step and logged name")
    group["value"].attrs["coordinates"] = "step name"


def _describe_tensor(group, table) -> None:
    data = group["data"]
    group.attrs["layer"], group.attrs["kind"] = _text(table_name(group)), table.kind
    for i, n in enumerate(data.shape[1:]):
        _scale(group, f"dim_{i}", np.arange(n), f"index along the tensor's axis {i}")
    _scale(group, "axis", np.arange(group["extent"].shape[1]), "tensor axis")
    data.attrs["coordinates"] = "step micro"
    _rows(group, ("step", "micro"), "row: one per step and micro-batch")
    _attach(group, "data", ("row", *(f"dim_{i}" for i in range(data.ndim - 1))))
    _attach(group, "extent", ("row", "axis"))


def _rows(group, columns: tuple[str, ...], long_name: str) -> None:
    """The ``row`` scale of a table of rows, attached to its ``columns`` (and
    ``recording``, where the table has it)."""
    _scale(group, "row", np.arange(group[columns[0]].shape[0]), long_name)
    for name in (*columns, "recording"):
        if name in group:
            _attach(group, name, ("row",))


def table_name(group) -> str:
    """A tensor table's layer, as its attributes name it (its group name is escaped)."""
    name = json.loads(group.attrs[JSON_ATTR]).get("name")
    return name if isinstance(name, str) else group.name.rsplit("/", 1)[-1]


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
