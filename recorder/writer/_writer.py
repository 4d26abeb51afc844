"""The writer: the rank's records, turned into rows behind a worker thread.

``Writer`` is the training thread's handle (``put``, ``flush``, ``close``,
``tell``); ``_Rows`` is what runs on the worker thread (``_worker.Worker``): for
each step record (``_record``: the thread contract) it interprets the
statistics and events (``StepRecord.resolve``), asks the ``TensorPolicy``
which full tensors to store, hands the rows to the rank's ``RankLog`` (which
keeps them in its journal, writes them and counts them in the rank's state),
and has the log commit at least every ``flush_interval`` seconds.  A record it
cannot interpret loses its statistics (counted), never the store.  The
``CloseRecord`` at close brings what was counted since the last step.

When the store cannot be written (disk full, permissions, network), the rows
not committed stay in the log's journal (bounded), the full tensors meanwhile
are counted in ``dropped``, and every ``flush_interval`` (and at each flush) the
log starts again from the last commit.  ``on_error`` says how the fault is
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

import threading
import time

from . import _overbudget
from ..step import _scalars
from .. import format as fmt
from .._config import RecorderConfig
from ..store._journal import Unsaved
from ._policy import TensorPolicy
from ..step._drops import DropLedger, cause
from ..store._ranklog import RankLog
from ..step._record import CloseRecord, Resolved, StepRecord
from ._worker import Barrier, Notice, Worker, grace
from ..quiet import warn
from ..errors import RecorderError, StoreExistsError

__all__ = ["Writer"]

BACKLOG = "statistics past the backlog kept while the store could not be written"


class _Rows:
    """The worker thread's side: records in, rows to the log, commits on schedule."""

    def __init__(self, log: RankLog, config: RecorderConfig):
        self.log = log
        self.config = config
        self.outbox = log.notices              # Notices for the training thread
        self.policy = TensorPolicy(config, log.bytes_raw)
        self._fault: BaseException | None = None
        self._retry_at = 0.0
        self._last = time.monotonic()          # when the last commit ended
        self._took = 0.0                       # and how long it took: a slow store commits
                                               # less often, never back to back
        self._pending = False
        self.hurry = lambda: False              # the inbox's pressure (``Worker.pressed``): a
                                                # record's deferred summaries wait no more

    def _tell(self, key: str, message: str, error: BaseException | None = None) -> None:
        self.outbox.append(Notice(key, message, error))

    # --- the Handler protocol ---------------------------------------------------------
    def put(self, record: StepRecord | CloseRecord) -> None:
        self._keep(*self._unsaved(record))

    def _keep(self, u: Unsaved, tensors: list) -> None:
        if self._fault is None and self.log.journal.full(u):
            try:
                self._commit(None)         # bounds what a new start would write again
            except Exception as e:
                self.failed(e)
        kept = self.log.journal.keep(u, BACKLOG)    # None once the claim is lost: counted so
        self._pending = True
        if self._fault is None:                # lost: the full tensors' slots given back
            self.log.write(u if kept is None else kept, tensors)

    def _unsaved(self, record: StepRecord | CloseRecord) -> tuple[Unsaved, list]:
        """A record's rows as the journal keeps them, and the full tensors to store
        now (``TensorPolicy``)."""
        if isinstance(record, CloseRecord):
            scalars = _scalars.resolve(record.scalars, record.drops)
            return Unsaved(None, record.layers, record.drops, record.outside, [], {},
                           scalars=scalars), []
        resolved = Resolved() if self.log.lost else self._resolve(record)   # never stored
        choice = self.policy.choose(record.step, record.plan, record.tensors, bool(resolved.events))
        for n in choice.notices:
            self.outbox.append(n)
        record.tensors = []                # stored now, or held by the ring: not kept for a restart
        scalars = _scalars.resolve(record.scalars, record.drops)
        return Unsaved(record.step, record.layers, record.drops, record.outside, resolved.events,
                       resolved.stats, record.bundle, choice.rows, _overbudget.runs(choice.over),
                       scalars=scalars, counts=resolved.counts,
                       captures=record.captures), choice.tensors

    def barrier(self, msg: Barrier) -> None:
        if msg.final and (lost := _overbudget.runs(self.policy.close())):   # the ring's due
            self._keep(Unsaved(None, [], {}, 0, [], {}, over_budget=lost), [])   # rows: lost
        if self._fault is not None:
            self._start_again(msg.status)
            return
        self._commit(msg.status, msg.final)

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
            steps, rows = self.log.pending()
            self._tell("last words", (
                f"tensortape: the store could not be written when the run was closed "
                f"({cause(self._fault)}); the statistics of {steps} steps ({rows} rows) "
                f"since the last commit are lost"))
        self.log.close()
        lost = self.log.journal.unstored
        if lost is not None and lost.steps:
            self._tell("unstored", f"tensortape: this job could not commit {lost.words()} to "
                                   f"{self.log.claim.location!r} once it lost the run to another "
                                   f"job: their {lost.captures} captures are counted in the "
                                   f"Recorder's 'dropped', not in the run")

    # --- commits ----------------------------------------------------------------------
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

    def _commit(self, status: str | None, final: bool = False) -> None:
        start = time.monotonic()
        self.log.commit(status, final)
        self._last, self._pending = time.monotonic(), False
        self._took = self._last - start

    def _start_again(self, status: str | None) -> None:
        """From the last commit (``RankLog.start_again``), then a commit."""
        self.log.start_again()
        self._commit(status)
        self._fault = None


