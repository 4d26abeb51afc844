"""``RankLog``: the one owner of a rank's durable state (``format.RankState``).

What a rank has committed, and whether it may still commit, is this class's
alone; nothing else reads, changes or writes a rank's state:

- **the open decision** (``open``): rank 0 looks at the path, claims the run and
  prepares its root; its outcome, a refusal included, is every rank's before
  any rank opens anything (``_ranks.rank0_decides``).  Then each rank opens its
  part and its state (new, or the stored one under ``mode="a"``), and every rank
  learns whether every other did (``_ranks.all_agree``): one answer everywhere,
  and no rank left waiting for another;
- **the bookkeeping** of each record the writer hands it (``write``): layers,
  drops, events, scalar names, steps recorded again, ``over_budget``, and the
  tables' rows (``_store.RunStore``);
- **the journal** of the steps not committed yet (``_journal``), written again
  from the last commit after a fault (``start_again``);
- **the commit** (``commit``), fenced by the claim: confirm the claim (within
  its lease without asking the store, ``_claim``; ranks other than 0 read it),
  flush the tables, read the claim (a ``pread`` of the lock file, one GET on
  S3), and only then write the counters (on S3 each record conditional on its
  ETag, ``claim._fenced``: another job's record is never overwritten).  Every
  write of rows is confirmed first as well.  A claim found lost
  stops every later write, commit and status write: the training thread is told
  once which steps this job could not commit (``StoreExistsError``, a
  ``RecorderError``, under ``on_error="raise"``), and training goes on (the
  steps never committed are counted in memory: ``_journal.Unstored``).

Threads: built on the training thread at attach; then the writer thread's
alone, but for the training thread's give-up at close (``give_up``), which
``lock`` serialises with a commit's counters.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import numpy as np

from ..writer import _overbudget
from .. import format as fmt
from ..claim._claim import Claim
from ..claim._fenced import fenced
from ._journal import Journal, Unsaved
from ..quiet import quiet
from ..claim._root import check_mode, open_root
from ._store import RunStore
from ..writer._worker import Notice
from ..errors import StoreExistsError

if TYPE_CHECKING:                    # torch is imported where a recording opens, not by migrate
    from .._config import RecorderConfig
    from ..step._record import TensorRow

__all__ = ["RankLog"]

DTYPE_OR_RANK = "full tensor changed dtype or rank"
UNWRITABLE = "store could not be written"


class RankLog:
    """A rank's state, its journal and its commits, fenced by the job's claim."""

    def __init__(self, store: RunStore, state: fmt.RankState, claim: Claim,
                 root_base: dict | None, config: RecorderConfig):
        self.store, self.claim, self.config = store, claim, config
        self.root_base = root_base          # the run's attributes (rank 0's; None on the others)
        self._state = state
        self.notices: collections.deque = collections.deque()   # for the training thread
        self.lock = threading.Lock()        # a commit's counters, and the give-up
        self.abandoned = False              # close gave up: commit nothing more
        self.lost = False                   # the claim is lost: write nothing more
        self._skipped: set[str] = set()     # tensor tables told of a changed dtype or rank
        # mode="a": of the steps recorded, those up to the rank's last may be held by an older
        # recording, whose rows there are not read (``fmt.current_rows``), events removed
        self._upto = None
        self.journal = Journal(state)
        self._fence = fenced(claim.location, [store.rank_group.path, store.root.path],
                             lambda: claim.confirm(read=True))   # S3: conditional

    # --- the open decision ------------------------------------------------------------
    @classmethod
    def open(cls, location: str, cfg: RecorderConfig, rank: int, world: int, model_class: str,
             metadata: dict) -> RankLog:
        """Open (or create, by ``cfg.mode``) the run at ``location`` for this rank, on
        every rank together (see the module)."""
        fresh = dict(tensortape_format=fmt.FORMAT_VERSION, status=fmt.STATUS_RECORDING,
                     torch_version=_torch_version(), model_class=model_class,
                     config=cfg.to_json(), metadata=metadata,
                     created=datetime.now(timezone.utc).isoformat())

        def decide():                       # rank 0: the mode applied to the run as a whole
            with quiet():
                check_mode(location, cfg.mode)
                claim = Claim.acquire(location, cfg.mode, world)
                try:
                    root = open_root(location, cfg.mode, claimed=claim.token, attributes=fmt.to_json(
                        fmt.root_attrs(fmt.RankState(), fresh)))
                except BaseException:
                    claim.release()
                    raise
            return (claim, root), claim.token
        from ._ranks import all_agree, rank0_decides
        opened, token = rank0_decides(decide, rank, world)
        claim, root = opened if rank == 0 else (Claim.shared(location, token), None)
        log, error = None, None
        try:
            if root is None:
                with quiet():
                    root = open_root(location, cfg.mode, rank)
            log = cls._opened(root, rank, cfg, claim, fresh, metadata)
        except Exception as e:
            error = e
        try:
            all_agree(error, rank, world)
        except BaseException:
            if log is not None:
                log.abandon()
            else:
                claim.release()
            raise
        return log

    @classmethod
    def _opened(cls, root, rank: int, cfg: RecorderConfig, claim: Claim, fresh: dict,
                metadata: dict) -> RankLog:
        store = RunStore(root, rank, cfg.compression)
        try:
            state = fmt.RankState(rank=rank, nonfinite={}) if cfg.mode != "a" else \
                fmt.RankState.from_json(store.attributes() or {"rank": rank, "nonfinite": {}})
            state.rank = rank
            store.pyramids = dict(state.pyramid)
            base = None
            if rank == 0:
                old = dict(root.attrs) if cfg.mode == "a" else {}
                base = {**old, **fresh, "created": old.get("created", fresh["created"]),
                        "metadata": metadata or old.get("metadata", {}),
                        fmt.CLAIM_TOKEN: claim.token}      # each commit says whose it is
            log = cls(store, state, claim, base, cfg)
            if rank == 0:
                log.commit()
            if cfg.mode == "a":             # a new recording, after the state as it was
                log._upto = state.last_step
                state.recording += 1
                log.journal = Journal(state)
        except BaseException:
            store.close(wait=False)
            raise
        return log

    def abandon(self) -> None:
        """What opened the run is given back (a failure before the writer took it)."""
        self.store.close(wait=False)
        self.claim.release()

    # --- what the Recorder and the writer read ------------------------------------------
    @property
    def last_step(self) -> int | None:
        return self._state.last_step

    @property
    def dropped(self) -> int:
        return self._state.dropped

    @property
    def outside_steps(self) -> int:
        return self._state.outside_steps

    @property
    def layers(self) -> list[str]:
        return list(self._state.layers)

    @property
    def bytes_raw(self) -> int:
        return self._state.bytes_raw

    def _tell(self, key: str, message: str, error: BaseException | None = None) -> None:
        self.notices.append(Notice(key, message, error))

    # --- the fence ---------------------------------------------------------------------
    def _confirmed(self, read: bool = False) -> bool:
        """Whether this job may still write (see ``_claim``: the fence); once not, it
        never may again, and the training thread is told once."""
        if self.lost or self.abandoned:
            return False
        if self.claim.confirm(read):
            return True
        self.lost = True
        self.journal.lose()
        last = self.journal.last_committed_step
        after = ("no step of this job is stored" if last is None else
                 f"the steps after step {last}, its last commit, are not stored")
        text = (f"tensortape: this job's claim on {self.claim.location!r} was lost "
                f"({self.claim.lost}); it writes nothing more there: {after}; training goes on")
        self._tell("claim", text,
                   StoreExistsError(text) if self.config.on_error == "raise" else None)
        return False

    # --- rows ---------------------------------------------------------------------------
    def write(self, u: Unsaved, tensors: list[tuple[int, list[TensorRow]]]) -> None:
        """Write a record's rows (``u``, and the full ``tensors`` to store now) and
        count them in the state; nothing once the claim is lost."""
        if not self._confirmed():
            for _, rows in tensors:
                for row in rows:
                    row.snap.release()
            return
        st = self._state
        if u.bundle is not None:                 # before the event that names it
            self.store.write_bundle(*u.bundle)
        st.layers.extend(u.layers)
        for reason, n in u.drops.items():
            self.drop(reason, n)
        st.outside_steps += u.outside
        if self._upto is not None:
            own = [] if u.step is None else [[0, u.step, u.step, 0]]
            self._recorded_again([*u.earlier, *own])
        _overbudget.count(st, u.over_budget)     # after the older counts were taken back
        st.events_total += u.events_total
        st.events.extend(dataclasses.replace(e, rank=st.rank)
                         for e in u.events[:max(fmt.MAX_EVENTS - len(st.events), 0)])
        if u.step is not None:
            st.last_step = u.step if st.last_step is None else max(st.last_step, u.step)
        for kind, rows in u.stats.items():
            names = st.stats_layers.setdefault(kind, [])
            known = set(names)
            names.extend(layer for layer in rows.layers if layer not in known)
            path = fmt.stats_group(st.rank, kind)
            self.store.append_stats(kind, u.step, names, rows.layers, rows.stats, rows.hist,
                                    st.committed.get(path, 0), st.recording)
        if st.nonfinite is not None:     # None: a run begun by a tensortape without the tables
            for kind, counts in u.counts.items():
                path = fmt.nonfinite_table(st.rank, kind)
                self.store.append_nonfinite(kind, u.step, st.layers, counts,
                                            st.nonfinite.get(path, 0), st.recording)
        for step, names, values in u.scalars:
            self.store.append_scalars(step, self._scalar_ids(names), values,
                                      st.committed.get(fmt.scalars_table(st.rank), 0), st.recording)
        for step, rows in tensors:
            for row in rows:
                self._write_tensor(step, row)

    def drop(self, reason: str, n: int) -> None:
        """``n`` captures dropped, with their reason."""
        if n:
            st = self._state
            st.dropped += n
            st.drop_reasons[reason] = st.drop_reasons.get(reason, 0) + n

    def _scalar_ids(self, names: list[str]) -> np.ndarray:
        """The index of each name in the state's ``scalar_names`` (new names appended)."""
        known = self._state.scalar_names
        index = {n: i for i, n in enumerate(known)}
        for n in names:
            if n not in index:
                index[n] = len(known)
                known.append(n)
        return np.array([index[n] for n in names], np.int64)

    def _recorded_again(self, runs: list) -> None:
        """This recording records the steps of ``runs`` (``fmt.note_step``'s, a
        record's and those merged into it); those up to ``_upto`` an older recording
        may hold: noted in the state (readers then read none of the older rows
        there), and the older recordings' events and ``over_budget`` there are
        removed (``events_total`` with them)."""
        st = self._state
        spans = [(first, min(last, self._upto), stride) for _, first, last, stride in runs
                 if first <= self._upto]
        if not spans:
            return
        for first, last, stride in spans:
            for step in range(first, last + 1, stride or 1):
                fmt.note_step(st.rerecorded, st.recording, step)
                _overbudget.take_back(st, step)
        kept = [e for e in st.events if not any(
            first <= e.step <= last and (e.step - first) % (stride or 1) == 0
            for first, last, stride in spans)]
        st.events_total -= len(st.events) - len(kept)
        st.events = kept

    def _write_tensor(self, step: int, row: TensorRow) -> None:
        st = self._state
        path = fmt.tensor_group(st.rank, row.kind, row.layer)
        row.snap.unpin()                 # the store may write it later: the slot goes back now
        host = row.snap.host()
        n = self.store.append_tensor(row.kind, row.layer, step, row.micro, host,
                                     st.committed.get(path, 0), st.recording)
        if n is not None:
            st.bytes_raw += n
            return
        self.drop(DTYPE_OR_RANK, 1)      # counted, with its reason, and told once a table
        if path not in self._skipped:
            self._skipped.add(path)
            self._tell(path, f"tensortape: {row.kind} of {row.layer!r} changed rank or dtype at "
                             f"step {step} (now {host.dtype}{list(host.shape)}); its full "
                             f"tensors of such steps are not stored, and are counted in the "
                             f"run's 'dropped' (its statistics are kept)")

    # --- commits ------------------------------------------------------------------------
    def commit(self, status: str | None = None, final: bool = False) -> None:
        """Commit what was written (``final``: every table cut to its rows first), with
        ``status`` (rank 0): confirm the claim, flush, read the claim, write the counters."""
        if not self._confirmed(read=self.claim.shared_by_rank):
            return
        st = self._state
        st.committed.update(self.store.flush())
        if final:
            self.store.trim()
        if not self._confirmed(read=True):
            return
        _covered(st, self.store)
        root = None if self.root_base is None else \
            fmt.to_json(fmt.root_attrs(st, self.root_base, status))
        with self.lock:                      # never after a close that gave up marked the run
            if self.abandoned:
                return
            written = self.store.commit(st.to_json(), root, self._fence and self._fence.put)
        if written:                          # else another job wrote it: the claim is lost
            self.journal.committed(st)
        else:
            self._confirmed()

    @staticmethod
    def commit_copy(store: RunStore, state: fmt.RankState, root_attrs: dict | None) -> None:
        """A rank's ``state`` copied by ``recorder.migrate``, with what ``store``'s
        tables hold, committed after their data; then the run's ``root_attrs``."""
        _covered(state, store)
        store.commit(state.to_json(), None if root_attrs is None else fmt.to_json(root_attrs))

    def start_again(self) -> None:
        """From the last commit, after a fault: the committed state, then the
        journal's steps written again (their full tensors counted as dropped); the
        caller commits."""
        saved, unsaved = self.journal.start_again()
        self.store.reset(saved.pyramid)
        self._state = saved
        for u in unsaved:
            self.write(u, [])
            self.drop(UNWRITABLE, u.tensors)

    def pending(self) -> tuple[int, int]:
        """Steps and statistics rows not committed."""
        return self.journal.pending_rows()

    # --- the end ------------------------------------------------------------------------
    def close(self) -> None:
        """End the store's write threads, and give the claim back (after the last
        commit; not when close gave up: the writer may still write)."""
        self.store.close(wait=not self.abandoned)
        if not self.abandoned:
            self.claim.release()

    def give_up(self) -> str:
        """Close gave up on the writer (training thread): commit nothing more, and hold
        the claim until the process ends (the writer may still write).  What is
        committed, in words."""
        self.abandoned = True
        self.claim.keep()
        last = self.journal.last_committed_step
        return "nothing was committed" if last is None else f"the last committed step is {last}"

    def mark_interrupted(self, note: str) -> None:
        """After ``give_up``, rank 0 marks the run ``interrupted`` with ``note``, if
        the claim is still this job's and the store answers (else it stays
        ``recording``).  Any thread; it may wait for the store."""
        if self.root_base is None or self.lost:
            return
        try:
            with self.lock:
                if self.claim.confirm(read=True):
                    self.store.commit(None, {"status": fmt.STATUS_INTERRUPTED, "note": note},
                                      self._fence and self._fence.put)
        except Exception:                    # the store does not answer: it stays 'recording'
            pass


def _covered(state: fmt.RankState, store: RunStore) -> None:
    """``state`` told what the store's open tables hold beside their committed rows:
    each ``nonfinite`` table's rows, and the rows each stats table's pyramid covers."""
    nonfinite, pyramids = store.covered()
    if state.nonfinite is not None:
        state.nonfinite.update(nonfinite)
    for path, rows in pyramids.items():
        if rows is None:
            state.pyramid.pop(path, None)
        else:
            state.pyramid[path] = rows


def _torch_version() -> str:
    """The recording's torch (imported here: ``migrate`` copies a run without torch)."""
    import torch
    return torch.__version__
