"""The background writer: it owns the run's durable state and the store.

The training thread only enqueues: finished ``StepRecord``s, and requests
to flush or close.  The writer thread interprets each record (its statistics
and non-finite events, ``StepRecord.resolve``), decides which full tensors to
store (the step's when it is persisted; the ring of recent steps, which it
holds, and the step's when a non-finite value is dumped; up to ``max_bytes``),
writes the rows into the store's tables, folds what changed (new layers,
events, drops) into the rank's ``RankState``, and commits, data first and
counters after, at least every ``flush_interval`` seconds.  A record it cannot
interpret loses its statistics (counted), never the store.

When the store cannot be written (disk full, permissions, network), the
writer keeps the statistics of the steps not yet committed in memory (up to
``BACKLOG_BYTES``), counts the full tensors it loses in ``dropped``, and every
``flush_interval`` (and at each flush) starts again from the last commit, which
the commit protocol makes a safe place to start from.  ``on_error`` only says
how the fault is told: ``"raise"`` hands it to the training thread, ``"warn"``
warns once.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from ._config import RecorderConfig
from ._step import Resolved, StepRecord, TensorRow
from ._store import RunStore
from .errors import RecorderError

__all__ = ["Writer"]

DTYPE_OR_RANK = "full tensor changed dtype or rank"
UNWRITABLE = "store could not be written"
BACKLOG_BYTES = 256 << 20      # statistics kept in memory while the store cannot be written
GUARD_BYTES_PER_100 = 1 << 30  # warn when full tensors would pass this every 100 steps


@dataclass
class _Unsaved:
    """A record whose rows are not committed yet, as kept for a new start after a
    fault: everything but its full tensors, of which only the count is kept."""
    record: StepRecord
    resolved: Resolved
    tensors: int
    over_budget: int

    @property
    def nbytes(self) -> int:
        return sum(r.hist.nbytes + 8 * len(r.stats) * len(r.layers)
                   for r in self.resolved.stats.values())

    def without_stats(self) -> "_Unsaved":
        """The record with its statistics dropped (counted), past the backlog bound."""
        rows = sum(len(r.layers) for r in self.resolved.stats.values())
        return _Unsaved(self.record, Resolved({}, self.resolved.events), self.tensors + rows,
                        self.over_budget)


@dataclass
class _Put:
    record: StepRecord
    nbytes: int                  # its snapshots' bytes, held against the back-pressure budget


@dataclass
class _Flush:
    done: threading.Event
    status: str | None = None     # with a status: the final flush, then the thread ends
    final: bool = False


class _ByteBudget:
    """Back-pressure: producers wait while too many snapshot bytes are queued."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    def acquire(self, n: int, alive) -> None:
        with self.cond:
            while self.used and self.used + n > self.limit and alive():
                self.cond.wait(0.1)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class Writer:
    """Owns the store and the rank's state on its own thread."""

    def __init__(self, store: RunStore, state: fmt.RankState, root_base: dict[str, Any] | None,
                 config: RecorderConfig):
        self.store = store
        self.state = state                 # written by the writer thread only
        self.root_base = root_base         # rank 0: the root attributes besides the state's
        self.config = config
        self.flush_interval = config.flush_interval
        self.on_error = config.on_error
        self.budget = _ByteBudget(config.max_pending_bytes)
        # the full tensors of the steps before (None: already stored), dumped on a NaN/Inf
        self._ring: collections.deque = collections.deque(maxlen=config.ring or None)
        self._budget_used = state.bytes_raw        # full tensors stored, for max_bytes
        self._warned: set[str] = set()
        self.q: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None
        self._skipped: set[str] = set()
        # the state as last committed, the records since (less their full tensors), the fault
        self._saved = self._copy(state)
        self._unsaved: list[_Unsaved] = []
        self._kept = 0                     # their statistics' bytes
        self._fault: BaseException | None = None
        self._retry_at = 0.0
        self.thread = threading.Thread(target=self._loop, name="tensortape-writer", daemon=True)
        self.thread.start()

    # --- training-thread side -------------------------------------------------
    def put(self, record: StepRecord) -> None:
        n = record.nbytes
        self.budget.acquire(n, self.thread.is_alive)
        self.q.put(_Put(record, n))
        self.check()

    def flush(self) -> None:
        """Block until everything queued is written and committed."""
        self._request(_Flush(threading.Event()))
        self.check()

    def close(self, status: str) -> None:
        """Write everything, commit with ``status``, and end the thread."""
        try:
            self._request(_Flush(threading.Event(), status, final=True))
            self.check()
        finally:
            self.thread.join(timeout=60)

    def _request(self, msg: _Flush) -> None:
        if self.thread.is_alive():
            self.q.put(msg)
            while not msg.done.wait(0.1) and self.thread.is_alive():
                pass

    def check(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise RecorderError(f"writing the store failed: {err}; the steps committed before "
                                f"this are intact (on_error='warn' trains on through such "
                                f"faults and writes again when it can)") from err

    # --- writer-thread side -----------------------------------------------------
    def _loop(self) -> None:
        last = time.monotonic()
        pending = False
        while True:
            try:
                msg = self.q.get(timeout=max(0.05, self.flush_interval / 4))
            except queue.Empty:
                msg = None
            if self._fault is not None and (isinstance(msg, _Flush)
                                            or time.monotonic() >= self._retry_at):
                try:
                    self._restart(msg.status if isinstance(msg, _Flush) else None)
                    pending, last = False, time.monotonic()
                except BaseException as e:
                    self._failed(e)
            try:
                if isinstance(msg, _Put):
                    try:
                        self._put(msg.record)
                    finally:
                        self.budget.release(msg.nbytes)
                    pending = True
                elif isinstance(msg, _Flush) and self._fault is None:
                    if msg.final:
                        self.store.flush()
                        self.store.trim()
                    self._commit(msg.status)
                    pending, last = False, time.monotonic()
                if pending and self._fault is None and time.monotonic() - last >= self.flush_interval:
                    self._commit(None)
                    pending, last = False, time.monotonic()
            except BaseException as e:
                self._failed(e)
            if isinstance(msg, _Flush):
                if msg.final:
                    self._last_words()
                    self.store.close()
                msg.done.set()
                if msg.final:
                    return

    def _put(self, record: StepRecord) -> None:
        resolved = self._resolve(record)
        tensors = self._choose_tensors(record, resolved)
        over = 0
        if self.config.max_bytes is not None:
            tensors, over = self._within_budget(tensors)
        record.tensors = []              # stored now, or held by the ring: not kept for a restart
        unsaved = _Unsaved(record, resolved, sum(len(rows) for _, rows in tensors), over)
        if self._fault is None and self._kept + unsaved.nbytes > BACKLOG_BYTES:
            try:
                self._commit(None)       # bounds what a new start would write again
            except BaseException as e:
                self._failed(e)
        if self._fault is not None and self._kept + unsaved.nbytes > BACKLOG_BYTES:
            unsaved = unsaved.without_stats()
        self._unsaved.append(unsaved)
        self._kept += unsaved.nbytes
        if self._fault is None:
            self._write(unsaved, tensors)

    def _resolve(self, record: StepRecord) -> Resolved:
        """The record's statistics and events; a record that cannot be interpreted
        loses its statistics (counted), never the store."""
        try:
            return record.resolve()
        except Exception as e:
            cause = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            reason = f"statistics failed ({cause})"
            record.drops[reason] = record.drops.get(reason, 0) + len(record.metas)
            self._warn_once(reason, f"tensortape: the statistics of step {record.step} could not "
                                    f"be computed ({cause}); they are dropped and counted")
            return Resolved()

    def _choose_tensors(self, record: StepRecord, resolved: Resolved) -> list:
        """The full tensors to store now, as (step, rows): the step's own when it is
        persisted; on a non-finite value under ``dump``/``raise``, the ring's and the
        step's.  A step not stored goes into the ring."""
        plan, cfg = record.plan, self.config
        if plan is None:
            return []
        dump = bool(resolved.events) and cfg.on_nonfinite in ("dump", "raise", "replay")
        out = []
        if dump:
            out = [(s, rows) for s, rows in self._ring if rows]
            self._ring = collections.deque(((s, None) for s, _ in self._ring),
                                           maxlen=self._ring.maxlen)
        stored = plan.persist or dump
        if stored and record.tensors:
            out.append((record.step, record.tensors))
            if plan.persist and not self.state.bytes_raw:
                self._estimate(record)
        if cfg.ring:
            if not stored:
                for row in record.tensors:        # the ring lives in ordinary host memory
                    row.snap.unpin()
            self._ring.append((record.step, None if stored else record.tensors))
        return out

    def _estimate(self, record: StepRecord) -> None:
        """At the first persisted step: warn once if full tensors would fill disks."""
        cfg = self.config
        per_100 = record.nbytes * 100 / (cfg.tensors_every or 1)
        if per_100 > GUARD_BYTES_PER_100 and cfg.max_bytes is None:
            self._warn_once("estimate", (
                f"tensortape: full tensors take {record.nbytes / 1e6:.0f} MB a step here, "
                f"{per_100 / 1e9:.1f} GB every 100 steps; record fewer with tensors_every= "
                f"(now {cfg.tensors_every}), layers= or max_samples=, or cap them with "
                f"max_bytes= (statistics are kept whatever you choose)"), UserWarning)

    def _within_budget(self, tensors: list) -> tuple[list, int]:
        """Past ``max_bytes`` of full tensors, rows are counted instead of stored."""
        limit, used = self.config.max_bytes, self._budget_used
        kept, over = [], 0
        for step, rows in tensors:
            mine = []
            for row in rows:
                if used + row.snap.nbytes <= limit:
                    used += row.snap.nbytes
                    mine.append(row)
                else:
                    over += 1
                    row.snap.release()
                    self._warn_once("budget", (
                        f"tensortape: max_bytes={limit} of full tensors reached at step {step}; "
                        f"from now on only statistics are recorded (tensors not stored are "
                        f"counted)"), UserWarning)
            kept.append((step, mine))
        self._budget_used = used
        return kept, over

    def _warn_once(self, key: str, message: str, category=RuntimeWarning) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, category, stacklevel=1)

    def _commit(self, status: str | None) -> None:
        self.state.committed.update(self.store.flush())
        root = None if self.root_base is None else fmt.root_attrs(self.state, self.root_base, status)
        self.store.commit(self.state, root)
        self._saved, self._unsaved, self._kept = self._copy(self.state), [], 0

    # --- when the store cannot be written ---------------------------------------
    @staticmethod
    def _copy(state: fmt.RankState) -> fmt.RankState:
        return fmt.RankState.from_json(state.to_json())

    def _failed(self, e: BaseException) -> None:
        """A fault: start again from the last commit in ``flush_interval``.  At its
        first failure, ``raise`` hands the error to the training thread and
        ``warn`` warns."""
        first = self._fault is None
        self._fault = e
        self._retry_at = time.monotonic() + self.flush_interval
        if not first:
            return
        if self.on_error == "raise":
            self.error = e
            return
        warnings.warn(f"tensortape: the store cannot be written ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); training goes on, "
                      f"statistics are kept in memory (up to {BACKLOG_BYTES >> 20} MiB) and "
                      f"written when it can be written again, and full tensors meanwhile "
                      f"are dropped and counted in the run's 'dropped'",
                      RuntimeWarning, stacklevel=1)

    def _restart(self, status: str | None) -> None:
        """Start again from the last commit: the committed state, then the kept
        records (their full tensors counted as dropped), then a commit."""
        self.store.reset()
        self.state = self._copy(self._saved)
        for u in self._unsaved:
            self._write(u, [])
            self._drop(UNWRITABLE, u.tensors)
        self._commit(status)
        self._fault = None

    def _last_words(self) -> None:
        if self._fault is not None:
            rows = sum(len(r.layers) for u in self._unsaved for r in u.resolved.stats.values())
            warnings.warn(f"tensortape: the store could not be written when the run was closed "
                          f"({self._fault}); the statistics of {len(self._unsaved)} steps "
                          f"({rows} rows) since the last commit are lost", RuntimeWarning,
                          stacklevel=1)

    def _drop(self, reason: str, n: int) -> None:
        if n:
            self.state.dropped += n
            self.state.drop_reasons[reason] = self.state.drop_reasons.get(reason, 0) + n

    def _write(self, unsaved: _Unsaved, tensors: list[tuple[int, list[TensorRow]]]) -> None:
        st, rec, res = self.state, unsaved.record, unsaved.resolved
        if rec.bundle is not None:               # before the event that names it
            self.store.write_bundle(*rec.bundle)
        st.layers.extend(rec.layers)
        for reason, n in rec.drops.items():
            self._drop(reason, n)
        st.outside_steps += rec.outside
        st.over_budget += unsaved.over_budget
        st.events_total += len(res.events)
        st.events.extend(dataclasses.replace(e, rank=st.rank)
                         for e in res.events[:max(fmt.MAX_EVENTS - len(st.events), 0)])
        if rec.step >= 0:
            st.last_step = rec.step if st.last_step is None else max(st.last_step, rec.step)
        for kind, rows in res.stats.items():
            names = st.stats_layers.setdefault(kind, [])
            known = set(names)
            names.extend(layer for layer in rows.layers if layer not in known)
            path = fmt.stats_group(st.rank, kind)
            self.store.append_stats(kind, rec.step, names, rows.layers, rows.stats, rows.hist,
                                    st.committed.get(path, 0))
        for step, rows in tensors:
            for row in rows:
                self._write_tensor(step, row)

    def _write_tensor(self, step: int, row: TensorRow) -> None:
        st = self.state
        path = fmt.tensor_group(st.rank, row.kind, row.layer)
        row.snap.unpin()                 # the store may write it later: the slot goes back now
        host = row.snap.host()
        n = self.store.append_tensor(row.kind, row.layer, step, row.micro, host,
                                     st.committed.get(path, 0))
        if n >= 0:
            st.bytes_raw += n
            return
        self._drop(DTYPE_OR_RANK, 1)     # counted, with its reason, and warned once a table
        if path not in self._skipped:
            self._skipped.add(path)
            warnings.warn(f"tensortape: {row.kind} of {row.layer!r} changed rank or dtype at "
                          f"step {step} (now {host.dtype}{list(host.shape)}); its full "
                          f"tensors of such steps are not stored, and are counted in the "
                          f"run's 'dropped' (its statistics are kept)", stacklevel=1)