class Writer:
    """The training thread's handle on the rank's writer thread."""

    def __init__(self, log: RankLog, config: RecorderConfig, drops: DropLedger):
        self.config = config
        self.log = log
        self.drops = drops                     # the recording's, shared with the step buffer
        self._carry: tuple[list[str], int] | None = None   # new names and passes outside of
                                               # records the worker was not given
        self._told: set[str] = set()
        self._error: BaseException | None = None
        self._sent_step: int | None = None
        self.rows = _Rows(log, config)
        pool = log.store.pool
        self.worker = Worker(self.rows, log.notices, max_bytes=config.max_pending_bytes,
                             poll=min(0.05, config.flush_interval / 4),
                             stall=config.close_timeout, progress=lambda: pool.progress)
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
            self.drops.drop(why, record.captures)
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
            self.give_up()
        self.tell()

    @property
    def unstored(self) -> int:
        """Captures never stored because the claim was lost (the store may not count them)."""
        lost = self.log.journal.unstored
        return 0 if lost is None else lost.captures

    def post_nowait(self, record: StepRecord | CloseRecord) -> None:
        """From a finaliser: hand over a record without a lock or a wait."""
        self.worker.post_nowait(record)

    def close_nowait(self) -> None:
        """From a finaliser: ask the worker to end the run ``interrupted``; no lock,
        no wait."""
        self.worker.post_nowait(Barrier(fmt.STATUS_INTERRUPTED, final=True))

    def give_up(self) -> None:
        """The worker did not end the run in time (at ``close``, or at exit for a
        Recorder never closed): commit nothing more, mark the run ``interrupted`` if
        the store answers, halt the worker, and say so."""
        why = self.worker.trouble() or "it did not finish in time"
        after = self.log.give_up()
        note = (f"the writer did not commit within close_timeout={self.config.close_timeout:g} s "
                f"({why}); {after}, and later steps"
                + (f" (up to step {self._sent_step})" if self._sent_step is not None else "")
                + " are not stored")
        # rank 0 marks the run, if the store answers: from a thread, waited for briefly
        mark = threading.Thread(target=self.log.mark_interrupted, args=(note,), daemon=True)
        mark.start()
        mark.join(grace(self.config.close_timeout))
        self.worker.halt(self.config.close_timeout)     # its work is not wanted now
        self._notice(Notice("close", f"tensortape: {note}; the run is marked 'interrupted'"))

    def tell(self) -> None:
        """Issue the worker's notices here, on the training thread (once per cause),
        then raise the first error ``on_error="raise"`` asked for."""
        out = self.worker.outbox
        while out:
            self._notice(out.popleft())
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, StoreExistsError):    # the claim is lost: said as it is
                raise err
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
