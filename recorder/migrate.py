"""Write a run anew in the current format: the writing side of ``tensortape
migrate`` (``analysis`` reads the old store and hands its tables here).

Every array is made and written by the recorder's own store code
(``_root.open_root`` and ``RunStore``'s tables): the chunks, shards, codecs,
fill values, attributes and ``recording`` column of a copy are those a
recording makes, so the layout has one writer.  Every committed row is copied
as it is (a step recorded twice stays twice, with its recording), so the
ranks' commit counters stay true.  The data goes first, each rank's state
after it, the root's attributes last: a copy that stops half way is not a
run (its root has no ``tensortape_format``).

No torch: rows are numpy arrays, as the store holds them (bfloat16 and float8
as their bits, with ``logical``).

Runs on the caller's thread (``tensortape migrate``, ``migrate``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from . import format as fmt

__all__ = ["TableRows", "write_run"]


@dataclass(frozen=True)
class TableRows:
    """One table to write: its path (``format.parse_path``), and its rows as
    blocks (``blocks()``: dicts of column -> numpy values, a row each along the
    first axis).

    A stats table's blocks hold ``step``, ``stats`` (row, layer, statistic, as
    format 3 packs them) and ``hist``; ``width``: its layer columns.  A tensor
    table's hold ``data`` (NaN-padded rows), ``step``, ``micro`` and ``extent``;
    ``name``: its layer, ``logical``: the logical dtype of bits stored.  The
    scalars table's hold ``step``, ``name`` and ``value``.  Each holds
    ``recording`` where ``recorded`` (rows of a resumed recording)."""
    path: str
    blocks: Callable[[], Iterator[dict[str, np.ndarray]]]
    recorded: bool = False
    width: int = 0
    name: str | None = None
    logical: str | None = None


def write_run(location, attrs: dict, states: dict[int, fmt.RankState],
              tables: Iterable[TableRows], mode: str = "w-", source=None) -> str:
    """Write a run at ``location``: its ``tables``, then each rank's committed
    ``states``, then the root's ``attrs`` (``tensortape_format`` set to the
    current one).  Returns the location.

    ``mode``: ``"w-"`` refuses an existing ``location``; ``"w"`` overwrites a
    tensortape run there (never other files).  ``source``: the location read,
    which is never the one written.  A copy that fails removes what it wrote:
    the folder it created, or what it put in the one that was there."""
    from .claim._root import open_root
    from .store._store import RunStore
    location = fmt.location(location)
    _check_entry(location, mode, source)
    existed = _exists(location)
    root = open_root(location, mode, attributes={})       # refuses before writing anything
    try:
        return _write(root, location, attrs, states, tables, RunStore)
    except BaseException:
        _remove_written(location, existed)
        raise


def _check_entry(location: str, mode: str, source) -> None:
    """Refuse, before anything is written, a mode other than "w-"/"w", the source
    itself, and (under "w-") anything already at ``location``."""
    from .claim._root import Contents, look
    from .errors import ConfigError, StoreExistsError, argument
    if mode not in ("w-", "w"):
        raise ConfigError(f"{argument('mode', mode)} is not valid here; use 'w-' (a new "
                          f"run) or 'w' (overwrite a tensortape run)")
    if source is not None and _same(location, source):
        raise ConfigError(f"{location!r} is the run being read; write the copy elsewhere")
    if mode == "w-" and look(location).what not in (Contents.MISSING, Contents.EMPTY):
        raise StoreExistsError(f"{location!r} already exists; pass {argument('mode', 'w')} to "
                               f"overwrite a tensortape run there, or choose a new path")


def _same(a: str, b) -> bool:
    b = os.fspath(b)
    if fmt.is_url(a) or fmt.is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _exists(location: str) -> bool:
    if fmt.is_url(location):
        import fsspec
        fs, root = fsspec.core.url_to_fs(location)
        return fs.exists(root)
    return os.path.lexists(location)


def _remove_written(location: str, existed: bool) -> None:
    """Remove what a failed copy wrote: the folder if it made it, else every entry
    in it (the folder was empty, or held a run that ``mode="w"`` cleared)."""
    import shutil
    try:
        if fmt.is_url(location):
            import fsspec
            fs, root = fsspec.core.url_to_fs(location)
            for entry in fs.ls(root, detail=False):
                fs.rm(entry, recursive=True)
            if not existed and fs.exists(root):
                fs.rm(root, recursive=True)
        elif not existed:
            shutil.rmtree(location, ignore_errors=True)
        else:
            for name in os.listdir(location):
                p = os.path.join(location, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.remove(p)
    except OSError:                       # the error that stopped the copy is the one to see
        pass


def _write(root, location: str, attrs: dict, states, tables, RunStore) -> str:
    stores: dict[int, RunStore] = {}

    def store(rank: int) -> RunStore:
        if rank not in stores:
            stores[rank] = RunStore(root, rank)
        return stores[rank]
    try:
        for t in tables:
            _copy(store(fmt.parse_path(t.path).rank), t)
        for rank in states:
            store(rank)
        for s in stores.values():            # every chunk written, every array at its rows
            s.flush()
            s.trim()
        last = dict(attrs, tensortape_format=fmt.FORMAT_VERSION)
        ranks = sorted(states)
        from .store._ranklog import RankLog
        for rank in ranks:                   # the counters after the data, the root last
            RankLog.commit_copy(store(rank), states[rank], last if rank == ranks[-1] else None)
        if not ranks:
            root.update_attributes(fmt.to_json(last))
    finally:
        for s in stores.values():
            s.close()
    return location


def _copy(store, t: TableRows) -> None:
    """A table's rows, appended one by one through the store's table (a recording
    after the first gives a table its ``recording`` column)."""
    table = fmt.parse_path(t.path)
    blocks = iter(t.blocks())
    first = next(blocks, None)
    if first is None:
        return
    recording = 1 if t.recorded else 0
    if table.section == "stats":
        rows = store.stats_table(t.path, t.width, recording=recording)
    elif table.section == "scalars":
        rows = store.scalars_table(recording=recording)
    else:
        rows = store.tensor_table(t.path, t.name, first["data"][0], t.logical,
                                  recording=recording)
    for block in itertools.chain([first], blocks):
        for i in range(len(block["step"])):
            rows.append({k: v[i] for k, v in block.items()})
