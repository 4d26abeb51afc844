"""Where a run is read from: a Zarr store (path or fsspec URL) or an HDF5 export.

Both give the same three things: JSON attributes of a node, an array by path
(lazily sliceable), and whether a node exists.  Nothing from a store is ever
executed: attributes are JSON, arrays are numbers.
"""

from __future__ import annotations

import json
import os
import threading

from recorder import format as fmt
from recorder.errors import StoreFormatError, StoreNotFoundError

__all__ = ["open_source", "ZarrSource", "H5Source"]

JSON_ATTR = "tensortape_json"


class Guarded:
    """An array of a store whose reads raise ``StoreFormatError`` naming the array,
    whatever a damaged chunk makes the decoder raise.  Everything else is the
    array's own (shape, dtype, chunks, attrs, ...)."""

    def __init__(self, array, where: str):
        self._array, self._where = array, where

    def __getattr__(self, name):
        return getattr(self._array, name)

    def __getitem__(self, key):
        try:
            return self._array[key]
        except Exception as e:
            raise StoreFormatError(f"{self._where}: a chunk cannot be read ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); the store is "
                                   f"damaged") from e


class ZarrSource:
    lock = False

    def __init__(self, location: str):
        import zarr
        try:
            self.root = zarr.open_group(location, mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError) as e:
            raise StoreFormatError(f"{location!r} is not a Zarr store; pass the path of a run "
                                   f"recorded by tensortape") from e

    def attrs(self, path: str = "") -> dict:
        return dict((self.root[path] if path else self.root).attrs)

    def array(self, path: str):
        return Guarded(self.root[path], path)

    def has(self, path: str) -> bool:
        try:
            self.root[path]
            return True
        except KeyError:
            return False

    def groups(self, path: str = "") -> list[str]:
        node = self.root[path] if path else self.root
        return [k for k, _ in node.groups()]

    def chunk_keys(self, path: str, max_bytes: int) -> set[str]:
        """The keys (``c/0/1``) of the chunks stored for the array at ``path``.  On
        a local store each must be a regular file of at most ``max_bytes``: a
        symlink to a device, a directory or a huge file is refused unread."""
        import zarr
        store = self.root.store
        prefix = "/".join(p for p in (self.root.path, path, "c") if p)
        if not isinstance(store, zarr.storage.LocalStore):
            from zarr.core.sync import collect_aiterator
            return {k[len(prefix) - 1:] for k in collect_aiterator(store.list_prefix(prefix + "/"))}
        keys: set[str] = set()
        pending = [(os.path.join(store.root, prefix), "c")]
        while pending:
            where, key = pending.pop()
            try:
                entries = list(os.scandir(where))
            except FileNotFoundError:
                continue
            except NotADirectoryError:
                raise StoreFormatError(f"{path}/{key} is not a directory of chunks; the store "
                                       f"is damaged") from None
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    pending.append((e.path, f"{key}/{e.name}"))
                elif not e.is_file(follow_symlinks=False):
                    raise StoreFormatError(f"{path}/{key}/{e.name} is not a regular file (a "
                                           f"link or a device); refusing to read it")
                elif e.stat(follow_symlinks=False).st_size > max_bytes:
                    raise StoreFormatError(f"{path}/{key}/{e.name} is larger than a chunk of "
                                           f"its array can be; the store is damaged")
                else:
                    keys.add(f"{key}/{e.name}")
        return keys


class H5Source:
    lock = threading.Lock()   # HDF5 holds one global lock: read from one thread at a time

    def __init__(self, location: str):
        import h5py
        self.file = h5py.File(location, "r")

    def attrs(self, path: str = "") -> dict:
        node = self.file[path] if path else self.file
        raw = node.attrs.get(JSON_ATTR)
        return json.loads(raw) if raw is not None else {}

    def array(self, path: str):
        return Guarded(self.file[path], path)

    def has(self, path: str) -> bool:
        return path in self.file

    def chunk_keys(self, path: str, max_bytes: int) -> None:
        return None          # an export is one file that HDF5 checks itself

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
    return ZarrSource(location)
