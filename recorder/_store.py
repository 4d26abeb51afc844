"""The Zarr v3 store: tables of rows keyed by step, written in whole chunks.

Runs on the writer thread (and its pool of write threads).

A *table* is one zarr group whose arrays (columns) share a leading ``step``
dimension: the statistics of one kind, or the full tensors of one
(kind, layer).  Rows are buffered per column until a chunk is whole, and a
chunk is written whole (a partial one is padded with the fill value and
written at a flush, then written again when it fills).  A sharded array's
chunk write rewrites its whole shard (zarr reads, merges and replaces it), so
each array has a ``Lane``: one write in flight at a time, in order, while
different arrays write in parallel.  Capacity grows in blocks; a reader trusts
only the committed row counts that ``commit`` writes into the rank group's
attributes *after* every write they count has finished.
"""

from __future__ import annotations

import collections
import errno
import json
import math
import os
import shutil
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from numcodecs import Zstd
from zarr.codecs import Crc32cCodec, ZstdCodec

from . import format as fmt
from ._quiet import quiet
from .errors import ConfigError, StoreExistsError, StoreFormatError, StoreNotFoundError

__all__ = ["RunStore", "check_mode", "open_root"]

CHUNK_BYTES = 8 << 20          # target size of one data chunk, uncompressed
SMALL_CHUNK_ROWS = 1024        # rows per chunk of small columns (step, extent)
STATS_CHUNK_ROWS = 1024      # format 3: statistics (step, layer, stat) in shards of 1024
LAYER_CHUNK = 256            # steps x 256 layers x every statistic, whose inner chunks are
STATS_LAYER_CHUNK = 16       # one statistic of 16 layers (a layer's evolution reads little);
HIST_SHARD_ROWS = 256        # histograms in shards of 256 steps x 256 layers, whose inner
                             # chunks are 16 steps x 8 layers
HIST_CHUNK_ROWS = 16
HIST_LAYER_CHUNK = 8
SAMPLE_BYTES = 1 << 20         # how much of a tensor's first step picks its zstd level
PAYS = 0.9                     # level 1 if it makes that sample at least 10% smaller


@dataclass(frozen=True)
class Found:
    """What a store location holds: ``"missing"``, ``"empty"`` (a folder or prefix
    with nothing in it but a claim or a killed start's temporary file), ``"run"`` (a
    tensortape store and nothing else: ``own`` lists its entries) or ``"other"``
    (``detail`` says what).  ``claimed``: a job's claim (``tensortape.lock``) is there,
    live or not."""
    what: str
    detail: str = ""
    own: tuple[str, ...] = ()
    claimed: bool = False


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _is_run(raw: bytes | None) -> bool:
    try:
        return "tensortape_format" in json.loads(raw)["attributes"]
    except Exception:
        return False


def _classify(entries: list[str], ours: set[str], root_json: bytes | None) -> Found:
    """A location's entries -> what it holds (``ours``: the entries tensortape may
    have written: ``zarr.json``, and rank groups and the claim that are real folders)."""
    claimed = fmt.CLAIM_NAME in ours
    if all(fmt.is_partial(e) or (e == fmt.CLAIM_NAME and claimed) for e in entries):
        return Found("empty", claimed=claimed)      # nothing, or a start claimed or killed
    if not _is_run(root_json):
        return Found("other", f"holds files that are not a tensortape run ({_shown(entries)})")
    theirs = [e for e in entries if e not in ours]
    if theirs:
        return Found("other", f"holds a tensortape run with other files beside it ({_shown(theirs)})")
    return Found("run", own=tuple(entries), claimed=claimed)


def _look_local(path: str) -> Found:
    if os.path.islink(path) and not os.path.exists(path):
        return Found("other", "is a broken symbolic link")
    if not os.path.exists(path):
        return Found("missing")
    if not os.path.isdir(path):
        return Found("other", "is a file")
    real, cwd = os.path.realpath(path), os.path.realpath(os.getcwd())
    if real == cwd:
        return Found("other", "is the current directory")
    if cwd.startswith(real.rstrip(os.sep) + os.sep):
        return Found("other", "is a folder that holds the current directory")
    if real == os.path.realpath(os.path.expanduser("~")):
        return Found("other", "is your home directory")
    entries = sorted(os.listdir(path))
    ours = {e for e in entries if fmt.is_own_entry(e) and not os.path.islink(os.path.join(path, e))
            and os.path.isdir(os.path.join(path, e)) == (e != "zarr.json" and not fmt.is_partial(e))}
    root_json = None
    if "zarr.json" in ours:
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            root_json = f.read(1 << 20)
    return _classify(entries, ours, root_json)


