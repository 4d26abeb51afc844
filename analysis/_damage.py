"""Damage: the chunks of a table's committed rows that are not in the store, or
that are there but cannot be decoded, and what they make unreadable.

A table that stores every chunk of its rows (``format.EVERY_CHUNK``) tells a
missing chunk from one never written.  A chunk that cannot be decoded (corrupt,
truncated) is found when it is read: the key columns (``KEYS``) are read when a
table is checked, the rest when their rows are.  Either makes only its rows
unreadable, never the run: a value column's cells in it read as missing
(statistics NaN, counts -1, histogram counts -1, a scalar NaN: ``missing``), and
a row whose key (its step, micro-batch, extent, full tensor or scalar name) is
in it is not read at all (a full tensor found undecodable only as its rows are
read reads as its padding, NaN, in that read).  The rest of the table reads as
recorded.

Which chunks the committed rows need: every block of rows of the first chunk
across; a chunk further across (a table widened by a new layer, or a tensor
that grew) only from the first block that has it, since the writer writes each
block after a widening at its full width; a full tensor's, those its rows'
extents reach.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np

from tensortape.recorder import format as fmt

__all__ = ["Damage", "KEYS", "Ledger", "STATS", "cells", "find", "lost_rows", "missing", "words"]

# columns whose unreadable cells read as missing values; a row unreadable in any
# other column (step, micro, extent, data, name) is not read
STATS = ("stats", *fmt.STATS)       # the columns of a stats table's statistics (by format)
VALUES = frozenset({*STATS, "hist", "value"})
EFFECT = {"stats": "statistics read as NaN, counts -1", "hist": "histogram counts read as -1",
          "value": "scalars read as NaN", "data": "full tensors missing"}
# the columns read whole when a table is checked (small: an int or a few a row)
KEYS = frozenset({"step", "micro", "extent", "name", fmt.RECORDING})
COUNTS = frozenset({"hist", "counts"})    # integer counts: -1 where unreadable


def missing(column: str, fill):
    """What a cell of ``column`` in a chunk that cannot be decoded reads as: -1 for
    counts, else the array's fill value (NaN for floats, a full tensor's padding)."""
    return -1 if column in COUNTS else fill


@dataclasses.dataclass(frozen=True)
class Damage:
    """One missing (or undecodable: ``why``) chunk of a table's committed rows:
    its column, its key (``c/0/1``; ``""``: the column's whole array is missing),
    the rows ``[lo, hi)`` it holds and its reach ``[lo, hi)`` along each later
    axis (none: all of it)."""
    table: str
    column: str
    key: str
    rows: tuple[int, int]
    across: tuple[tuple[int, int], ...]
    why: str = dataclasses.field(default="is missing", compare=False)

    @property
    def where(self) -> str:
        return "/".join(p for p in (self.table, self.column, self.key) if p)

    @property
    def effect(self) -> str:
        return EFFECT.get(self.column, "statistics read as NaN, counts -1"
                          if self.column in VALUES else "rows not read")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _data_chunks(extent: np.ndarray, grid: tuple[int, ...], shape, n: int):
    """The chunk indices a data array's first ``n`` rows fill: in each block of
    rows, the chunks that its rows' extents reach (never beyond the array)."""
    for i in range(_ceil(n, grid[0])):
        block = extent[i * grid[0]: (i + 1) * grid[0]]
        reach = block.max(axis=0) if len(block) else np.zeros(len(grid) - 1, np.int64)
        counts = [min(_ceil(int(e), c), _ceil(int(s), c))
                  for e, c, s in zip(reach, grid[1:], shape[1:])]
        for inner in itertools.product(*map(range, counts)):
            yield (i, *inner)


def _key(index) -> str:
    return "c/" + "/".join(map(str, index))


def find(source, path: str, arrays: dict, n: int, extent: np.ndarray | None) -> list[Damage]:
    """The chunks of the first ``n`` rows of a table's ``arrays`` (name -> array)
    that the store lacks (``extent``: a tensor table's first ``n`` extents)."""
    out = []
    for name, arr in arrays.items():
        if name == fmt.RECORDING:    # given to a table with committed rows, which are all
            continue                 # recording 0's: a chunk not yet written reads as 0
        # the objects of a sharded array are its shards
        grid = tuple(int(c) for c in (getattr(arr, "shards", None) or arr.chunks))
        shape = tuple(int(s) for s in arr.shape)
        if name == "data" and extent is not None:
            need = list(_data_chunks(extent, grid, shape, n))
            gone = set(source.missing_chunks(f"{path}/{name}", map(_key, need)))
            lost = [i for i in need if _key(i) in gone]
        else:
            blocks = range(_ceil(n, grid[0]))
            across = list(itertools.product(*(range(_ceil(s, c)) for s, c in
                                               zip(shape[1:], grid[1:]))))
            need = [(i, *j) for j in across for i in blocks]
            gone = set(source.missing_chunks(f"{path}/{name}", map(_key, need)))
            lost = []
            for j in across:
                held = [i for i in blocks if _key((i, *j)) not in gone]
                since = 0 if not any(j) else (held[0] if held else len(blocks))
                lost += [(i, *j) for i in blocks if i >= since and _key((i, *j)) in gone]
        for i in lost:
            out.append(Damage(path, name, _key(i), (i[0] * grid[0], min(n, (i[0] + 1) * grid[0])),
                              tuple((j * c, min(s, (j + 1) * c))
                                    for j, c, s in zip(i[1:], grid[1:], shape[1:]))))
    return out


def lost_rows(damages: list[Damage], n: int, extent: np.ndarray | None) -> np.ndarray:
    """Which of a table's first ``n`` rows cannot be read at all: a key column's
    chunk of them is missing (a full tensor's, where the row's extent reaches it)."""
    lost = np.zeros(n, bool)
    for d in damages:
        lo, hi = d.rows
        if d.column in VALUES:
            continue
        if d.column == "data" and extent is not None:
            starts = np.array([a for a, _ in d.across], np.int64)
            lost[lo:hi] |= (extent[lo:hi, : len(starts)] > starts).all(axis=1)
        else:
            lost[lo:hi] = True
    return lost


def cells(damages: list[Damage], columns, rows: np.ndarray, col: int) -> np.ndarray:
    """Whether each of ``rows`` (table rows) is unreadable in layer column ``col``
    of any of ``columns``."""
    rows = np.asarray(rows, np.int64)
    out = np.zeros(len(rows), bool)
    for d in damages:
        if d.column in columns and (not d.across or d.across[0][0] <= col < d.across[0][1]):
            out |= (rows >= d.rows[0]) & (rows < d.rows[1])
    return out


def words(d: Damage, steps: np.ndarray | None, layers: list[str] | None) -> str:
    """One missing chunk in words: where, which rows (their steps, where known),
    which layers of a stats table, and what reads as missing."""
    lo, hi = d.rows
    if steps is not None and len(steps) >= hi and (steps[lo:hi] >= 0).all():
        held = np.unique(steps[lo:hi])
        at = f"steps {held[0]}-{held[-1]}" if len(held) > 1 else f"step {held[0]}"
    else:
        at = "steps unknown"
    span = f"rows {lo}-{hi - 1} ({at})"
    if layers is not None and d.across and d.column in ("stats", "hist"):
        a, b = d.across[0][0], min(d.across[0][1], len(layers))
        if b > a:
            span += f", layers {layers[a]}" + (f" .. {layers[b - 1]}" if b - a > 1 else "")
    return f"{d.where} {d.why}: {span}: {d.effect}"


class Ledger:
    """What a reader knows of a run's damage, table by table: the unreadable chunks
    found (missing, or undecodable when read), the rows they make unreadable and
    their words.  Damage found while a table is checked is held (``hold``) until
    the check takes it (``take``).  Thread-safe: a lazy read finds damage on
    dask's threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tables: dict[str, tuple[list[Damage], np.ndarray, list[str]]] = {}
        self._held: dict[str, list[Damage]] = {}
        self.extents: dict[str, np.ndarray] = {}   # a tensor table's (which rows a data chunk holds)

    def found(self, path: str) -> list[Damage]:
        return self._tables[path][0] if path in self._tables else []

    def lost(self, path: str) -> np.ndarray | None:
        """Which of the table's committed rows are not read at all (None: no damage)."""
        return self._tables[path][1] if path in self._tables else None

    def notes(self, path: str) -> list[str]:
        return self._tables[path][2] if path in self._tables else []

    def hold(self, d: Damage) -> None:
        with self._lock:
            held = self._held.setdefault(d.table, [])
            if d not in held:
                held.append(d)

    def take(self, path: str) -> list[Damage]:
        with self._lock:
            return self._held.pop(path, [])

    def add(self, path: str, damages: list[Damage], n: int, steps: np.ndarray | None,
            layers: list[str] | None) -> list[str]:
        """Record ``damages`` of a table of ``n`` committed rows (``steps``, ``layers``:
        for their words, where known); the words of those not known before."""
        with self._lock:
            found, _, notes = self._tables.get(path, ([], None, []))
            new = [d for d in dict.fromkeys(damages) if d not in found]
            if not new:
                return []
            said = [words(d, steps, layers) for d in new]
            found = found + new
            self._tables[path] = (found, lost_rows(found, n, self.extents.get(path)), notes + said)
            return said
