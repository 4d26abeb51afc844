"""The background writer: it owns the run's durable state and the store.

The training thread only enqueues: finished ``StepRecord``s, and requests
to flush or close.  The writer thread writes each record's rows into the
store's tables, folds what changed (new layers, events, drops) into the
rank's ``RankState``, and commits, data first and counters after, at least
every ``flush_interval`` seconds.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from . import format as fmt
from ._step import StepRecord
from ._store import RunStore
from .errors import RecorderError

__all__ = ["Writer"]

DTYPE_OR_RANK = "full tensor changed dtype or rank"
LATE_GRADIENT = "gradient arrived after its step"


@dataclass
class _Put:
    record: StepRecord


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
                 flush_interval: float, max_pending_bytes: int):
        self.store = store
        self.state = state                 # written by the writer thread only
        self.root_base = root_base         # rank 0: the root attributes besides the state's
        self.flush_interval = flush_interval
        self.budget = _ByteBudget(max_pending_bytes)
        self.q: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None
        self._skipped: set[str] = set()
        self.thread = threading.Thread(target=self._loop, name="tensortape-writer", daemon=True)
        self.thread.start()

    # --- training-thread side -------------------------------------------------
    def put(self, record: StepRecord) -> None:
        self.check()
        self.budget.acquire(record.nbytes, self.thread.is_alive)
        self.q.put(_Put(record))

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
                                f"this are intact") from err

    # --- writer-thread side -----------------------------------------------------
    def _loop(self) -> None:
        last = time.monotonic()
        pending = False
        while True:
            try:
                msg = self.q.get(timeout=max(0.05, self.flush_interval / 4))
            except queue.Empty:
                msg = None
            try:
                if isinstance(msg, _Put):
                    try:
                        self._write(msg.record)
                    finally:
                        self.budget.release(msg.record.nbytes)
                    pending = True
                elif isinstance(msg, _Flush):
                    if msg.final:
                        self.store.flush()
                        self.store.trim()
                    self._commit(msg.status)
                    pending, last = False, time.monotonic()
                if pending and time.monotonic() - last >= self.flush_interval:
                    self._commit(None)
                    pending, last = False, time.monotonic()
            except BaseException as e:  # reported to the training thread
                self.error = e
            if isinstance(msg, _Flush):
                if msg.final:
                    self.store.close()
                msg.done.set()
                if msg.final:
                    return

    def _commit(self, status: str | None) -> None:
        self.state.committed.update(self.store.flush())
        root = None if self.root_base is None else fmt.root_attrs(self.state, self.root_base, status)
        self.store.commit(self.state, root)

    def _write(self, rec: StepRecord) -> None:
        st = self.state
        st.layers.extend(rec.layers)
        st.dropped += rec.dropped
        if rec.dropped:
            st.drop_reasons[LATE_GRADIENT] = st.drop_reasons.get(LATE_GRADIENT, 0) + rec.dropped
        st.outside_steps += rec.outside
        st.over_budget += rec.over_budget
        st.events_total += len(rec.events)
        st.events.extend(rec.events[:max(fmt.MAX_EVENTS - len(st.events), 0)])
        if rec.step >= 0:
            st.last_step = rec.step if st.last_step is None else max(st.last_step, rec.step)
        for kind, rows in rec.stats.items():
            names = st.stats_layers.setdefault(kind, [])
            known = set(names)
            names.extend(layer for layer in rows.layers if layer not in known)
            path = fmt.stats_group(st.rank, kind)
            self.store.append_stats(kind, rec.step, names, rows.layers, rows.stats, rows.hist,
                                    st.committed.get(path, 0))
        for row in rec.tensors:
            path = fmt.tensor_group(st.rank, row.kind, row.layer)
            host = row.snap.host()
            n = self.store.append_tensor(row.kind, row.layer, rec.step, row.micro, host,
                                         st.committed.get(path, 0))
            if n >= 0:
                st.bytes_raw += n
                continue
            st.dropped += 1                  # counted, with its reason, and warned once a table
            st.drop_reasons[DTYPE_OR_RANK] = st.drop_reasons.get(DTYPE_OR_RANK, 0) + 1
            if path not in self._skipped:
                self._skipped.add(path)
                warnings.warn(f"tensortape: {row.kind} of {row.layer!r} changed rank or dtype at "
                              f"step {rec.step} (now {host.dtype}{list(host.shape)}); its full "
                              f"tensors of such steps are not stored, and are counted in the "
                              f"run's 'dropped' (its statistics are kept)", stacklevel=1)
