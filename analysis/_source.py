"""Where a run is read from: a Zarr store (path or fsspec URL) or an HDF5 export.

Both give the same three things: JSON attributes of a node, an array by path
(lazily sliceable), and whether a node exists.  Nothing from a store is ever
executed: attributes are JSON, arrays are numbers.

A chunk read that fails is made again only where the store may be changing
under the reader (a live run, ``may_change``): a finished run's shard is never
replaced, so a damaged one fails at once.  Then the read is made a stored
object (shard or chunk) at a time, and each object that cannot be decoded is
handed to the source's ``sink`` (the run's index), which says what its cells
read as (damage is local), or refuses.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import stat
import threading
import time

import numpy as np

from tensortape.recorder import format as fmt
from tensortape.recorder.quiet import quiet
from tensortape.recorder.errors import StoreFormatError, StoreNotFoundError

from ._chunks import rows as chunk_rows

__all__ = ["open_source", "said", "ZarrSource", "H5Source"]

JSON_ATTR = "tensortape_json"
RETRIES = 5               # reads again of a chunk of a live run that fails (a shard replaced
PAUSE = 0.05              # mid-read), after a pause that doubles each time: 1.55 s in all
SOURCES = 8               # sources a process keeps open to unpickle arrays (dask workers)


class Guarded:
    """An array of a store whose reads raise ``StoreFormatError`` naming the array,
    whatever a damaged chunk makes the decoder raise.  Everything else is the
    array's own (shape, dtype, chunks, attrs, ...).

    A read that fails is made again (``RETRIES``) while its source may change
    (``may_change``: a live run, whose writer may replace a shard mid-read).

    It pickles as the store's location and the array's path, and is opened again
    where it is unpickled (a dask.distributed worker): no store object, lock or
    file handle travels."""

    def __init__(self, array, where: str, location: str, source=None):
        self._array, self._where, self._location = array, where, location
        self._source = source

    def __getattr__(self, name):
        if name.startswith("__") or "_array" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._array, name)

    def __reduce__(self):
        return _reopen, (self._location, self._where)

    def __getitem__(self, key):
        got = chunk_rows(self._array, key)      # whole chunk files, where that reads them
        if got is not None:
            return got
        for attempt in range(RETRIES + 1):
            try:
                with quiet():                # zarr's warnings are not the reader's news
                    return self._array[key]
            except StoreFormatError:
                raise                        # a chunk refused before it was read
            except Exception as e:
                error = e
                # a live run: a shard is read in two moves (its index, then its chunks),
                # and the writer may replace it between them; the chunks' checksums
                # catch that, and a read again sees the new shard whole (a shard
                # rewritten often may need a few, further apart).  A finished run's
                # shards are never replaced: its failure is damage, at once
                if attempt == RETRIES or self._source is None or not self._source.may_change():
                    break
                time.sleep(PAUSE * 2 ** attempt)
        got = self._salvage(key)
        if got is not None:
            return got
        raise StoreFormatError(f"{self._where}: a chunk cannot be read ({said(error)}); the "
                               f"store is damaged") from error

    def _salvage(self, key):
        """``key`` read a stored object at a time, each that cannot be decoded as its
        cells' fill (the source's ``sink``: where, the object's key and extent, the
        error and the array's fill value -> the fill, or None: not salvaged).  None
        where there is no sink, or a key of more than one index array."""
        sink = getattr(self._source, "sink", None)
        arr = self._array
        shape = tuple(int(s) for s in arr.shape)
        box = _box(key, shape)
        if sink is None or box is None:
            return None
        box, rel = box
        grid = tuple(int(c) for c in (getattr(arr, "shards", None) or arr.chunks or shape))
        out = np.empty(tuple(hi - lo for lo, hi in box), arr.dtype)
        spans = [range(lo // g, -(-hi // g)) if hi > lo else range(0)
                 for (lo, hi), g in zip(box, grid)]
        for index in itertools.product(*spans):
            part = tuple(slice(max(lo, i * g), min(hi, (i + 1) * g))
                         for (lo, hi), i, g in zip(box, index, grid))
            at = tuple(slice(p.start - lo, p.stop - lo) for p, (lo, _) in zip(part, box))
            try:
                with quiet():
                    out[at] = self._array[part]
            except StoreFormatError:
                raise
            except Exception as e:
                fill = sink(self._where, "c/" + "/".join(map(str, index)),
                            tuple((i * g, min(s, (i + 1) * g)) for i, g, s in zip(index, grid, shape)),
                            e, arr.fill_value)
                if fill is None:
                    return None
                out[at] = fill
        return out[rel]


def said(error: Exception) -> str:
    """An error in a few words: its class and its first sentence."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text.split('. ')[0]}"


