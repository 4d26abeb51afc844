"""The writer: the rank's durable state and its store, behind a worker thread.

``Writer`` is the training thread's handle (``put``, ``flush``, ``close``,
``tell``); ``_Rows`` is what runs on the worker thread (``_worker.Worker``): for
each step record (``_record``: the thread contract) it interprets the
statistics and events (``StepRecord.resolve``), asks the ``TensorPolicy``
which full tensors to store, writes the rows into the store's tables,
remembers them in the ``Journal`` until they are committed, and commits (data
first, counters after) at least every ``flush_interval`` seconds.  A record it
cannot interpret loses its statistics (counted), never the store.  The
``CloseRecord`` at close brings what was counted since the last step.

When the store cannot be written (disk full, permissions, network), the rows
not committed stay in the journal (bounded), the full tensors meanwhile are
counted in ``dropped``, and every ``flush_interval`` (and at each flush) the
writer starts again from the last commit.  ``on_error`` says how the fault is
told: ``"raise"`` raises it on the training thread, ``"warn"`` warns once there.

Training never waits on the store for long: a worker that died, or made no
progress for ``close_timeout`` seconds, is given nothing more; each record it
is not given is counted with the reason in the recording's ``DropLedger``
(shared with the step buffer, so the counts travel with the next record), and
the training thread is told once.
``close`` waits at most ``close_timeout``; past it the run is marked
``interrupted`` and the warning says what was not committed.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from . import _overbudget, _scalars
from . import format as fmt
from ._config import RecorderConfig
from ._journal import Journal, Unsaved
from ._policy import TensorPolicy
from ._drops import DropLedger, cause
from ._record import CloseRecord, Resolved, StepRecord, TensorRow
from ._store import RunStore
from ._worker import Barrier, Notice, Worker
from ._quiet import warn
from .errors import RecorderError

__all__ = ["Writer"]

DTYPE_OR_RANK = "full tensor changed dtype or rank"
UNWRITABLE = "store could not be written"
BACKLOG = "statistics past the backlog kept while the store could not be written"


class _Rows:
    """The worker thread's side: records in, rows and commits out."""

    def __init__(self, store: RunStore, state: fmt.RankState, root_base: dict[str, Any] | None,
                 config: RecorderConfig, outbox: collections.deque, claim=None):
        self.store, self.state, self.root_base = store, state, root_base
        self.claim = claim                     # rank 0's on the store: refreshed, then released
        self.config = config
        self.outbox = outbox                   # Notices for the training thread
        # mode="a" begins a new recording of the rank: of the steps it records, those up to
        # the rank's last step so far may be held by an older one, whose rows there are then
        # not read (``fmt.current_rows``) and whose events there are removed
        self.upto = state.last_step if config.mode == "a" else None
        if config.mode == "a":
            state.recording += 1
        self.policy = TensorPolicy(config, state.bytes_raw)
        self.journal = Journal(state)
        self._skipped: set[str] = set()
        self._fault: BaseException | None = None
        self._retry_at = 0.0
        self._last = time.monotonic()          # when the last commit ended
        self._took = 0.0                       # and how long it took: a slow store commits
                                               # less often, never back to back
        self._pending = False
        self.abandoned = False                  # close gave up: commit nothing more
        self.hurry = lambda: False              # the inbox's pressure (``Worker.pressed``): a
                                                # record's deferred summaries wait no more
        self.lock = threading.Lock()            # held by a commit's counters and by the give-up

    def _tell(self, key: str, message: str, error: BaseException | None = None) -> None:
        self.outbox.append(Notice(key, message, error))

    # --- the Handler protocol ---------------------------------------------------------
    def put(self, record: StepRecord | CloseRecord) -> None:
        self._keep(*self._unsaved(record))

    def _keep(self, u: Unsaved, tensors: list) -> None:
        if self._fault is None and self.journal.full(u):
            try:
                self._commit(None)         # bounds what a new start would write again
            except Exception as e:
                self.failed(e)
        u = self.journal.keep(u, BACKLOG)
        self._pending = True
        if self._fault is None:
            self._write(u, tensors)

    def _unsaved(self, record: StepRecord | CloseRecord) -> tuple[Unsaved, list]:
        """A record's rows as the journal keeps them, and the full tensors to store
        now (``TensorPolicy``)."""
        if isinstance(record, CloseRecord):
            scalars = _scalars.resolve(record.scalars, record.drops)
            return Unsaved(None, record.layers, record.drops, record.outside, [], {},
                           scalars=scalars), []
        resolved = self._resolve(record)
        choice = self.policy.choose(record.step, record.plan, record.tensors, bool(resolved.events))
        for n in choice.notices:
            self.outbox.append(n)
        record.tensors = []                # stored now, or held by the ring: not kept for a restart
        scalars = _scalars.resolve(record.scalars, record.drops)
        return Unsaved(record.step, record.layers, record.drops, record.outside, resolved.events,
                       resolved.stats, record.bundle, choice.rows, _overbudget.runs(choice.over),
                       scalars=scalars, counts=resolved.counts), choice.tensors

    def barrier(self, msg: Barrier) -> None:
        if msg.final and (lost := _overbudget.runs(self.policy.close())):   # the ring's due
            self._keep(Unsaved(None, [], {}, 0, [], {}, over_budget=lost), [])   # rows: lost
        if self._fault is not None:
            self._start_again(msg.status)
            return
        if msg.final:
            self.store.flush()
            self.store.trim()
        self._commit(msg.status)

    def tick(self) -> None:
        if self._fault is not None:
            if time.monotonic() >= self._retry_at:
                self._start_again(None)
        elif self._pending and time.monotonic() >= self._last + self.config.flush_interval + self._took:
            self._commit(None)

    def failed(self, e: BaseException) -> None:
        """A fault: start again from the last commit in ``flush_interval``.  At its
        first failure, ``raise`` hands the error to the training thread and
        ``warn`` warns there."""
        first = self._fault is None
        self._fault = e
        self._retry_at = time.monotonic() + self.config.flush_interval
        if first:
            self._tell("unwritable", (
                f"tensortape: the store cannot be written ({cause(e)}); training goes on, "
                f"statistics are kept in memory and written when it can be written again, and "
                f"full tensors meanwhile are dropped and counted in the run's 'dropped'"),
                e if self.config.on_error == "raise" else None)

    def last_words(self) -> None:
        if self._fault is not None:
            steps, rows = self.journal.pending_rows()
            self._tell("last words", (
                f"tensortape: the store could not be written when the run was closed "
                f"({cause(self._fault)}); the statistics of {steps} steps ({rows} rows) "
                f"since the last commit are lost"))
        self.store.close(wait=not self.abandoned)
        if self.claim is not None and not self.abandoned:   # after the last commit
            self.claim.release()

    # --- rows and commits -------------------------------------------------------------
    def _resolve(self, record: StepRecord) -> Resolved:
        """The record's statistics and events; a record that cannot be interpreted
        loses its statistics (counted), never the store."""
        try:
            return record.resolve(self.hurry)
        except Exception as e:
            reason = f"statistics failed ({cause(e)})"
            record.drops[reason] = record.drops.get(reason, 0) + len(record.metas)
            self._tell(reason, f"tensortape: the statistics of step {record.step} could not "
                               f"be computed ({cause(e)}); they are dropped and counted")
            return Resolved()

    def _commit(self, status: str | None) -> None:
        if self.abandoned:
            return
        start = time.monotonic()
        self.state.committed.update(self.store.flush())
        root = None if self.root_base is None else fmt.root_attrs(self.state, self.root_base, status)
        with self.lock:                        # never after a close that gave up marked the run
            if self.abandoned:
                return
            self.store.commit(self.state, root)
        self.journal.committed(self.state)
        self._last, self._pending = time.monotonic(), False
        self._took = self._last - start
        if self.claim is not None and not self.claim.refresh():
            self._tell("claim", f"tensortape: this job's claim on the store was lost "
                                f"({self.claim.lost}); another job may now write there")

    def _start_again(self, status: str | None) -> None:
        """From the last commit: the committed state, then the journal's steps
        (their full tensors counted as dropped), then a commit."""
        self.store.reset()
        self.state, unsaved = self.journal.start_again()
        for u in unsaved:
            self._write(u, [])
            self._drop(UNWRITABLE, u.tensors)
        self._commit(status)
        self._fault = None

    def _drop(self, reason: str, n: int) -> None:
        if n:
            self.state.dropped += n
            self.state.drop_reasons[reason] = self.state.drop_reasons.get(reason, 0) + n

    def _write(self, u: Unsaved, tensors: list[tuple[int, list[TensorRow]]]) -> None:
        st = self.state
        if u.bundle is not None:                 # before the event that names it
            self.store.write_bundle(*u.bundle)
        st.layers.extend(u.layers)
        for reason, n in u.drops.items():
            self._drop(reason, n)
        st.outside_steps += u.outside
        if self.upto is not None:
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
            self.store.append_scalars(step, _scalars.ids(st, names), values,
                                      st.committed.get(fmt.scalars_table(st.rank), 0), st.recording)
        for step, rows in tensors:
            for row in rows:
                self._write_tensor(step, row)

    def _recorded_again(self, runs: list) -> None:
        """This recording records the steps of ``runs`` (``fmt.note_step``'s, a
        record's and those merged into it); those up to ``upto`` an older recording
        may hold: noted in the state (readers then read none of the older rows
        there), and the older recordings' events and ``over_budget`` there are
        removed (``events_total`` with them)."""
        st = self.state
        spans = [(first, min(last, self.upto), stride) for _, first, last, stride in runs
                 if first <= self.upto]
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
        st = self.state
        path = fmt.tensor_group(st.rank, row.kind, row.layer)
        row.snap.unpin()                 # the store may write it later: the slot goes back now
        host = row.snap.host()
        n = self.store.append_tensor(row.kind, row.layer, step, row.micro, host,
                                     st.committed.get(path, 0), st.recording)
        if n is not None:
            st.bytes_raw += n
            return
        self._drop(DTYPE_OR_RANK, 1)     # counted, with its reason, and told once a table
        if path not in self._skipped:
            self._skipped.add(path)
            self._tell(path, f"tensortape: {row.kind} of {row.layer!r} changed rank or dtype at "
                             f"step {step} (now {host.dtype}{list(host.shape)}); its full "
                             f"tensors of such steps are not stored, and are counted in the "
                             f"run's 'dropped' (its statistics are kept)")


