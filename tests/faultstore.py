"""A store that behaves like the ones users train on: slow, and failing at times.

``faulty()`` wraps the ``set`` of zarr's local and fsspec stores for the duration of a
``with`` block (readers, which only ``get``, are untouched):

- ``latency``: seconds each write takes (an object store's PUT), spread at random
  from half of it to all of it;
- ``fail``: the chance that a write fails with ``OSError``; ``after``: of the
  failures, the share that fail *after* the bytes were stored (a PUT whose answer
  was lost), so a store may hold what its writer was told did not happen;
- ``schedule``: a function of the write's serial number that says "fail" (True)
  or not, for deterministic schedules (hypothesis draws them);
- ``hang``: a function of the key that says this write never answers, until the
  ``release`` event is set (a store that hangs).

It counts every write, every failure, and the most writes in flight at once on
one key, which must never exceed 1 (zarr rewrites a shard whole: two writes on one
shard in flight lose one of them).
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass, field

from zarr.storage import FsspecStore, LocalStore


@dataclass
class Faults:
    latency: float = 0.0
    fail: float = 0.0
    after: float = 0.5
    seed: int = 0
    schedule: object = None
    hang: object = None
    release: object = None
    writes: int = 0
    failures: int = 0
    overlap: int = 0                      # most concurrent writes seen on one key
    _inflight: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    enabled: bool = True

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def _begin(self, key):
        with self._lock:
            n = self.writes
            self.writes += 1
            self._inflight[key] = self._inflight.get(key, 0) + 1
            self.overlap = max(self.overlap, self._inflight[key])
            delay = self.latency * (0.5 + 0.5 * self._rng.random()) if self.latency else 0.0
            if not self.enabled:
                return n, delay, None
            if self.schedule is not None:
                fails = bool(self.schedule(n))
            else:
                fails = self.fail > 0 and self._rng.random() < self.fail
            when = None
            if fails:
                self.failures += 1
                when = "after" if self._rng.random() < self.after else "before"
            return n, delay, when

    def _end(self, key):
        with self._lock:
            self._inflight[key] -= 1


@contextlib.contextmanager
def faulty(latency: float = 0.0, fail: float = 0.0, **kw):
    """Patch zarr's stores' ``set`` with ``Faults(latency, fail, ...)``; yield it."""
    faults = Faults(latency=latency, fail=fail, **kw)
    originals = {cls: cls.set for cls in (LocalStore, FsspecStore)}

    def wrap(original):
        async def set(self, key, value, *a, **k):
            _, delay, when = faults._begin((id(self), key))
            try:
                if faults.hang is not None and faults.enabled and faults.hang(key):
                    while not faults.release.is_set():
                        await asyncio.sleep(0.05)
                    raise OSError(f"injected fault: {key} hung")
                if delay:
                    await asyncio.sleep(delay)
                if when == "before":
                    raise OSError(f"injected fault: {key} was not written")
                await original(self, key, value, *a, **k)
                if when == "after":
                    raise OSError(f"injected fault: {key} was written, but its answer was lost")
            finally:
                faults._end((id(self), key))
        return set

    for cls, original in originals.items():
        cls.set = wrap(original)
    try:
        yield faults
    finally:
        for cls, original in originals.items():
            cls.set = original