def _box(key, shape: tuple[int, ...]):
    """The box a key reads (``(lo, hi)`` per axis) and the key within it, or None for
    a key of more than one index array (numpy's and zarr's readings differ), a new
    axis or a slice that steps backwards."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + key[i + 1:]
    key = key + (slice(None),) * (len(shape) - len(key))
    if len(key) != len(shape):
        return None
    box, rel, arrays = [], [], 0
    for k, n in zip(key, shape):
        if isinstance(k, (int, np.integer)):
            i = int(k) + (n if k < 0 else 0)
            box.append((i, i + 1))
            rel.append(0)
        elif isinstance(k, slice):
            r = range(*k.indices(n))
            if r.step < 0:
                return None
            lo, hi = (r[0], r[-1] + 1) if len(r) else (0, 0)
            box.append((lo, hi))
            rel.append(slice(0, hi - lo, r.step))
        else:
            k = np.asarray(k)
            if k.dtype == bool:
                k = np.flatnonzero(k)
            if k.ndim != 1 or k.dtype.kind not in "iu" or arrays:
                return None
            arrays += 1
            k = np.where(k < 0, k + n, k)
            lo, hi = (int(k.min()), int(k.max()) + 1) if len(k) else (0, 0)
            box.append((lo, hi))
            rel.append(k - lo)
    return box, tuple(rel)


# this process's sources by location, the latest used last (where arrays are
# unpickled: a dask worker reads a few runs at a time, not every run it ever read)
_opened: collections.OrderedDict = collections.OrderedDict()
_opened_lock = threading.Lock()


def _reopen(location: str, path: str) -> Guarded:
    with _opened_lock:
        source = _opened.pop(location, None)
    if source is None:
        source = open_source(location)
    with _opened_lock:
        _opened[location] = source
        while len(_opened) > SOURCES:
            _opened.popitem(last=False)
    return source.array(path)


class ZarrSource:
    lock = False
    sink = None          # what a chunk that cannot be decoded reads as (``Guarded._salvage``)
    _together: dict = {}   # nodes opened together (``opened``)

    def __init__(self, location: str):
        import zarr
        self.location = location
        try:
            store = location if fmt.is_url(location) else _checked_store(location)
            with quiet():
                self.root = zarr.open_group(store, mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError) as e:
            raise StoreFormatError(f"{location!r} is not a Zarr store; pass the path of a run "
                                   f"recorded by tensortape") from e
        if self.root.metadata.zarr_format != 3:     # never written by tensortape: unread
            raise StoreFormatError(f"{location!r} is a Zarr v{self.root.metadata.zarr_format} "
                                   f"store; tensortape runs are Zarr v3")
        self.live = _status(self.root) == fmt.STATUS_RECORDING

    def may_change(self) -> bool:
        """Whether a chunk may be replaced while it is read: the run was being
        recorded when it was opened, or is now (recorded again at its path)."""
        if self.live:
            return True
        import zarr
        try:
            with quiet():
                root = zarr.open_group(self.root.store, path=self.root.path, mode="r")
        except Exception:                   # no root to read: not a run being recorded
            return False
        return _status(root) == fmt.STATUS_RECORDING

    # zarr warns of what it meets in a store (a killed writer's temporary files: "not
    # recognized as a component of a Zarr hierarchy"); the reader goes on (``quiet``)
    def attrs(self, path: str = "") -> dict:
        with quiet():
            return dict((self._node(path) if path else self.root).attrs)

    def array(self, path: str):
        with quiet():
            return Guarded(self._node(path), path, self.location, self)

    def _node(self, path: str):
        node = self._together.get(path)    # (one read: another thread's ``opened`` may end)
        return self.root[path] if node is None else node

    @contextlib.contextmanager
    def opened(self, paths):
        """Within it, the nodes at ``paths`` opened at once: their metadata read in one call
        of zarr's event loop, not one each (one that fails is opened when asked for)."""
        import asyncio
        import zarr
        from zarr.core.sync import sync

        async def every(paths):
            root = await zarr.api.asynchronous.open_group(self.root.store, path=self.root.path,
                                                          mode="r")
            got = await asyncio.gather(*(root.getitem(p) for p in paths), return_exceptions=True)
            return {p: (zarr.Array if isinstance(n, zarr.AsyncArray) else zarr.Group)(n)
                    for p, n in zip(paths, got) if not isinstance(n, BaseException)}
        with quiet():
            self._together = sync(every(list(paths)))
        try:
            yield
        finally:
            self._together = {}

    def has(self, path: str) -> bool:
        import zarr
        if isinstance(self.root.store, zarr.storage.LocalStore):   # a v3 node: its zarr.json
            return os.path.isfile(self.root.store.root / self.root.path / path / "zarr.json")
        try:
            with quiet():
                self.root[path]
            return True
        except KeyError:
            return False

    def groups(self, path: str = "") -> list[str]:
        with quiet():
            node = self.root[path] if path else self.root
            return [k for k, _ in node.groups()]

    def missing_chunks(self, path: str, keys) -> list[str]:
        """The ``keys`` (``c/0/1``, ...) that the array at ``path`` does not store.
        While the run may change (``may_change``), a chunk not yet seen is looked
        for again (``RETRIES``, the pauses doubling) before it counts as missing."""
        keys = list(keys)
        missing = self._absent(path, keys)
        for attempt in range(RETRIES):
            if not missing or not self.may_change():
                break
            time.sleep(PAUSE * 2 ** attempt)
            missing = self._absent(path, missing)
        return missing

    def _absent(self, path: str, keys: list[str]) -> list[str]:
        base = "/".join(p for p in (self.root.path, path) if p)
        import zarr
        store = self.root.store
        if isinstance(store, zarr.storage.LocalStore):   # one lstat a key: no directory listing
            return [k for k in keys if not os.path.lexists(store.root / base / k)]
        from zarr.core.sync import collect_aiterator
        stored = {k[len(base) + 1:] for k in collect_aiterator(store.list_prefix(base + "/c/"))}
        return [k for k in keys if k not in stored]