def _look_url(location: str) -> Found:
    import fsspec
    fs, root = fsspec.core.url_to_fs(location)
    root = root.rstrip("/")
    fs.invalidate_cache()
    if fs.isfile(root):
        return Found("other", "is an object (a file)")
    try:
        listed = fs.ls(root, detail=True)
    except FileNotFoundError:
        return Found("missing")
    kinds = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type") for e in listed}
    # an object store has no folders: a "directory" that holds no object is nothing
    entries = sorted(n for n, t in kinds.items()
                     if t != "directory" or fmt.is_own_entry(n) or fs.find(f"{root}/{n}"))
    if not entries:
        return Found("missing")
    ours = {e for e in entries if fmt.is_own_entry(e)
            and (kinds[e] == "directory") == (e != "zarr.json" and not fmt.is_partial(e))}
    root_json = fs.cat(f"{root}/zarr.json") if "zarr.json" in ours else None
    return _classify(entries, ours, root_json)


def look(location) -> Found:
    """What is at a store location (a local path or an fsspec URL)."""
    location = os.fspath(location)
    return _look_url(location) if fmt.is_url(location) else _look_local(location)


def check_mode(location, mode: str, claim=None) -> Found:
    """Raise now, before anything is created, if ``mode`` cannot apply to
    ``location``; else say what is there.  Only a tensortape run (and nothing
    beside it) may be overwritten: tensortape never deletes what it did not write,
    and no mode touches a run that a live job has claimed (``_claim``; ``claim``:
    this job's own, which is no obstacle)."""
    location = os.fspath(location)
    found = look(location)
    if found.what == "other":
        if mode == "a":
            raise StoreFormatError(f"{location!r} {found.detail}; mode='a' appends only to a "
                                   f"tensortape run: pass the path of a recorded run")
        raise StoreExistsError(f"{location!r} {found.detail}; tensortape will not delete or "
                               f"overwrite what it did not write: choose a new path for the run "
                               f"(a missing or empty folder)")
    if found.claimed:
        from ._claim import live_holder, refusal
        holder = live_holder(location, ignore=getattr(claim, "token", ""))
        if holder is not None:
            raise StoreExistsError(refusal(location, mode, holder))
    if mode == "w-" and found.what == "run":
        raise StoreExistsError(f"store {location!r} already exists (a tensortape run); pass "
                               f"mode='w' to overwrite it or mode='a' to append further steps")
    if mode == "a" and found.what != "run":
        raise StoreNotFoundError(f"store {location!r} does not exist, so mode='a' cannot append "
                                 f"to it; use mode='w-' to create it")
    return found


