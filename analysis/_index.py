"""What a run holds, and whether it can be trusted: its attributes, its ranks'
committed states, each table's committed rows (checked against the arrays
before any is read) and, of those rows, the ones a reader reads.

``RunIndex`` reads attributes only when it opens; a table is checked the first
time it is read, once.  It answers for the readers (``_stats``, ``_tensors``,
``_events``), which never read a row it has not checked.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

import numpy as np

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import ConfigError, RecorderError, StoreFormatError, TensortapeWarning

from . import _damage
from ._source import open_source, said
from ._tables import Tables, for_version

__all__ = ["RunIndex"]


class RunIndex:
    """A run's attributes, ranks and committed rows, and the checks that make its
    tables safe to read.  ``tables``: the reader of its format version."""

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
        self._damage = _damage.Ledger()
        self._refusing: str | None = None       # what copies the chunks as stored (``refusing``)
        self._keys: dict[str, dict] = {}   # a table's key columns (step, ...), read by its check
        self._current: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        self._pyramids: dict[tuple[str, int, int], list] = {}
        self.source.sink = self._undecodable

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
        self.ranks = sorted(r for r in map(fmt.rank_of, self.source.groups()) if r is not None)
        self.states = {r: fmt.RankState.from_json(self.source.attrs(fmt.rank_group(r)),
                                                  f"{self.path!r} rank {r}") for r in self.ranks}
        self._kinds: dict = {}
        for r, st in self.states.items():          # the group says which rank an event is
            st.events = [dataclasses.replace(e, rank=r) for e in st.events]
        self.tables: Tables = for_version(version)(self.source, self.path, attrs.get("created"),
                                                   self.table_rows)

    def only(self, rank: int) -> "RunIndex":
        """The index of one rank (its checks and rows shared with this one)."""
        rank = self.rank(rank)
        view = copy.copy(self)
        view.ranks, view.states = [rank], {rank: self.states[rank]}
        return view

    # --- ranks, kinds and layers -------------------------------------------------
    def rank(self, rank: int | None) -> int:
        """``rank``, checked; None: the first rank (0 in an empty run)."""
        if rank is None:
            if not self.ranks:           # killed while attaching: an empty run, not an error
                self.states.setdefault(0, fmt.RankState())
                return 0
            return self.ranks[0]
        if rank not in self.ranks:
            raise ConfigError(f"rank {rank} is not in this run; its ranks are {self.ranks}")
        return rank

    def state(self, rank: int | None = None) -> fmt.RankState:
        return self.states[self.rank(rank)]

    def committed(self, rank: int) -> dict[str, int]:
        return self.states[rank].committed

    def table_rows(self, path: str) -> int:
        """The committed rows of the table at ``path`` (0: none, or no such rank); a
        ``nonfinite`` table's are the rank state's ``nonfinite``."""
        table = fmt.parse_path(path)
        st = self.states.get(table.rank)
        if st is None:
            return 0
        return (st.nonfinite or {}).get(path, 0) if table.section == "nonfinite" \
            else st.committed.get(path, 0)

    def kinds_of(self, rank: int | None = None) -> list[str]:
        rank = self.rank(rank)
        if rank not in self._kinds:           # a snapshot: each rank's kinds found once
            found = {fmt.parse_path(p).kind for p, n in self.states[rank].committed.items() if n}
            self._kinds[rank] = [k for k in fmt.KINDS if k in found]
        return list(self._kinds[rank])

    def layers_of(self, rank: int | None = None) -> list[str]:
        return list(self.state(rank).layers)

    def kind(self, kind: str, rank: int) -> str:
        """``kind``, checked: one that ``rank`` recorded."""
        if kind not in self.kinds_of(rank):
            hint = (f" ({kind!r} is a layer, not a kind: name the arguments, e.g. "
                    f"histogram(layer={kind!r}, kind=...), stats(kind=..., layers={kind!r}))"
                    if isinstance(kind, str) and kind in self.layers_of(rank) else "")
            raise ConfigError(f"kind {kind!r} was not recorded in this run; recorded kinds: "
                              f"{', '.join(self.kinds_of(rank)) or 'none'}{hint}")
        return kind

    def stats_layers(self, kind: str, rank: int) -> list[str]:
        """The layer columns of ``rank``'s stats table of ``kind``."""
        return list(self.states[rank].stats_layers.get(kind, []))

    # --- rows ---------------------------------------------------------------------
    def current_rows(self, path: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The committed rows of a table that a reader reads, and every row's step:
        of each step, only the rows of the latest recording that recorded it (a job
        resumed with mode="a" from an earlier checkpoint records steps again;
        ``fmt.current_rows``), less those a missing chunk makes unreadable
        (``_damage``).  Read once: a run reads the committed rows of when it was
        opened."""
        got = self._current.get((rank, path))
        if got is None:
            got = self._current[(rank, path)] = self._read_rows(path, rank)
        return got

    def _read_rows(self, path: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        n = self.checked_rows(path, rank)
        steps = self._keys.get(path, {}).get("step")
        if steps is None:
            steps = np.asarray(self.source.array(path + "/step")[:n]) if n else np.zeros(0, np.int64)
        runs = self.states[rank].rerecorded
        recordings = None
        if runs:
            recordings = np.asarray(self.source.array(f"{path}/{fmt.RECORDING}")[:n]) \
                if self.source.has(f"{path}/{fmt.RECORDING}") else np.zeros(n, np.int64)
        current = fmt.current_rows(steps, recordings, runs)
        lost = self._damage.lost(path)
        return (current if lost is None else current[~lost[current]]), steps

    def pyramid(self, path: str, rank: int, grain: int, rows: np.ndarray):
        """A stats table's stored pyramid level of ``grain`` rows a grain, and how many
        of its first grains a reader of ``rows`` (the table's rows it reads, in order)
        may trust: grains of rows that are committed, that the rank state says the
        pyramid covers, and that are read as stored (the rows read begin with the
        physical rows, in order: no step recorded again before them), each shard of
        them there.  ``(None, 0)`` for a table without one (older stores, exports)."""
        key = (path, rank, grain)
        if key not in self._pyramids:
            self._pyramids[key] = [self._level(path, grain), 0]
        got = self._pyramids[key]
        arr = got[0]
        if arr is None:
            return None, 0
        if int(arr.shape[1]) != int(self.source.array(f"{path}/stats").shape[1]):
            return None, 0          # widened by a writer that kept no pyramid (an older one)
        covered = min(self.states[rank].pyramid.get(path, 0), self.checked_rows(path, rank),
                      *(d.rows[0] for d in self.damage(path, rank)))   # a grain of rows
        head = np.asarray(rows[:covered])
        moved = np.flatnonzero(head != np.arange(len(head)))
        n = min((int(moved[0]) if len(moved) else len(head)) // grain, int(arr.shape[0]))
        if n > got[1]:
            shard = int((getattr(arr, "shards", None) or arr.chunks)[0])
            where = f"{path}/{fmt.pyramid_level(grain)}"
            if self.source.missing_chunks(where, (f"c/{i}/0/0" for i in range(-(-n // shard)))):
                got[0] = None               # a partial copy: the rows are read instead
                return None, 0
            got[1] = n
        return arr, n

    def distrust(self, path: str, rank: int, grain: int, error: Exception) -> None:
        """A stored pyramid level that failed to read (``error``): its grains are read
        from the rows from now on, as of a store without one; said once."""
        self._pyramids[(path, rank, grain)] = [None, 0]
        warnings.warn(f"tensortape: {self.path}: {error}; the map reads the rows instead",
                      TensortapeWarning, stacklevel=3)

    def _level(self, path: str, grain: int):
        """The array of a stats table's pyramid level, if it is one this reader reads."""
        if self.tables.version != 3:
            return None
        try:                                # one read of its metadata
            arr = self.source.array(f"{path}/{fmt.pyramid_level(grain)}")
        except KeyError:
            return None
        attrs = dict(arr.attrs)
        ok = (attrs.get("grain") == grain and attrs.get("stats") == list(fmt.PYRAMID_STATS)
              and arr.ndim == 3 and arr.shape[2] == len(fmt.PYRAMID_STATS))
        return arr if ok else None

    # --- checks -------------------------------------------------------------------
    def checked_rows(self, path: str, rank: int) -> int:
        """A table's committed rows, once its arrays are checked against them: each
        array is there, holds the committed rows, and a row has a sane size.  A
        chunk of them that is missing, or of its key columns that cannot be decoded,
        is damage, named once in a warning: its rows read as missing (``_damage``;
        ``damage``)."""
        n = self.table_rows(path)
        if path in self._valid or not n:
            return n
        table = fmt.parse_path(path)
        try:
            arrays, gone = {}, []
            for name in self.tables.columns(path):
                if not self.source.has(f"{path}/{name}"):
                    if name not in fmt.OPTIONAL_COLUMNS:   # the whole column's rows: damage
                        gone.append(_damage.Damage(path, name, "", (0, n), ()))
                    continue
                arr = arrays[name] = self.source.array(f"{path}/{name}")
                self._check_array(f"{path}/{name}", arr, n)
            for d in gone:
                self._damage.hold(d)
            if table.section == "stats" and self.tables.width_column in arrays:
                width = int(arrays[self.tables.width_column].shape[1])
                if width < len(self.states[rank].stats_layers.get(table.kind, [])):
                    raise StoreFormatError(f"{self.path!r}: {path} has {width} layer columns, "
                                           f"fewer than its layer names")
            notes = self._check_chunks(path, arrays, n, table)
        except RecorderError:
            raise
        except Exception as e:
            raise StoreFormatError(f"{self.path!r}: table {path} cannot be read "
                                   f"({type(e).__name__}: {e})") from e
        self._valid.add(path)
        self._say(notes, stacklevel=4)
        return n

    def _say(self, notes: list[str], stacklevel: int) -> None:
        """One warning naming damage found."""
        if notes:
            shown = "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")
            warnings.warn(f"tensortape: {self.path}: {shown}; the rest of the run reads as "
                          f"recorded", TensortapeWarning, stacklevel=stacklevel)

    def _undecodable(self, where: str, key: str, box, error: Exception, fill):
        """The source's sink (``_source.Guarded``): a stored object of the array at
        ``where`` that cannot be decoded.  In a table's column it is damage (held
        while the table is checked, else named in a warning now), and its cells read
        as missing (``_damage.missing``); elsewhere (a pyramid level, a bundle), and
        under ``refusing``, it is not salvaged (None, or a refusal)."""
        path, _, column = where.rpartition("/")
        try:
            table = fmt.parse_path(path)
        except StoreFormatError:
            return None
        n = self.table_rows(path)
        if not n or column not in self.tables.columns(path):
            return None
        (lo, hi), across = box[0], tuple(box[1:])
        if lo >= n:                         # rows not committed: never read as recorded
            return _damage.missing(column, fill)
        d = _damage.Damage(path, column, key, (lo, min(hi, n)), across,
                           why=f"cannot be read ({said(error)})")
        if self._refusing:
            self._refuse(self._refusing, [_damage.words(d, None, None)])
        if path not in self._valid:         # the table's check names it
            self._damage.hold(d)
        else:
            read = next((v for k, v in self._current.items() if k[1] == path), None)
            self._say(self._damage.add(path, [d], n, read[1] if read else None,
                                       self.stats_layers(table.kind, table.rank)
                                       if table.section == "stats" else None), stacklevel=2)
        return _damage.missing(column, fill)

    def keys(self, path: str, rank: int) -> dict[str, np.ndarray]:
        """A table's key columns (``_damage.KEYS``) it has, of its committed rows, as
        its check read them (empty for a table without rows)."""
        self.checked_rows(path, rank)
        return self._keys.get(path, {})

    def damage(self, path: str, rank: int) -> list:
        """The damage known of a table's committed rows (``_damage.Damage``): its
        missing chunks, and those found undecodable so far."""
        self.checked_rows(path, rank)
        return self._damage.found(path)

    def damage_notes(self, ranks=None) -> list[str]:
        """Every known damage of the committed rows of ``ranks`` (default: every
        rank), in words: where, which rows and steps, and what reads as missing."""
        notes = []
        for r in self.ranks if ranks is None else ranks:
            st = self.states[r]
            for path, n in {**st.committed, **(st.nonfinite or {})}.items():
                if n and self.damage(path, r):
                    notes += self._damage.notes(path)
        return notes

    def lost(self, path: str, rank: int) -> np.ndarray:
        """Which of a table's committed rows damage keeps from being read (as known)."""
        n = self.checked_rows(path, rank)
        lost = self._damage.lost(path)
        return np.zeros(n, bool) if lost is None else lost

    def lost_steps(self, path: str, rank: int) -> np.ndarray:
        """The steps (where known) of a table's rows that damage keeps from being read."""
        lost = self.lost(path, rank)
        if not lost.any():
            return np.zeros(0, np.int64)
        steps = self.current_rows(path, rank)[1]
        return np.unique(steps[lost & (steps >= 0)])

    @contextlib.contextmanager
    def refusing(self, what: str):
        """Within it, damage of the committed rows raises ``StoreFormatError``: a chunk
        missing (at once) or found undecodable (when read).  ``what`` copies the chunks
        as stored, and would write the lost rows as the values they read as."""
        self._refuse(what, self.damage_notes())
        self._refusing = what
        try:
            yield
        finally:
            self._refusing = None

    def _refuse(self, what: str, notes: list[str]) -> None:
        if notes:
            more = f" and {len(notes) - 1} more" if len(notes) > 1 else ""
            raise StoreFormatError(f"{self.path!r} is damaged ({notes[0]}{more}); {what} copies "
                                   f"the chunks as stored, so it refuses a damaged run (its lost "
                                   f"rows would read as recorded values in the copy)")

    def unreadable(self, path: str, rank: int, columns, rows, col: int) -> np.ndarray:
        """Whether each of a table's ``rows`` is unreadable in layer column ``col``
        of any of ``columns`` (known damage; ``_damage.STATS``: the statistics,
        whichever way the format packs them)."""
        return _damage.cells(self.damage(path, rank), columns, rows, col)

    def _check_array(self, where: str, arr, n: int) -> None:
        """An array holds ``n`` rows of a dtype tensortape writes, each of a sane size."""
        shape = tuple(int(s) for s in arr.shape)
        if not shape or shape[0] < n:
            raise StoreFormatError(f"{self.path!r}: {where} holds {shape[0] if shape else 0} "
                                   f"rows, fewer than the {n} committed")
        if np.dtype(arr.dtype).name not in fmt.STORED_DTYPES:
            raise StoreFormatError(f"{self.path!r}: {where} holds {arr.dtype}, which "
                                   f"tensortape never writes; refusing to decode it")
        row = int(np.prod(shape[1:], dtype=object)) * np.dtype(arr.dtype).itemsize
        if row > self.MAX_ROW_BYTES:
            raise StoreFormatError(f"{self.path!r}: {where} claims {row} bytes a row; "
                                   f"refusing to read it")

    def _check_chunks(self, path: str, arrays: dict, n: int, table: fmt.TablePath) -> list[str]:
        """A table's readable extents fit its data; its key columns (``_damage.KEYS``)
        are read, and each chunk of them that cannot be decoded is damage, as is, in
        a table that stores every chunk (``fmt.EVERY_CHUNK``), each chunk its first
        ``n`` rows need that is missing (``_damage``): kept with the rows it makes
        unreadable; its words are returned.  Each chunk read is checked by the
        source itself (a regular file of a sane size)."""
        every = bool(self.source.attrs(path).get(fmt.EVERY_CHUNK))
        data = arrays.get("data")
        rest = {k: v for k, v in arrays.items() if k != "data" or data.ndim < 2}
        found = _damage.find(self.source, path, rest, n, None) if every else []
        keys = {k: np.asarray(v[:n]) for k, v in arrays.items() if k in _damage.KEYS}
        keys.setdefault("step", np.full(n, -1, np.int64))   # a key column missing: its rows
        if "extent" in self.tables.columns(path):             # are lost (``_damage``)
            keys.setdefault("extent", np.zeros((n, data.ndim - 1 if data is not None else 1),
                                               np.int64))
        found += [d for d in self._damage.take(path) if d not in found]
        extent = None
        if data is not None and data.ndim > 1:
            extent = keys["extent"][:, : data.ndim - 1]
            extent = np.where(_damage.lost_rows(found, n, None)[:, None], 0, extent)
            if extent.size and ((extent < 0) | (extent > np.array(data.shape[1:]))).any():
                raise StoreFormatError(f"{self.path!r}: {path}/extent claims a tensor larger "
                                       f"than {path}/data holds")
            self._damage.extents[path] = extent
            if every:
                found += _damage.find(self.source, path, {"data": data}, n, extent)
        self._keys[path] = keys
        layers = self.stats_layers(table.kind, table.rank) if table.section == "stats" else None
        return self._damage.add(path, found, n, keys["step"], layers)