def _status(group) -> object:
    """A root group's ``status`` attribute (None where it has none, or no object)."""
    try:
        return dict(group.attrs).get("status")
    except Exception:
        return None


def _checked_store(location: str):
    """A read-only local store that checks each chunk before reading it (the class
    is made here, where zarr is imported: reading attributes alone never imports it)."""
    import zarr

    class CheckedStore(zarr.storage.LocalStore):
        """A local store whose chunk reads are checked first: the chunk must be a
        regular file (not a link to a device) no larger than its array's chunk can
        encode to, so no read is unbounded."""

        async def get(self, key, prototype=None, byte_range=None):
            head, sep, index = key.rpartition("/c/")
            if sep and index.replace("/", "").isdigit():       # a chunk of the array at head
                try:
                    st = os.lstat(self.root / key)
                except (FileNotFoundError, NotADirectoryError):
                    return None
                if not stat.S_ISREG(st.st_mode):
                    raise StoreFormatError(f"{key} is not a regular file (a link or a device); "
                                           f"refusing to read it")
                if st.st_size > self._limit(head):
                    raise StoreFormatError(f"{key} is larger than a chunk of its array can be; "
                                           f"the store is damaged")
            return await super().get(key, prototype, byte_range)

        def _limit(self, array: str) -> int:
            limit = self.limits.get(array)
            if limit is None:
                try:
                    meta = json.loads((self.root / array / "zarr.json").read_bytes())
                    shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
                    raw = math.prod(int(c) for c in shape) * np.dtype(meta["data_type"]).itemsize
                except Exception as e:
                    raise StoreFormatError(f"{array}: its metadata cannot be read ({e})") from e
                limit = self.limits[array] = raw + raw // 64 + (1 << 16)   # zstd's worst case
            return limit

    store = CheckedStore(location, read_only=True)
    store.limits = {}
    return store


class H5Source:
    sink = None

    def __init__(self, location: str):
        import h5py
        from dask.utils import SerializableLock
        self.location = location
        self.file = h5py.File(location, "r")
        self.lock = SerializableLock("tensortape-hdf5")   # HDF5 holds one global lock: one
                                                            # thread at a time, and it pickles

    def attrs(self, path: str = "") -> dict:
        node = self.file[path] if path else self.file
        raw = node.attrs.get(JSON_ATTR)
        return json.loads(raw) if raw is not None else {}

    def array(self, path: str):
        return Guarded(self.file[path], path, self.location, self)

    opened = staticmethod(lambda paths: contextlib.nullcontext())
    def may_change(self) -> bool:
        return False         # an export is written whole, once

    def has(self, path: str) -> bool:
        return path in self.file

    def missing_chunks(self, path: str, keys) -> list[str]:
        return []            # an export is one file that HDF5 checks itself

    def groups(self, path: str = "") -> list[str]:
        import h5py
        node = self.file[path] if path else self.file
        return [k for k, v in node.items() if isinstance(v, h5py.Group)]


def open_source(location) -> ZarrSource | H5Source:
    location = os.fspath(location)
    local = not fmt.is_url(location)
    if local and not os.path.exists(location):
        raise StoreNotFoundError(f"no run at {location!r}; check the path (record one with "
                                 f"`tensortape demo OUT`)")
    if local and os.path.isfile(location):
        with open(location, "rb") as f:
            magic = f.read(8)
        if magic != b"\x89HDF\r\n\x1a\n":
            raise StoreFormatError(f"{location!r} is neither a Zarr store nor an HDF5 export of a run")
        return H5Source(location)
    if local and os.path.isdir(location) and not os.path.exists(os.path.join(location, "zarr.json")) \
            and all(fmt.is_partial(n) or n == fmt.CLAIM_NAME for n in os.listdir(location)):
        # the folder a run makes first, killed before its root was written
        raise StoreNotFoundError(f"no run at {location!r} yet: the folder is empty (a run "
                                 f"stopped before it began?); check the path")
    return ZarrSource(location)