def _clear(location: str, entries: tuple[str, ...]) -> None:
    """Delete a run's own entries (``mode="w"``), and nothing else: never the claim
    (this job's, taken before)."""
    entries = tuple(e for e in entries if e != fmt.CLAIM_NAME)
    if fmt.is_url(location):
        import fsspec
        from ._claim import drop_folder
        fs, root = fsspec.core.url_to_fs(location)
        for e in entries:
            fs.rm(f"{root.rstrip('/')}/{e}", recursive=True)
            if e != "zarr.json":
                drop_folder(fs, f"{root.rstrip('/')}/{e}")
        fs.invalidate_cache()
        return
    for e in entries:
        p = os.path.join(location, e)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def open_root(location, mode: str, rank: int = 0, attributes: dict | None = None,
              claim=None) -> zarr.Group:
    """Open the root group of a store for writing.  Rank 0 applies the run's
    ``mode`` (``"w"`` deletes a run's own entries; the new root's ``zarr.json`` is
    written once, with ``attributes``); other ranks open what it prepared.

    ``claim``: rank 0's ``Claim`` on the store (``_claim.Claim.acquire``, taken
    first), which makes what is seen here this job's to change.  Without one (tools
    that own the store otherwise) a live job's claim still refuses.  Every refusal
    is a ``StoreExistsError``, ``StoreNotFoundError`` or ``StoreFormatError``."""
    location = os.fspath(location)
    if rank != 0:
        try:
            return zarr.open_group(location, mode="r+")
        except FileNotFoundError as e:
            raise StoreNotFoundError(f"rank {rank} found no store at {location!r} that rank 0 "
                                     f"prepared: {e}") from e
    found = check_mode(location, mode, claim)
    try:
        if mode == "a":
            root = zarr.open_group(location, mode="a")
            version = root.attrs.get("tensortape_format")
            if isinstance(version, int) and version < fmt.FORMAT_VERSION:
                raise ConfigError(f"{location!r} is a format-{version} store; appending needs "
                                  f"format {fmt.FORMAT_VERSION}: convert it first with `tensortape "
                                  f"migrate {location} NEW` and append to NEW")
            return root
        if found.what == "run":
            _clear(location, found.own)
        elif found.what == "empty" and not fmt.is_url(location) and os.path.isdir(location):
            for name in os.listdir(location):        # zarr's temporary file of a killed start
                if fmt.is_partial(name):
                    os.remove(os.path.join(location, name))
        # under a claim "a": what is left is the claim, and it is ours.  Else locally
        # "w-": zarr's "w" would delete the folder itself (a link's target too); an
        # object store keeps empty "folders" of what was cleared, which "w" removes
        create = "a" if claim is not None else ("w" if fmt.is_url(location) else "w-")
        return zarr.open_group(location, mode=create, zarr_format=3, attributes=attributes or {})
    except (StoreExistsError, StoreNotFoundError, StoreFormatError, ConfigError):
        raise
    except FileExistsError as e:             # zarr's: something appeared meanwhile
        raise StoreExistsError(f"store {location!r} changed while mode={mode!r} prepared it "
                               f"(another job writes there?): {e}") from e
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
        raise StoreExistsError(f"store {location!r} changed while mode={mode!r} prepared it "
                               f"(another job writes there?): {e}") from e


