"""The background writer: a bounded queue of finished steps, written off the
training thread, committed at least every ``flush_interval`` seconds."""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import format as fmt
from .errors import RecorderError
from .store import RunStore

__all__ = ["StepRecord", "Writer", "to_numpy"]


@dataclass
class StepRecord:
    """What one step hands to the writer."""
    step: int
    # kind -> (layers, statistics by name, histograms), one row per layer
    stats: dict[str, tuple[list[str], dict[str, np.ndarray], np.ndarray]] = field(default_factory=dict)
    tensors: list[tuple[str, str, Any]] = field(default_factory=list)  # (kind, layer, Snapshot)
    nbytes: int = 0


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A host tensor as numpy; bfloat16 becomes its uint16 bits."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), fmt.BF16
    return t.numpy(), None


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
    """Owns the store on its own thread; the training thread only enqueues."""

    def __init__(self, store: RunStore, state: dict[str, Any], root_attrs: dict[str, Any] | None,
                 flush_interval: float, max_pending_bytes: int):
        self.store = store
        self.state = state                # rank attrs: layers, events, committed, ...
        self.root_attrs = root_attrs      # None on ranks other than 0
        self.flush_interval = flush_interval
        self.budget = _ByteBudget(max_pending_bytes)
        self.q: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None
        self.bytes_raw = int(state.get("bytes_raw", 0))
        self._skipped: set[str] = set()
        self.thread = threading.Thread(target=self._loop, name="tensortape-writer", daemon=True)
        self.thread.start()

    # --- training-thread side -------------------------------------------------
    def put(self, record: StepRecord, layers: list[str], events: list[dict], events_total: int,
            dropped: int) -> None:
        self.check()
        self.budget.acquire(record.nbytes, self.thread.is_alive)
        self.q.put(("step", record, (layers, list(events), events_total, dropped)))

    def flush(self, status: str | None = None, final: bool = False, state: dict | None = None) -> None:
        """Block until everything queued is written and committed."""
        done = threading.Event()
        if self.thread.is_alive():
            self.q.put(("flush", done, (status, final, state)))
            while not done.wait(0.1) and self.thread.is_alive():
                pass
        self.check()

    def close(self) -> None:
        if self.thread.is_alive():
            self.q.put(("stop", None, None))
            self.thread.join()

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
                op, arg, extra = self.q.get(timeout=max(0.05, self.flush_interval / 4))
            except queue.Empty:
                op = None
            try:
                if op == "step":
                    try:
                        self._write(arg)
                    finally:
                        self.budget.release(arg.nbytes)
                    layers, events, events_total, dropped = extra
                    self.state.update(layers=layers, events=events, events_total=events_total,
                                      dropped=dropped, last_step=arg.step)
                    pending = True
                elif op in ("flush", "stop"):
                    status, final, state = extra or (None, False, None)
                    self.state.update(state or {})
                    if final:
                        self.store.flush()
                        self.store.trim()
                    self._commit(status)
                    pending = False
                    last = time.monotonic()
                    if op == "flush":
                        arg.set()
                    else:
                        return
                if pending and time.monotonic() - last >= self.flush_interval:
                    self._commit(None)
                    pending = False
                    last = time.monotonic()
            except BaseException as e:  # reported to the training thread
                self.error = e
                if op == "flush":
                    arg.set()
                if op == "stop":
                    return

    def _commit(self, status: str | None) -> None:
        committed = self.store.flush()
        self.state["committed"] = committed
        self.state["bytes_raw"] = self.bytes_raw
        root = None
        if self.root_attrs is not None:
            root = self.root_attrs
            root.update(layers=self.state.get("layers", []), events=self.state.get("events", []),
                        dropped=self.state.get("dropped", 0))
            if status:
                root["status"] = status
        self.store.commit(self.state, root)

    def _committed(self, path: str) -> int:
        return int(self.state.get("committed", {}).get(path, 0))

    def _write(self, rec: StepRecord) -> None:
        for kind, (layers, stats, hist) in rec.stats.items():
            self._write_stats(kind, rec.step, layers, stats, hist)
        for kind, layer, snap in rec.tensors:
            self._write_tensor(kind, layer, rec.step, snap)

    def _write_stats(self, kind: str, step: int, layers: list[str], stats: dict[str, np.ndarray],
                     hist: np.ndarray) -> None:
        names: list[str] = self.state.setdefault("stats_layers", {}).setdefault(kind, [])
        known = set(names)
        names.extend(layer for layer in layers if layer not in known)
        path = fmt.stats_group(self.store.rank, kind)
        table = self.store.stats_table(kind, len(names), self._committed(path))
        n = len(names)
        index = {name: i for i, name in enumerate(names)}
        rows = [index[layer] for layer in layers]
        row = {s: np.full(n, np.nan) for s in fmt.STATS}     # layers absent this step: NaN
        full = np.zeros((n, fmt.NBINS), dtype=np.int64)
        for s in fmt.STATS:
            row[s][rows] = stats[s]
        full[rows] = hist
        for s in fmt.STATS:
            table.columns[s].grow_inner((n,))
        table.columns["hist"].grow_inner((n, fmt.NBINS))
        table.append({"step": np.int64(step), "hist": full, **row})

    def _write_tensor(self, kind: str, layer: str, step: int, snap) -> None:
        arr, logical = to_numpy(snap.host())
        path = fmt.tensor_group(self.store.rank, kind, layer)
        table = self.store.tensor_table(kind, layer, arr, logical, self._committed(path))
        data = table.columns["data"].array
        if data.ndim - 1 != arr.ndim or data.dtype != arr.dtype:
            if path not in self._skipped:
                self._skipped.add(path)
                warnings.warn(f"tensortape: {kind} of {layer!r} changed rank or dtype at step "
                              f"{step} (now {arr.dtype}{list(arr.shape)}); such steps are not "
                              f"stored", stacklevel=1)
            return
        self.bytes_raw += arr.nbytes
        extent = np.array(arr.shape if arr.ndim else (1,), dtype=np.int64)
        table.append({"data": arr, "step": np.int64(step), "extent": extent})
