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
    ``name``: its layer, ``logical``: the logical dtype of bits stored.  Either
    holds ``recording`` where ``recorded`` (rows of a resumed recording)."""
    path: str
    blocks: Callable[[], Iterator[dict[str, np.ndarray]]]
    recorded: bool = False
    width: int = 0
    name: str | None = None
    logical: str | None = None


def write_run(location, attrs: dict, states: dict[int, fmt.RankState],
              tables: Iterable[TableRows]) -> str:
    """Write a run at ``location`` (which must not exist, as ``mode="w-"``): its
    ``tables``, then each rank's committed ``states``, then the root's ``attrs``
    (``tensortape_format`` set to the current one).  Returns the location."""
    from ._root import open_root
    from ._store import RunStore
    location = os.fspath(location)
    root = open_root(location, "w-", attributes={})       # refuses before writing anything
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
        for rank in ranks:                   # the counters after the data, the root last
            store(rank).commit(states[rank], last if rank == ranks[-1] else None)
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
    else:
        rows = store.tensor_table(t.path, t.name, first["data"][0], t.logical,
                                  recording=recording)
    for block in itertools.chain([first], blocks):
        for i in range(len(block["step"])):
            rows.append({k: v[i] for k, v in block.items()})