def write_threads() -> int:
    """Threads that encode and write chunks.  The codecs release the GIL, so on a
    machine with cores to spare (a GPU machine) chunks are written in parallel; on
    a small one (4 cores or fewer) the writer thread writes them itself, as
    training already keeps those cores busy.  ``TENSORTAPE_WRITE_THREADS`` sets it
    (a positive integer; anything else is a ``ConfigError`` in one line)."""
    env = os.environ.get("TENSORTAPE_WRITE_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"TENSORTAPE_WRITE_THREADS={env!r} is not valid; use a positive "
                              f"integer (1: the writer thread writes alone), or leave it unset")
        return int(env)
    cores = os.cpu_count() or 1
    return 1 if cores <= 4 else min(8, cores // 2)


class WritePool:
    """The threads that encode and write chunks, or none (``threads < 2``: the
    caller's thread writes at once).

    Daemon threads, unlike ``concurrent.futures``' pool, whose threads the
    interpreter joins at exit: a store that hangs must not hang the exit.  Each
    write runs inside ``quiet()`` (a dependency's warning is no fault of the
    store) and marks ``progress``, the time of the last write that ended, which
    tells a slow store from one that does not answer."""

    def __init__(self, threads: int):
        self.inline = threads < 2
        self.progress = time.monotonic()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [] if self.inline else [
            threading.Thread(target=self._serve, name="tensortape-chunks", daemon=True)
            for _ in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn, args: tuple, done) -> None:
        """Run ``fn(*args)``, then ``done(error or None)``."""
        if self.inline:
            done(self._call(fn, args))
        else:
            self._tasks.put((fn, args, done))

    def _call(self, fn, args) -> BaseException | None:
        try:
            with quiet():
                fn(*args)
            return None
        except BaseException as e:
            return e
        finally:
            self.progress = time.monotonic()

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, args, done = task
            done(self._call(fn, args))

    def shutdown(self, wait: bool = True) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        if wait:
            for t in self._threads:
                t.join()


class Lane:
    """At most one write in flight on one array, in the order given.

    zarr writes part of a shard by reading it, merging and writing it whole, so
    two writes in flight on one shard lose one of them.  A lane hands its array's
    writes to the pool one after the other: parallel across arrays, serial within
    one.  ``drain`` waits for every write given and raises the first that failed
    (the writes given after a failure are not made: the writer starts again from
    its last commit)."""

    MAX_WAITING = 8                # blocks queued on one array before the writer waits

    def __init__(self, pool: WritePool):
        self.pool = pool
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._busy = False
        self._error: BaseException | None = None

    def submit(self, fn, *args) -> None:
        with self._cond:
            while len(self._waiting) >= self.MAX_WAITING and self._error is None:
                self._cond.wait()
            if self._error is not None:
                return                          # raised by drain
            if self._busy:
                self._waiting.append((fn, args))
                return
            self._busy = True
        self.pool.submit(fn, args, self._finish)

    def _finish(self, error: BaseException | None) -> None:
        while True:
            with self._cond:
                if error is not None and self._error is None:
                    self._error = error
                self._cond.notify_all()
                if not self._waiting or self._error is not None:
                    self._waiting.clear()
                    self._busy = False
                    return
                fn, args = self._waiting.popleft()
            if not self.pool.inline:
                self.pool.submit(fn, args, self._finish)
                return
            error = self.pool._call(fn, args)   # inline: the next write, without recursion

    def drain(self) -> None:
        """Wait for every write given; raise the first that failed."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error


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
        inner = tuple(max(a, b) for a, b in zip(self.array.shape[1:], shape))
        if inner == self.array.shape[1:]:
            return
        self.drain()
        self.array.resize((self.array.shape[0], *inner))
        buf = np.full((self.chunk_rows, *inner), self.fill, dtype=self.buf.dtype)
        buf[(slice(None), *map(slice, self.buf.shape[1:]))] = self.buf
        self.buf = buf

    def put(self, row: int, value: np.ndarray) -> None:
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
            if self.lane.pool.inline:
                self.buf.fill(self.fill)
            else:                                      # the pool still reads the old one
                self.buf = np.full_like(self.buf, self.fill)

    def write(self) -> None:
        """Write the current chunk whole (padded with the fill value past its rows)."""
        if self.dirty:
            self._submit(self.start, self.buf if self.lane.pool.inline else self.buf.copy())
            self.dirty = False

    def _submit(self, start: int, block: np.ndarray) -> None:
        self.lane.submit(self.array.__setitem__, slice(start, start + len(block)), block)

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
        if self.rows == self.capacity:
            cap = max(self.block, -(-2 * self.capacity // self.block) * self.block)
            for c in self.columns.values():
                c.drain()
                c.array.resize((cap, *c.array.shape[1:]))
        for name, value in values.items():
            self.columns[name].put(self.rows, value)
        self.rows += 1

    def flush(self) -> None:
        """Write every buffered chunk and wait until all of them are written."""
        for c in self.columns.values():
            c.write()
        for c in self.columns.values():
            c.drain()

    def trim(self) -> None:
        """Cut every column to its rows, each in its lane (in parallel with a pool);
        ``drain`` waits for them."""
        for c in self.columns.values():
            if c.array.shape[0] != self.rows:
                c.lane.submit(c.array.resize, (self.rows, *c.array.shape[1:]))


def _array(group: zarr.Group, name: str, shape, chunks, dtype, fill, dims, attrs=None,
           level: int | None = 1, shards=None) -> zarr.Array:
    """A new array, zstd-compressed at ``level`` (``None``: uncompressed), its
    chunks packed into ``shards`` when given."""
    compressors = [] if level is None else [ZstdCodec(level=level)]
    if shards:              # a shard is read in two moves: a checksum per chunk catches a
        compressors.append(Crc32cCodec())     # shard the writer replaced between them
    return group.create_array(
        name, shape=shape, chunks=chunks, shards=shards, dtype=dtype, fill_value=fill,
        dimension_names=dims, compressors=compressors or None,
        attributes=attrs or {}, overwrite=True, config={"write_empty_chunks": True})


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


def _fill_for(dtype: np.dtype):
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "c":
        return complex(np.nan, np.nan)
    return False if dtype.kind == "b" else 0


class RunStore:
    """One rank's part of a store: its tables and its committed state."""

    def __init__(self, root: zarr.Group, rank: int, compression: str | int | None = "auto"):
        self.root = root
        self.rank = rank
        self.compression = compression     # of full tensors: "auto", a zstd level, or None
        self.rank_group = root.require_group(fmt.rank_group(rank))
        self.tables: dict[str, Table] = {}
        self.pool = WritePool(write_threads())

    def state(self) -> fmt.RankState:
        """The rank's committed state (empty for a new rank)."""
        return fmt.RankState.from_json(dict(self.rank_group.attrs) or {"rank": self.rank})

    # --- tables --------------------------------------------------------------
    def _table(self, path: str, committed: int, create, recording: int) -> Table:
        """The open table at ``path``: the store's arrays when it has committed
        rows, else new ones made by ``create(group)``.  A recording after the first
        (``recording`` > 0, a resumed job) gives the table its ``recording`` column,
        whose committed rows so far are recording 0's (``fmt.RECORDING``)."""
        table = self.tables.get(path)
        if table is None:
            names = list(fmt.parse_path(path).columns)
            if committed:
                g = self.root[path]
                for n, fill in fmt.OPTIONAL_COLUMNS.items():     # a store of an older format
                    if n in names and n not in g:
                        rows = g["step"].shape[0]
                        _array(g, n, (rows,), (SMALL_CHUNK_ROWS,), "int64", fill, ["step"])
                if recording and fmt.RECORDING not in g:         # every chunk of its rows stored
                    _array(g, fmt.RECORDING, (g["step"].shape[0],), (SMALL_CHUNK_ROWS,), "int64",
                           0, ["step"])[:committed] = np.zeros(committed, np.int64)
                names += [fmt.RECORDING] if fmt.RECORDING in g else []
                cols = {n: g[n].with_config({"write_empty_chunks": True}) for n in names}
            else:
                g = self.root.require_group(path)
                stale = fmt.RECORDING in g                # of rows never committed
                cols = create(g)
                if recording or stale:
                    cols[fmt.RECORDING] = _array(g, fmt.RECORDING, (0,), (SMALL_CHUNK_ROWS,),
                                                 "int64", 0, ["step"])
            table = self.tables[path] = Table(g, cols, committed, self.pool)
        return table

    @staticmethod
    def _new_stats(g: zarr.Group, kind: str, n_layers: int) -> dict[str, zarr.Array]:
        lo, hi = fmt.bin_edges()
        _array(g, "bin_lo", lo.shape, lo.shape, "float64", np.nan, ["bin"])[:] = lo
        _array(g, "bin_hi", hi.shape, hi.shape, "float64", np.nan, ["bin"])[:] = hi
        cols = {"step": _array(g, "step", (0,), (SMALL_CHUNK_ROWS,), "int64", -1, ["step"]),
                "stats": _array(g, "stats", (0, n_layers, len(fmt.STATS)),
                                (STATS_CHUNK_ROWS, STATS_LAYER_CHUNK, 1), "float64",
                                np.nan, ["step", "layer", fmt.STAT_AXIS],
                                shards=(STATS_CHUNK_ROWS, LAYER_CHUNK, len(fmt.STATS))),
                "hist": _array(g, "hist", (0, n_layers, fmt.NBINS),
                               (HIST_CHUNK_ROWS, HIST_LAYER_CHUNK, fmt.NBINS), "int64", 0,
                               ["step", "layer", "bin"],
                               shards=(HIST_SHARD_ROWS, LAYER_CHUNK, fmt.NBINS))}
        g.update_attributes({"kind": kind, fmt.EVERY_CHUNK: True, "stats": list(fmt.STATS)})
        return cols

    def _new_tensor(self, g: zarr.Group, kind: str, layer: str, sample: np.ndarray,
                    logical: str | None) -> dict[str, zarr.Array]:
        g.update_attributes({"name": layer, "kind": kind, fmt.EVERY_CHUNK: True})
        k = int(min(64, max(1, CHUNK_BYTES // max(sample.nbytes, 1))))
        inner = tuple(max(d, 1) for d in sample.shape)
        attrs = {fmt.LOGICAL_ATTR: logical} if logical else {}
        dims = ["step", *(f"dim_{i}" for i in range(sample.ndim))]
        return {
            "data": _array(g, "data", (0, *sample.shape), (k, *inner), sample.dtype,
                           _fill_for(sample.dtype) if not logical else fmt.nan_bits(logical),
                           dims, attrs,
                           level=self._level(sample)),
            "step": _array(g, "step", (0,), (SMALL_CHUNK_ROWS,), "int64", -1, ["step"]),
            "micro": _array(g, "micro", (0,), (SMALL_CHUNK_ROWS,), "int64", 0, ["step"]),
            "extent": _array(g, "extent", (0, max(sample.ndim, 1)),
                             (SMALL_CHUNK_ROWS, max(sample.ndim, 1)), "int64", -1,
                             ["step", "axis"]),
        }

    # --- rows -------------------------------------------------------------------
    def append_stats(self, kind: str, step: int, names: list[str], layers: list[str],
                     stats: dict[str, np.ndarray], hist: np.ndarray, committed: int,
                     recording: int = 0) -> None:
        """One step's statistics of ``layers`` as a row of the kind's table, whose
        layer axis is ``names`` (the run's rows so far); absent layers are NaN.
        ``recording``: the rank's recording that records it (``fmt.RECORDING``)."""
        n = len(names)
        table = self._table(fmt.stats_group(self.rank, kind), committed,
                            lambda g: self._new_stats(g, kind, n), recording)
        index = {name: i for i, name in enumerate(names)}
        rows = [index[layer] for layer in layers]
        row = np.full((n, len(fmt.STATS)), np.nan)
        full = np.zeros((n, fmt.NBINS), dtype=np.int64)
        row[rows] = np.stack([np.asarray(stats[s], np.float64) for s in fmt.STATS], axis=1)
        full[rows] = hist
        table.columns["stats"].grow_inner((n, len(fmt.STATS)))
        table.columns["hist"].grow_inner((n, fmt.NBINS))
        table.append(_tagged({"step": np.int64(step), "stats": row, "hist": full}, table,
                             recording))

    def append_tensor(self, kind: str, layer: str, step: int, micro: int, t,
                      committed: int, recording: int = 0) -> int | None:
        """One step's full tensor (a host torch tensor) as a row of its table; the
        bytes written, or None when its rank or dtype differs from the table's."""
        arr, logical = to_numpy(t)
        table = self._table(fmt.tensor_group(self.rank, kind, layer), committed,
                            lambda g: self._new_tensor(g, kind, layer, arr, logical), recording)
        data = table.columns["data"].array
        if data.ndim - 1 != arr.ndim or data.dtype != arr.dtype:
            return None
        extent = np.array(arr.shape if arr.ndim else (1,), dtype=np.int64)
        table.append(_tagged({"data": arr, "step": np.int64(step), "micro": np.int64(micro),
                              "extent": extent}, table, recording))
        return arr.nbytes

    def write_bundle(self, path: str, attrs: dict, arrays: dict) -> None:
        """A replay bundle (``format.replay_group``): each host tensor an array (its
        node name encoded, bfloat16 and float8 as bits with ``logical_dtype``), the
        JSON in the group's attributes.  Written whole; the event that names it is
        committed after.  A bundle of an older recording at the same step (a job
        resumed from before it) is replaced whole, none of its arrays or keys kept."""
        g = self.root.create_group(path, overwrite=True)
        for name, t in arrays.items():
            arr, logical = to_numpy(t)
            a = _array(g, fmt.node_name(name), arr.shape, arr.shape or (), arr.dtype,
                       _fill_for(arr.dtype), [f"dim_{i}" for i in range(arr.ndim)],
                       {fmt.LOGICAL_ATTR: logical} if logical else None)
            a[...] = arr
        g.update_attributes(fmt.to_json(attrs))

    def _level(self, sample: np.ndarray) -> int | None:
        return zstd_level(sample) if self.compression == "auto" else self.compression

    # --- commit ---------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """End the write threads (``wait=False``: without waiting for a store that
        does not answer)."""
        self.pool.shutdown(wait=wait)

    def flush(self) -> dict[str, int]:
        """Write every buffered chunk and wait for every write; return the row
        counts now safe to commit (the data is on the store before them)."""
        for t in self.tables.values():
            t.flush()
        return {path: t.rows for path, t in self.tables.items()}

    def commit(self, state: fmt.RankState, root_attrs: dict[str, Any] | None) -> None:
        """Advance the commit counters after the data: the rank's state in one
        write of its ``zarr.json``, then (rank 0) the root's in one write."""
        self.rank_group.update_attributes(state.to_json())
        if root_attrs is not None:
            self.root.update_attributes(fmt.to_json(root_attrs))

    def trim(self) -> None:
        for t in self.tables.values():
            t.trim()
        for t in self.tables.values():
            for c in t.columns.values():
                c.drain()

    def reset(self) -> None:
        """Forget every open table (after a failed write): each is opened again at
        its committed rows, overwriting whatever was written past them."""
        for t in self.tables.values():
            for c in t.columns.values():
                try:
                    c.drain()
                except Exception:       # the write that failed, or one after it
                    pass
        self.tables = {}


def _tagged(values: dict[str, np.ndarray], table: Table, recording: int) -> dict:
    """A row's values, with its recording where its table has that column."""
    if fmt.RECORDING in table.columns:
        values[fmt.RECORDING] = np.int64(recording)
    return values


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
