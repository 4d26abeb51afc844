"""How the tables of each format version are laid out and read: one reader per
version, chosen once when a run is opened (``for_version``).

- format 3: a stats table packs every statistic in one ``stats`` array (step,
  layer, statistic), beside ``hist``; a tensor table has ``data``, ``step``,
  ``micro`` and ``extent``.
- format 2: a stats table holds an array per statistic (step, layer).
- format 1: as 2, and a tensor table has no ``micro`` column (every row is
  micro-batch 0).

Any table a resumed recording appended to also has a ``recording`` column
(``format.RECORDING``).  Every read is lazy (dask), named so that a cluster
never serves an earlier read's results for a store that changed since.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensortape.recorder import format as fmt

__all__ = ["Tables", "TablesV1", "TablesV2", "as_slice", "for_version"]


def as_slice(index):
    """A list of ascending consecutive indices as a slice (an int, a slice or any
    other list as it is)."""
    if isinstance(index, (int, np.integer, slice)):
        return index
    index = np.asarray(index, dtype=np.int64)
    if len(index) and np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return slice(int(index[0]), int(index[0]) + len(index))
    return index


class Tables:
    """The tables of a format-3 store: what arrays a table has, and the lazy
    reads of them.  ``committed(path)``: a table's committed rows (they name a
    read, with the run's ``created``)."""

    version = 3
    width_column = "stats"          # the stats array whose second axis is the layers

    def __init__(self, source, location: str, created, committed: Callable[[str], int]):
        self.source, self.location, self.created = source, location, created
        self.committed = committed

    # --- layout ----------------------------------------------------------------
    def columns(self, path: str) -> tuple[str, ...]:
        """The arrays of the table at ``path`` as its format wrote them."""
        columns = self._columns(fmt.parse_path(path))
        if self.source.has(f"{path}/{fmt.RECORDING}"):     # a resumed recording appended to it
            return (*columns, fmt.RECORDING)
        return columns

    def _columns(self, table: fmt.TablePath) -> tuple[str, ...]:
        return table.columns

    # --- reads -------------------------------------------------------------------
    def lazy(self, path: str):
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
        token = tokenize(self.created, self.committed(path.rsplit("/", 1)[0]), tuple(arr.shape))
        return da.from_array(arr, chunks=chunks, lock=self.source.lock,
                             name=f"{self.location}:{path}-{token}")

    def stat(self, path: str, stat: str, rows, cols):
        """One statistic of the stats table at ``path``, at ``rows`` and layer
        columns ``cols`` (a list of column indices, or one), lazy.  Ranges are
        sliced in one indexing, which dask folds into the read: only the chunks
        they touch are read."""
        return _take(self.lazy(f"{path}/stats"), as_slice(rows), as_slice(cols),
                     (fmt.STATS.index(stat),))

    def stats(self, path: str, names, rows, cols, lazy: bool = True) -> dict:
        """``stat`` of each of ``names``, lazy (in format 3, slices of one read), or
        read at once with numpy (``lazy`` False)."""
        arr = self.lazy(f"{path}/stats") if lazy else self.source.array(f"{path}/stats")
        block = _take(arr, as_slice(rows), as_slice(cols), (), lazy)
        return {s: block[..., fmt.STATS.index(s)] for s in names}

    def stats_block(self, path: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of every statistic, as format 3 packs them (row, layer,
        statistic)."""
        return np.asarray(self.source.array(f"{path}/stats")[lo:hi])

    def micros(self, path: str, n: int) -> np.ndarray:
        """The micro-batch of each of a tensor table's first ``n`` rows."""
        if not self.source.has(f"{path}/micro"):        # damaged: as format 1 reads it
            return np.zeros(n, np.int64)
        return np.asarray(self.source.array(f"{path}/micro")[:n])


class TablesV2(Tables):
    """Format 2: a stats table holds an array per statistic (step, layer)."""

    version = 2
    width_column = "mean"

    def _columns(self, table: fmt.TablePath) -> tuple[str, ...]:
        return fmt.STATS_COLUMNS_V2 if table.section == "stats" else table.columns

    def stat(self, path: str, stat: str, rows, cols):
        return _take(self.lazy(f"{path}/{stat}"), as_slice(rows), as_slice(cols), ())

    def stats(self, path: str, names, rows, cols, lazy: bool = True) -> dict:
        if lazy:
            return {s: self.stat(path, s, rows, cols) for s in names}
        return {s: _take(self.source.array(f"{path}/{s}"), as_slice(rows), as_slice(cols), (),
                         False) for s in names}

    def stats_block(self, path: str, lo: int, hi: int) -> np.ndarray:
        return np.stack([np.asarray(self.source.array(f"{path}/{s}")[lo:hi])
                         for s in fmt.STATS], axis=2)


class TablesV1(TablesV2):
    """Format 1: as format 2, and a tensor table has no ``micro`` column: every
    row is micro-batch 0."""

    version = 1

    def _columns(self, table: fmt.TablePath) -> tuple[str, ...]:
        if table.section == "tensors":
            return tuple(c for c in table.columns if c not in fmt.OPTIONAL_COLUMNS)
        return super()._columns(table)

    def micros(self, path: str, n: int) -> np.ndarray:
        return np.zeros(n, np.int64)


def _take(arr, rows, cols, at: tuple, lazy: bool = True):
    """``arr`` at ``rows``, ``cols`` and ``at``; a store array (not ``lazy``) is read
    at ``rows`` (one index array, at most) and then indexed in memory."""
    if not lazy:
        return np.asarray(arr[rows])[(slice(None), cols, *at)]
    if isinstance(rows, slice) or isinstance(cols, (slice, int)):
        return arr[(rows, cols, *at)]
    return arr[rows][(slice(None), cols, *at)]


READERS = {1: TablesV1, 2: TablesV2, 3: Tables}


def for_version(version: int) -> type[Tables]:
    """The reader of a format version (one of ``format.READS_VERSIONS``)."""
    return READERS[version]