class Writer:
    """The training thread's handle on the rank's writer thread."""

    def __init__(self, store: RunStore, state: fmt.RankState, root_base: dict[str, Any] | None,
                 config: RecorderConfig, drops: DropLedger, claim=None):
        self.config = config
        self.store = store
        self.root_base = root_base
        self.drops = drops                     # the recording's, shared with the step buffer
        self._carry: tuple[list[str], int] | None = None   # new names and passes outside of
                                               # records the worker was not given
        self._told: set[str] = set()
        self._error: BaseException | None = None
        self._sent_step: int | None = None
        outbox: collections.deque = collections.deque()
        self.rows = _Rows(store, state, root_base, config, outbox, claim)
        self.worker = Worker(self.rows, outbox, max_bytes=config.max_pending_bytes,
                             poll=min(0.05, config.flush_interval / 4),
                             stall=config.close_timeout, progress=lambda: store.pool.progress)
        self.rows.hurry = self.worker.pressed

    # --- training-thread side ------------------------------------------------------------
    def put(self, record: StepRecord | CloseRecord) -> None:
        """Hand a record to the worker (waiting while it is busy and making
        progress); if it cannot take it, the record's captures are counted as
        dropped, with the reason, in the ledger, the record's own counts go back
        there, its new names and passes outside travel with the next record, and
        ``tell`` says so once."""
        if self._carry is not None:      # what records not handed over had: it travels on
            layers, outside = self._carry
            record.layers[:0] = layers
            record.outside += outside
        why = self.worker.send(record, record.nbytes)
        if why is None:
            self._carry = None
            if isinstance(record, StepRecord):
                self._sent_step = record.step
            return
        self._carry = (record.layers, record.outside)
        self.drops.restore(record.drops)
        if isinstance(record, CloseRecord):
            self.drops.drop(why, 0)
            what = "what was counted since the last step is"
        else:
            for row in record.tensors:
                row.snap.release()
            self.drops.drop(why, len(record.metas) + sum(len(s.names) for s in record.scalars))
            what = f"the captures of step {record.step} and of later steps while it stays so are"
        self._notice(Notice(why, f"tensortape: {why}; {what} dropped and counted in the run's "
                                 f"'dropped'; training goes on",
                            RecorderError(why) if self.config.on_error == "raise" else None))

    def flush(self) -> None:
        """Wait until everything put is written and committed (at most
        ``close_timeout`` without progress)."""
        if not self.worker.barrier(Barrier(), None):
            why = self.worker.trouble() or "it did not finish"
            self._notice(Notice("flush", f"tensortape: a flush could not be committed ({why}); "
                                         f"what was not committed is counted when it is lost"))
        self.tell()

    def close(self, status: str) -> None:
        """Write everything, commit with ``status``, and end the worker, within
        ``close_timeout``; past it mark the run ``interrupted`` and say what was
        not committed.  Never raises but what ``tell`` raises."""
        deadline = time.monotonic() + self.config.close_timeout
        done = self.worker.barrier(Barrier(status, final=True), deadline)
        if done:
            self.worker.thread.join(max(0.0, deadline - time.monotonic()))
        else:
            self._give_up(deadline)
        self.tell()

    def post_nowait(self, record: StepRecord | CloseRecord) -> None:
        """From a finaliser: hand over a record without a lock or a wait."""
        self.worker.post_nowait(record)

    def close_nowait(self) -> None:
        """From a finaliser: ask the worker to end the run ``interrupted``; no lock,
        no wait."""
        self.worker.post_nowait(Barrier(fmt.STATUS_INTERRUPTED, final=True))

    def _give_up(self, deadline: float) -> None:
        why = self.worker.trouble() or "it did not finish in time"
        self.rows.abandoned = True
        if self.rows.claim is not None:           # the worker may still write: kept till exit
            self.rows.claim.keep()
        last = self.rows.journal.last_committed_step
        after = "nothing was committed" if last is None else f"the last committed step is {last}"
        note = (f"the writer did not commit within close_timeout={self.config.close_timeout:g} s "
                f"({why}); {after}, and later steps"
                + (f" (up to step {self._sent_step})" if self._sent_step is not None else "")
                + " are not stored")
        if self.root_base is not None:            # rank 0 marks the run, if the store answers
            mark = threading.Thread(target=self._mark_interrupted, args=(note,), daemon=True)
            mark.start()
            mark.join(max(1.0, min(5.0, self.config.close_timeout)))
        self._notice(Notice("close", f"tensortape: {note}; the run is marked 'interrupted'"))

    def _mark_interrupted(self, note: str) -> None:
        try:
            with self.rows.lock:
                self.store.root.update_attributes({"status": fmt.STATUS_INTERRUPTED, "note": note})
        except Exception:                        # the store does not answer: it stays 'recording'
            pass

    def tell(self) -> None:
        """Issue the worker's notices here, on the training thread (once per cause),
        then raise the first error ``on_error="raise"`` asked for."""
        out = self.worker.outbox
        while out:
            self._notice(out.popleft())
        if self._error is not None:
            err, self._error = self._error, None
            raise RecorderError(f"writing the store failed: {cause(err)}; the steps committed "
                                f"before this are intact (on_error='warn' trains on through such "
                                f"faults and writes again when it can)") from err

    def _notice(self, n: Notice) -> None:
        if n.key in self._told:
            return
        self._told.add(n.key)
        if n.error is not None:
            self._error = self._error or n.error
        else:
            warn(n.message)
