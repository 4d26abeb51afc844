"""A recorded run, opened lazily: ``open_run(path)`` reads attributes only."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import html
import itertools
from dataclasses import dataclass, field

import numpy as np
import xarray as xr

from recorder import format as fmt
from recorder.errors import ConfigError, LayerNotFoundError, RecorderError, StoreFormatError
from recorder.format import NonFiniteEvent

from ._source import open_source

__all__ = ["open_run", "Run", "NonFiniteEvent", "FirstNonFinite"]


@dataclass(frozen=True)
class FirstNonFinite(NonFiniteEvent):
    """The first non-finite capture, with its neighbourhood for a post-mortem."""
    history: xr.Dataset | None = field(default=None, compare=False, repr=False)
    same_step: tuple[NonFiniteEvent, ...] = field(default=(), compare=False, repr=False)

    def to_json(self) -> dict:
        """The event, the other events of its step, and the statistics before it
        (counts as integers, NaN as null)."""
        out = NonFiniteEvent(**{k: getattr(self, k) for k in NonFiniteEvent.__dataclass_fields__}).to_json()
        out["same_step"] = [e.to_json() for e in self.same_step]
        if self.history is not None:
            h = self.history
            out["history"] = [{"step": int(s), **{k: _plain(k, h[k].sel(step=s).item())
                                                  for k in fmt.STATS}} for s in h.step.values]
        return out


def _plain(name: str, v: float):
    if np.isnan(v):
        return None
    if np.isinf(v):
        return "inf" if v > 0 else "-inf"
    return int(v) if name in ("count", "nan", "posinf", "neginf") else float(v)


def _missing(layer: str, names: list[str], what: str) -> str:
    return f"layer {layer!r} has no {what} in this run; closest: {fmt.closest(layer, names)}"


def _as_slice(index):
    """A list of ascending consecutive indices as a slice (an int, a slice or any
    other list as it is)."""
    if isinstance(index, (int, np.integer, slice)):
        return index
    index = np.asarray(index, dtype=np.int64)
    if len(index) and np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return slice(int(index[0]), int(index[0]) + len(index))
    return index


def _data_chunks(extent: np.ndarray, chunks: tuple[int, ...], shape, n: int):
    """The chunk indices a data array's first ``n`` rows fill: in each block of
    rows, the chunks that its rows' extents reach (never beyond the array)."""
    for i in range(-(-n // chunks[0])):
        block = extent[i * chunks[0]: (i + 1) * chunks[0]]
        reach = block.max(axis=0) if len(block) else np.zeros(len(chunks) - 1, np.int64)
        counts = [min(-(-int(e) // c), -(-int(s) // c))
                  for e, c, s in zip(reach, chunks[1:], shape[1:])]
        for inner in itertools.product(*map(range, counts)):
            yield (i, *inner)


def open_run(path) -> "Run":
    """Open a run (Zarr store, fsspec URL, or HDF5 export) lazily; a ``Run`` is returned as is."""
    return path if isinstance(path, Run) else Run(path)



def _counts(raw):
    """A count statistic as stored (float64, lazy) as int64: -1 where the layer did
    not run at that step (NaN in the store), never a cast of NaN."""
    return np.where(np.isnan(raw), -1, raw).astype(np.int64)


def _with_range(h, st):
    """Histogram ``h`` with each step's true ``min`` and ``max`` (from ``st``) as coords."""
    return h.assign_coords(min=("step", st["min"].values.astype(float)),
                           max=("step", st["max"].values.astype(float)))


def within(obj, steps: slice | None):
    """``obj`` at the steps of the half-open slice ``steps`` (None: all)."""
    if steps is None:
        return obj
    have = obj.step.values
    keep = np.ones(len(have), bool)
    if steps.start is not None:
        keep &= have >= steps.start
    if steps.stop is not None:
        keep &= have < steps.stop
    if not keep.any():
        raise ConfigError(f"no steps in {steps.start}:{steps.stop}; the run has {steps_text(have)}")
    return obj.isel(step=np.nonzero(keep)[0])


def steps_text(steps) -> str:
    """Steps in words: ``steps 0-39 (40)``, ``4 steps (0, 10, 20, 30)``, ``no steps``."""
    steps = [int(x) for x in steps]
    if not steps:
        return "no steps"
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]} ({len(steps)})"
    shown = ", ".join(map(str, steps[:6])) + (f", ..., {steps[-1]}" if len(steps) > 6 else "")
    return f"{len(steps)} step{'s' if len(steps) > 1 else ''} ({shown})"

class Run:
    """A recorded run.  ``source`` is the store as read (attributes and arrays),
    ``state(rank)`` a rank's committed state; the methods below are the API."""

    MAX_ROW_BYTES = 1 << 36          # one step of one tensor: 64 GiB at the most

    def __init__(self, path):
        self.path = str(path)
        try:
            self._open()
        except RecorderError:
            raise
        except Exception as e:           # anything else a damaged or hostile store raises
            raise StoreFormatError(f"{self.path!r} cannot be read as a tensortape store "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                                   ) from e
        self._valid: set[str] = set()
        self._current: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

    def _open(self) -> None:
        self.source = open_source(self.path)
        attrs = self.source.attrs()
        if not isinstance(attrs, dict):
            raise StoreFormatError(f"{self.path!r}: its root attributes are not a JSON object")
        version = attrs.get("tensortape_format")
        if version is None:
            raise StoreFormatError(f"{self.path!r} is not a tensortape store (no "
                                   f"'tensortape_format' attribute); pass a recorded run")
        if version not in fmt.READS_VERSIONS:
            raise StoreFormatError(f"{self.path!r} has format version {version!r}, newer than "
                                   f"this tensortape reads ({fmt.FORMAT_VERSION}); upgrade tensortape")
        self.attrs = attrs
        if not isinstance(attrs.get("status", ""), str) or not isinstance(attrs.get("layers", []), list):
            raise StoreFormatError(f"{self.path!r}: its 'status' or 'layers' attribute has the "
                                   f"wrong type")
        self.ranks = sorted(int(g[4:]) for g in self.source.groups() if g.startswith("rank") and g[4:].isdigit())
        self._states = {r: fmt.RankState.from_json(self.source.attrs(fmt.rank_group(r)),
                                                   f"{self.path!r} rank {r}") for r in self.ranks}
        for r, st in self._states.items():          # the group says which rank an event is
            st.events = [dataclasses.replace(e, rank=r) for e in st.events]

    # --- what is in the run -----------------------------------------------------
    def only(self, rank: int) -> "Run":
        """The run as ``rank`` recorded it: a view with that one rank (what the
        comparisons and the pictures read)."""
        rank = self._rank(rank)
        view = copy.copy(self)
        view.ranks, view._states = [rank], {rank: self._states[rank]}
        return view

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            if not self.ranks:           # killed while attaching: an empty run, not an error
                self._states.setdefault(0, fmt.RankState())
                return 0
            return self.ranks[0]
        if rank not in self.ranks:
            raise ConfigError(f"rank {rank} is not in this run; its ranks are {self.ranks}")
        return rank

    def state(self, rank: int | None = None) -> fmt.RankState:
        """What a rank committed: row counts per table, layers, events, counters."""
        return self._states[self._rank(rank)]

    def _committed(self, rank: int) -> dict[str, int]:
        return self._states[rank].committed

    def columns(self, path: str) -> tuple[str, ...]:
        """The arrays of the table at ``path`` as its format wrote them."""
        table = fmt.parse_path(path)
        if table.section == "stats" and not self.source.has(f"{path}/stats"):
            return fmt.STATS_COLUMNS_V2            # formats 1 and 2: an array per statistic
        if self.source.has(f"{path}/{fmt.RECORDING}"):     # a resumed recording appended to it
            return (*table.columns, fmt.RECORDING)
        return table.columns

    def _rows_of(self, path: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The committed rows of a table that a reader reads, and every row's step:
        of each step, only the rows of the latest recording that recorded it (a job
        resumed with mode="a" from an earlier checkpoint records steps again;
        ``fmt.current_rows``).  Read once: a ``Run`` reads the committed rows of
        when it was opened."""
        got = self._current.get((rank, path))
        if got is None:
            got = self._current[(rank, path)] = self._read_rows(path, rank)
        return got

    def _read_rows(self, path: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.checked_rows(path, rank)
        steps = np.asarray(self.source.array(path + "/step")[:n]) if n else np.zeros(0, np.int64)
        runs = self._states[rank].rerecorded
        recordings = None
        if runs:
            recordings = np.asarray(self.source.array(f"{path}/{fmt.RECORDING}")[:n]) \
                if self.source.has(f"{path}/{fmt.RECORDING}") else np.zeros(n, np.int64)
        return fmt.current_rows(steps, recordings, runs), steps

    def checked_rows(self, path: str, rank: int) -> int:
        """A table's committed rows, once its arrays are checked against them: each
        array is there, holds the committed rows, and a row has a sane size."""
        n = self._committed(rank).get(path, 0)
        if path in self._valid or not n:
            return n
        table = fmt.parse_path(path)
        try:
            arrays = {}
            for name in self.columns(path):
                if name in fmt.OPTIONAL_COLUMNS and not self.source.has(f"{path}/{name}"):
                    continue
                arr = arrays[name] = self.source.array(f"{path}/{name}")
                shape = tuple(int(s) for s in arr.shape)
                if not shape or shape[0] < n:
                    raise StoreFormatError(f"{self.path!r}: {path}/{name} holds "
                                           f"{shape[0] if shape else 0} rows, fewer than the "
                                           f"{n} committed")
                if np.dtype(arr.dtype).name not in fmt.STORED_DTYPES:
                    raise StoreFormatError(f"{self.path!r}: {path}/{name} holds {arr.dtype}, "
                                           f"which tensortape never writes; refusing to decode it")
                row = int(np.prod(shape[1:], dtype=object)) * np.dtype(arr.dtype).itemsize
                if row > self.MAX_ROW_BYTES:
                    raise StoreFormatError(f"{self.path!r}: {path}/{name} claims {row} bytes a "
                                           f"row; refusing to read it")
            if table.section == "stats":
                width = int(arrays["stats" if "stats" in arrays else "mean"].shape[1])
                if width < len(self._states[rank].stats_layers.get(table.kind, [])):
                    raise StoreFormatError(f"{self.path!r}: {path} has {width} layer columns, "
                                           f"fewer than its layer names")
            self._check_chunks(path, arrays, n)
        except RecorderError:
            raise
        except Exception as e:
            raise StoreFormatError(f"{self.path!r}: table {path} cannot be read "
                                   f"({type(e).__name__}: {e})") from e
        self._valid.add(path)
        return n

    def _check_chunks(self, path: str, arrays: dict, n: int) -> None:
        """A table's extents fit its data; and in a table that stores every chunk
        (``fmt.EVERY_CHUNK``), each chunk its first ``n`` rows need is there (a
        half-copied store is refused, not read as NaN).  Each chunk read is checked
        by the source itself (a regular file of a sane size)."""
        data = arrays.get("data")
        extent = None
        if data is not None and data.ndim > 1:
            extent = np.asarray(arrays["extent"][:n])[:, : data.ndim - 1]
            if extent.size and ((extent < 0) | (extent > np.array(data.shape[1:]))).any():
                raise StoreFormatError(f"{self.path!r}: {path}/extent claims a tensor larger "
                                       f"than {path}/data holds")
        if not self.source.attrs(path).get(fmt.EVERY_CHUNK):
            return
        for name, arr in arrays.items():
            if name == fmt.RECORDING:    # given to a table with committed rows, which are all
                continue                 # recording 0's: a chunk not yet written reads as 0
            # the objects of a sharded array are its shards
            chunks = tuple(int(c) for c in (getattr(arr, "shards", None) or arr.chunks))
            if name == "data" and extent is not None:
                need = _data_chunks(extent, chunks, arr.shape, n)
            else:                        # the first chunk across of each block of rows
                need = ((i, *(0,) * (len(chunks) - 1)) for i in range(-(-n // chunks[0])))
            missing = self.source.missing_chunk(f"{path}/{name}",
                                                ("c/" + "/".join(map(str, i)) for i in need))
            if missing is not None:
                raise StoreFormatError(f"{self.path!r}: chunk {path}/{name}/{missing} of the "
                                       f"committed rows is missing; the store is incomplete "
                                       f"(a partial copy?)")

    @property
    def status(self) -> str:
        return self.attrs.get("status", "unknown")

    @property
    def config(self) -> dict:
        return self.attrs.get("config", {})

    @property
    def metadata(self) -> dict:
        return self.attrs.get("metadata", {})

    @property
    def dropped(self) -> int:
        """Captures dropped (counted with their reasons), every rank's."""
        if not self._states:
            return int(self.attrs.get("dropped", 0))
        return sum(st.dropped for st in self._states.values())

    def layers_of(self, rank: int | None = None) -> list[str]:
        return list(self.state(rank).layers)

    @property
    def layers(self) -> list[str]:
        return self.layers_of()

    def kinds_of(self, rank: int | None = None) -> list[str]:
        found = {fmt.parse_path(p).kind for p, n in self.state(rank).committed.items() if n}
        return [k for k in fmt.KINDS if k in found]

    @property
    def kinds(self) -> list[str]:
        return self.kinds_of()

    def _kind(self, kind: str, rank: int) -> str:
        if kind not in self.kinds_of(rank):
            raise ConfigError(f"kind {kind!r} was not recorded in this run; recorded kinds: "
                              f"{', '.join(self.kinds_of(rank)) or 'none'}")
        return kind

    def _tensor_paths(self, kind: str, rank: int) -> dict[str, str]:
        """Layer name -> table path of the full tensors of one kind (not those whose
        every row is of steps that a later recording recorded again)."""
        out = {}
        again = bool(self._states[rank].rerecorded)
        for p, n in self._committed(rank).items():
            t = fmt.parse_path(p)
            if n and t.section == "tensors" and t.kind == kind:
                if again and not len(self._rows_of(p, rank)[0]):
                    continue
                name = self.source.attrs(p).get("name", t.node)
                out[name if isinstance(name, str) else t.node] = p
        return out

    def tensor_layers(self, kind: str = "activations", rank: int | None = None) -> list[str]:
        """The layers of ``kind`` that hold full tensors, in execution order."""
        rank = self._rank(rank)
        if kind not in self.kinds_of(rank):
            return []
        found = self._tensor_paths(kind, rank)
        order = {n: i for i, n in enumerate(self.layers_of(rank))}
        return sorted(found, key=lambda n: order.get(n, len(order)))

    def _tensor_path(self, layer: str, kind: str, rank: int) -> str:
        paths = self._tensor_paths(self._kind(kind, rank), rank)
        if layer not in paths:
            raise LayerNotFoundError(_missing(layer, list(paths), f"full {kind} tensors"))
        return paths[layer]

    def steps(self, kind: str = "activations", tensors: bool = False, rank: int | None = None,
              layer: str | None = None) -> np.ndarray:
        """Steps that hold statistics (or, with ``tensors=True``, full tensors)."""
        rank = self._rank(rank)
        self._kind(kind, rank)
        if not tensors:
            return self._stats_rows(kind, rank)[2]
        paths = [self._tensor_path(layer, kind, rank)] if layer else self._tensor_paths(kind, rank).values()
        found = [steps[rows] for rows, steps in (self._rows_of(p, rank) for p in paths)]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)

    # --- statistics and histograms ------------------------------------------------
    def _stats_rows(self, kind: str, rank: int) -> tuple[str, np.ndarray, np.ndarray]:
        """The stats table's path, its rows to read (the latest recording of each
        step, in step order) and their steps."""
        path = fmt.stats_group(rank, kind)
        current, steps = self._rows_of(path, rank)
        rows = current[fmt.latest_rows(steps[current])]
        return path, rows, steps[rows]

    def _stats_layers(self, kind: str, rank: int) -> list[str]:
        return list(self._states[rank].stats_layers.get(kind, []))

    @staticmethod
    def _select(names: list[str], layers, strict: bool = True) -> list[int]:
        """The columns of ``names`` that ``layers`` (glob patterns) match; ``strict``:
        each pattern must match one of them (not so for one rank of several, whose
        patterns may match another rank's layers: a pipeline stage elsewhere)."""
        if layers is None:
            return list(range(len(names)))
        if strict:
            chosen = set(fmt.match_layers(names, layers, what="layer with statistics"))
        else:
            patterns = [layers] if isinstance(layers, str) else list(layers)
            chosen = {n for n in names if any(n == p or fnmatch.fnmatchcase(n, p)
                                              for p in patterns)}
        return [i for i, n in enumerate(names) if n in chosen]

    def _across(self, rank: int | None, one, kind: str, holds=None):
        """``one(rank)`` for the rank asked, or, for a run of several ranks and no
        rank asked, every rank's (those that have ``kind``) joined along a ``rank``
        dimension: steps and layers are the union; what a rank did not record (a
        rank where ``holds(rank)`` is false: nothing asked for) is NaN, and -1 for
        counts, as where a layer did not run."""
        if rank is not None or len(self.ranks) < 2:
            return one(rank)
        ranks = [r for r in self.ranks if kind in self.kinds_of(r)]
        if not ranks:
            self._kind(kind, self.ranks[0])
        held = [r for r in ranks if holds is None or holds(r)] or ranks[:1]
        parts = [one(r) for r in held]
        like = parts[0]
        parts = [p.drop_attrs() for p in parts]
        counts = list(fmt.COUNT_STATS)
        if isinstance(like, xr.DataArray):        # a histogram: its NaN/Inf counts per rank too
            counts = ["hist", *(k for k in fmt.COUNT_STATS[1:] if k in like.coords)]
            parts = [p.to_dataset(name="hist").reset_coords(counts[1:]) for p in parts]
        fill = dict.fromkeys(counts, -1)
        out = xr.concat(parts, dim=xr.DataArray(held, dims="rank", name="rank"), join="outer",
                        fill_value=fill, coords="minimal", compat="override")
        if held != ranks:
            out = out.reindex(rank=ranks, fill_value=fill)
        if isinstance(like, xr.DataArray):
            out = out.set_coords(counts[1:])["hist"].rename(like.name)
        out.attrs.update(like.attrs)
        out.attrs.pop("rank", None)
        return out

    def stats(self, kind: str = "activations", layers=None, rank: int | None = None) -> xr.Dataset:
        """Per-step statistics: an ``xr.Dataset`` with dims (step, layer), one
        variable per statistic (lazy; counts are int64).

        kind: one of ``run.kinds``.  layers: a glob pattern or list of them
        (default: every layer with statistics).  rank: one rank's; by default,
        in a run of several ranks, every rank's along a ``rank`` dimension
        (each read only when its values are)."""
        if rank is not None or len(self.ranks) < 2 or layers is None:
            return self._across(rank, lambda r: self._stats(kind, layers, r), kind)
        # every pattern matches a layer of some rank; a rank is read where one does
        held = [r for r in self.ranks if kind in self.kinds_of(r)]
        fmt.match_layers(list(dict.fromkeys(n for r in held for n in self._stats_layers(kind, r))),
                         layers, what="layer with statistics on any rank")
        return self._across(rank, lambda r: self._stats(kind, layers, r, strict=False), kind,
                            lambda r: bool(self._select(self._stats_layers(kind, r), layers,
                                                        strict=False)))

    def _stats(self, kind: str, layers, rank: int | None, strict: bool = True) -> xr.Dataset:
        rank = self._rank(rank)
        self._kind(kind, rank)
        path, rows, steps = self._stats_rows(kind, rank)
        names = self._stats_layers(kind, rank)
        idx = self._select(names, layers, strict)
        data = {}
        for s in fmt.STATS:
            dtype = np.int64 if s in fmt.COUNT_STATS else np.float64
            if not len(rows):                  # full tensors of this kind, no statistics yet
                data[s] = (("step", "layer"), np.zeros((0, len(idx)), dtype))
                continue
            raw = self._stat(path, s, rows, idx)
            data[s] = (("step", "layer"), _counts(raw) if s in fmt.COUNT_STATS else raw.astype(dtype))
        ds = xr.Dataset(data, coords={"step": steps, "layer": [names[i] for i in idx]})
        ds.attrs.update(kind=kind, rank=rank)
        return ds

    def histogram(self, layer: str, kind: str = "activations", step=None,
                  rank: int | None = None) -> xr.DataArray:
        """Counts in the shared bins: dims (step, bin); ``bin`` holds each bin's centre
        (what ``.plot()`` uses), ``bin_lo``/``bin_hi`` its edges; ``nan``, ``posinf``
        and ``neginf`` per step.  In a run of several ranks and no ``rank`` asked,
        every rank's along a ``rank`` dimension (-1: not recorded there).  At a step
        where the layer did not run (an expert with no tokens), every count is -1."""
        if rank is None and len(self.ranks) > 1:
            held = [r for r in self.ranks if kind in self.kinds_of(r)]
            names = list(dict.fromkeys(n for r in held for n in self._stats_layers(kind, r)))
            if held and layer not in names:
                raise LayerNotFoundError(_missing(layer, names, f"{kind} statistics on any rank"))
        return self._across(rank, lambda r: self._histogram(layer, kind, step, r), kind,
                            lambda r: layer in self._stats_layers(kind, r))

    def _histogram(self, layer: str, kind: str, step, rank: int | None) -> xr.DataArray:
        rank = self._rank(rank)
        self._kind(kind, rank)
        path = fmt.stats_group(rank, kind)
        names = self._stats_layers(kind, rank)
        if layer not in names:
            raise LayerNotFoundError(_missing(layer, names, f"{kind} statistics"))
        i = names.index(layer)
        path, rows, steps = self._stats_rows(kind, rank)
        lo, hi = fmt.bin_edges()
        counts = self._lazy(path + "/hist")[_as_slice(rows), i]     # one indexing: one read
        absent = np.isnan(self._stat(path, "count", rows, i))       # the layer did not run
        counts = np.where(absent[:, None], -1, counts)
        out = xr.DataArray(counts, dims=("step", "bin"),
                           coords={"step": steps, "bin": fmt.bin_centers(),
                                   "bin_lo": ("bin", lo), "bin_hi": ("bin", hi)},
                           name=f"{layer} {kind}", attrs={"layer": layer, "kind": kind})
        for s in ("nan", "posinf", "neginf"):
            out.coords[s] = ("step", _counts(self._stat(path, s, rows, i)))
        if step is not None:
            if step not in set(steps.tolist()):
                raise ConfigError(f"step {step} has no statistics for {layer!r}; it has "
                                  f"{steps_text(steps)}")
            out = out.sel(step=step)
        return out

    def _stat(self, path: str, stat: str, rows: np.ndarray, cols):
        """One statistic of a stats table at ``rows`` and layer columns ``cols`` (a
        list of column indices, or one), lazy: from the packed array (format 3), or
        its own array (formats 1 and 2).  Ranges are sliced in one indexing, which
        dask folds into the read: only the chunks they touch are read."""
        rows, cols = _as_slice(rows), _as_slice(cols)
        packed = self.source.has(f"{path}/stats")
        arr = self._lazy(f"{path}/stats" if packed else f"{path}/{stat}")
        at = (fmt.STATS.index(stat),) if packed else ()
        if isinstance(rows, slice) or isinstance(cols, (slice, int)):
            return arr[(rows, cols, *at)]
        return arr[rows][(slice(None), cols, *at)]

    # --- full tensors --------------------------------------------------------------
    def _lazy(self, path: str):
        """A lazy dask array of a store array (``path``: a table's column), chunked
        like it (dask loads here: commands that only read attributes start faster).

        Its name says what it holds: the run (its path and when it was created),
        the table's committed rows and the array's shape.  A live run's last chunk
        changes as rows are committed, and a run recorded again at its path holds
        other values: a later read of either gets a new name, so a cluster that
        holds an earlier read's results (``persist``) never serves them for it."""
        import dask.array as da
        from dask.base import tokenize
        arr = self.source.array(path)
        # a sharded array: a task spans a shard's steps and an inner chunk across (the
        # graph of a long run stays small; a task reads at most a column of inner chunks)
        chunks = getattr(arr, "chunks", None) or arr.shape
        shards = getattr(arr, "shards", None)
        if shards:
            chunks = (shards[0], *chunks[1:])
        table = path.rsplit("/", 1)[0]
        rows = self._committed(fmt.parse_path(table).rank).get(table, 0)
        token = tokenize(self.attrs.get("created"), rows, tuple(arr.shape))
        return da.from_array(arr, chunks=chunks, lock=self.source.lock,
                             name=f"{self.path}:{path}-{token}")

    def tensor(self, layer: str, kind: str = "activations", step=None, micro: int | None = None,
               rank: int | None = None) -> xr.DataArray:
        """Full tensors: lazy (step, dim_0, ...), floats NaN-padded; the true extent of
        each step along ``dim_i`` is the integer coordinate ``extent_dim_i`` (step).

        With ``step=s``, that one step at its true shape.  Steps with several
        micro-batches hold a tensor for each: ``micro=k`` picks one (``None``: 0, the
        micro-batch every step has).
        A step recorded again (a job resumed with mode="a") gives its latest
        recording, whole: none of an older recording's micro-batches.
        """
        rank = self._rank(rank)
        path = self._tensor_path(layer, kind, rank)
        n = self.checked_rows(path, rank)
        current, steps = self._rows_of(path, rank)
        micros = np.asarray(self.source.array(path + "/micro")[:n]) \
            if self.source.has(path + "/micro") else np.zeros(n, np.int64)
        m = 0 if micro is None else int(micro)
        mine = current[micros[current] == m]
        rows = mine[fmt.latest_rows(steps[mine])]
        if not len(rows):
            raise ConfigError(f"no full {kind} tensor of {layer!r} has micro-batch {m}; "
                              f"micro-batches recorded: {sorted(set(micros[current].tolist()))}")
        steps, extent = steps[rows], np.asarray(self.source.array(path + "/extent")[:n])[rows]
        data = self._lazy(path + "/data")[:n][_as_slice(rows)]
        logical = dict(self.source.array(path + "/data").attrs).get(fmt.LOGICAL_ATTR)
        if logical in fmt.BITS_DTYPES:
            data = data.map_blocks(fmt.decode_bits, logical, dtype=np.float32)
        dims = ("step", *(f"dim_{i}" for i in range(data.ndim - 1)))
        extent = extent[:, : data.ndim - 1].astype(np.int64)
        coords = {"step": steps, **{f"extent_{d}": ("step", extent[:, j])
                                    for j, d in enumerate(dims[1:])}}
        out = xr.DataArray(data, dims=dims, coords=coords, name=f"{layer} {kind}",
                           attrs={"layer": layer, "kind": kind, "micro": m})
        if step is None:
            return out
        hits = np.nonzero(steps == step)[0]
        if not hits.size:
            raise ConfigError(f"step {step} has no full {kind} tensor for {layer!r}"
                              f"{f' (micro-batch {m})' if m else ''}; it has full tensors at "
                              f"{steps_text(steps)}")
        row = out.isel(step=int(hits[0]))
        return row.isel({d: slice(0, int(e)) for d, e in zip(dims[1:], extent[hits[0]])}).compute()

    # --- non-finite values -----------------------------------------------------------
    def events_of(self, rank: int | None = None) -> list[NonFiniteEvent]:
        """One rank's events, or with ``rank=None`` every rank's, ordered by step, then
        forward before backward, then execution order (then rank)."""
        ranks = self.ranks if rank is None else [self._rank(rank)]
        return sorted((e for r in ranks for e in self._states[r].events), key=lambda e: e.sort_key)

    @property
    def events(self) -> list[NonFiniteEvent]:
        """Every rank's events (each names its ``rank``), in order."""
        return self.events_of()

    def first_nonfinite(self, rank: int | None = None, history: int = 5) -> FirstNonFinite | None:
        """The earliest non-finite capture across every rank (or of ``rank``): by
        step, then forward before backward, then execution order; it names its
        rank, and ``same_step`` holds the other events of that step."""
        evs = self.events_of(rank)
        if not evs:
            return None
        first = evs[0]
        rank = first.rank
        hist = None
        if first.kind in self.kinds_of(rank) and first.layer in self._stats_layers(first.kind, rank):
            ds = self.stats(first.kind, layers=[first.layer], rank=rank).isel(layer=0)
            hist = ds.sel(step=ds.step[ds.step <= first.step][-(history + 1):]).compute()
        same = tuple(e for e in evs if e.step == first.step and e is not first)
        return FirstNonFinite(**{k: getattr(first, k) for k in first.__dataclass_fields__},
                              history=hist, same_step=same)

    def replay(self, model, rank: int | None = None) -> dict:
        """Repeat the recorded replay (``on_nonfinite="replay"``) in ``model``, a
        model the user builds (the same architecture): its submodule at the
        bundle's path gets the recorded parameters and buffers, and the call runs
        again on the recorded inputs (and output gradients, for a NaN made in
        backward) under the same op check.  What it found, as the event's
        ``replay``.  Step through ``model`` in a debugger to see it happen."""
        import contextlib

        import torch

        from recorder import _replay
        hits = [e for e in self.events_of(rank) if e.replay and e.replay.get("bundle")]
        if not hits:
            raise ConfigError(f"{self.path!r} holds no replay bundle; record with "
                              f"on_nonfinite='replay' (a bundle is stored when a replay names "
                              f"an op)")
        path = hits[0].replay["bundle"]
        attrs = self.source.attrs(path)

        def arrays(name: str):
            arr = self.source.array(f"{path}/{fmt.node_name(name)}")
            if np.dtype(arr.dtype).name not in fmt.STORED_DTYPES:
                raise StoreFormatError(f"{self.path!r}: {path}/{name} holds {arr.dtype}")
            data = np.asarray(arr[...])
            logical = dict(arr.attrs).get(fmt.LOGICAL_ATTR)
            t = torch.from_numpy(data.copy())
            return t.view(getattr(torch, logical)) if logical in fmt.BITS_DTYPES else t
        call = _replay.from_bundle(attrs, arrays, model)
        return _replay.replay(call, contextlib.nullcontext,
                              backward=attrs.get("phase") == "backward")

    # --- plots and export ------------------------------------------------------------
    def plot_histogram(self, layer, kind="activations", steps=None, rank=None, ax=None,
                       density: bool = False):
        """Histogram of ``layer`` at some steps (an int or a list; default: the last
        with finite values) over values: bars of the bins' true widths on a
        symmetric-log axis, NaN/+Inf/-Inf as their own bars -> Figure.
        ``density``: counts per unit of value instead of counts per bin."""
        rank = self._rank(rank)                  # one rank's picture (default: the first)
        from . import _plots
        h = self.histogram(layer, kind, rank=rank).compute()
        st = self.stats(kind, [layer], rank=rank).isel(layer=0).compute()
        return _plots.histogram(_with_range(h, st), steps, ax, density=density)

    def plot_evolution(self, layers=None, kind="activations", stat="std", rank=None, ax=None,
                       steps: slice | None = None):
        """One statistic over the steps (``steps``: a slice of step numbers, half-open;
        default all), a line per layer (small multiples past 6 layers), each layer's
        NaN/Inf steps marked with their counts -> Figure."""
        rank = self._rank(rank)                  # one rank's picture (default: the first)
        from . import _plots
        ds = within(self.stats(kind, layers, rank=rank), steps)
        if stat not in ds:
            raise ConfigError(f"stat {stat!r} is not recorded; use one of {', '.join(ds.data_vars)}")
        return _plots.evolution(ds.compute().assign_attrs(run=self.name), stat, ax)

    def plot_distribution(self, layer, kind="activations", rank=None, ax=None,
                          steps: slice | None = None):
        """Step x value picture of ``layer``'s histogram (``steps``: a half-open slice of
        step numbers; default all): bands from the true min and max and the
        percentiles, the median, NaN/Inf counts below -> Figure."""
        rank = self._rank(rank)                  # one rank's picture (default: the first)
        from . import _plots
        h = within(self.histogram(layer, kind, rank=rank), steps).compute()
        st = within(self.stats(kind, [layer], rank=rank), steps).isel(layer=0)
        return _plots.distribution(_with_range(h, st), ax)

    @property
    def name(self) -> str:
        """The run's short name: the last part of its path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1] or self.path

    def to_hdf5(self, path, progress=None) -> str:
        from ._export import to_hdf5
        return to_hdf5(self, path, progress=progress)

    def _tensor_bytes(self, path: str, rank: int) -> int:
        """Bytes of one table's full tensors as decoded (committed rows, padded shape)."""
        data = self.source.array(path + "/data")
        return self._committed(rank)[path] * int(np.prod(data.shape[1:])) * data.dtype.itemsize

    def disk_bytes(self) -> int:
        """The store's size where it lies (a local path or any fsspec URL)."""
        import fsspec
        fs, root = fsspec.core.url_to_fs(self.path)
        return int(fs.du(root, total=True)) if fs.isdir(root) else int(fs.size(root))

    # --- display -------------------------------------------------------------------
    def summary(self, rank: int | None = None) -> dict:
        """What the run holds, as plain JSON-able values (``tensortape info``): the
        layers and steps of ``rank`` (default: the first), and, with no rank
        asked, the events and counters of every rank, with a line per rank."""
        every = rank is None and len(self.ranks) > 1
        rank = self._rank(rank)
        kinds = self.kinds_of(rank)
        stats_layers = {k: set(self._stats_layers(k, rank)) for k in kinds}
        tensor_paths = {k: self._tensor_paths(k, rank) for k in kinds}
        layers = {layer: {k: {"stats": layer in stats_layers[k],
                              "tensor_bytes": self._tensor_bytes(tensor_paths[k][layer], rank)
                              if layer in tensor_paths[k] else None} for k in kinds}
                  for layer in self.layers_of(rank)}
        steps = {}
        for k in kinds:
            s = self.steps(k, rank=rank)
            steps[k] = {"count": len(s), "first": int(s[0]) if len(s) else None,
                        "last": int(s[-1]) if len(s) else None,
                        "tensor_steps": len(self.steps(k, tensors=True, rank=rank))
                        if tensor_paths[k] else 0}
        return {"path": self.path, "status": self.status, "format": self.attrs.get("tensortape_format"),
                "model_class": self.attrs.get("model_class"),
                "torch_version": self.attrs.get("torch_version"), "ranks": self.ranks,
                "rank": rank, "kinds": kinds, "steps": steps, "layers": layers,
                "events": [e.to_json() for e in self.events_of(None if every else rank)],
                **self._counters([r for r in self.ranks if every or r == rank]),
                "per_rank": [{"rank": r, "last_step": self._states[r].last_step,
                              **self._counters([r])} for r in self.ranks] if every else None}

    def _counters(self, ranks: list[int]) -> dict:
        return {k: sum(getattr(self._states[r], k) for r in ranks)
                for k in ("events_total", "dropped", "outside_steps", "over_budget", "bytes_raw")}

    def __repr__(self) -> str:
        s = self.summary()
        lines = [f"<tensortape Run {self.path!r} status={s['status']} ranks={s['ranks']}>"]
        for k, v in s["steps"].items():
            lines.append(f"  {k}: " + (f"steps {v['first']}..{v['last']} ({v['count']} with "
                                       f"statistics)" if v["count"] else "no statistics"))
        lines.append(f"  {len(s['layers'])} layers: " + ", ".join(list(s["layers"])[:6])
                     + (" ..." if len(s["layers"]) > 6 else ""))
        ev = s["events"]
        lines.append(f"  {s['events_total']} non-finite events" + (
            f", first at step {ev[0]['step']} in {ev[0]['layer']!r} ({ev[0]['kind']})" if ev else ""))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from dask.utils import format_bytes
        s = self.summary()
        head = "".join(f"<th>{html.escape(k)}</th>" for k in s["kinds"])
        cell = lambda m: ("S" if m["stats"] else "") + (  # noqa: E731
            f" T {format_bytes(m['tensor_bytes'])}" if m["tensor_bytes"] is not None else "")
        rows = "".join(f"<tr><td>{html.escape(layer)}</td>" + "".join(
            f"<td>{cell(v[k])}</td>" for k in s["kinds"]) + "</tr>"
            for layer, v in list(s["layers"].items())[:200])
        ev = s["events"]
        return (f"<div><b>tensortape run</b> <code>{html.escape(self.path)}</code> — status "
                f"<b>{html.escape(s['status'])}</b>, {s['events_total']} non-finite events"
                + (f" (first: step {ev[0]['step']}, {html.escape(ev[0]['layer'])}, "
                   f"{ev[0]['kind']})" if ev else "")
                + f"<table><tr><th>layer</th>{head}</tr>{rows}</table>"
                "<small>S = statistics, T = full tensors (their size decoded)</small></div>")
