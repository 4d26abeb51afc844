"""The threads that write chunks, and one write in flight per array.

A sharded array's chunk write rewrites its whole shard (zarr reads, merges and
replaces it), so two writes in flight on one shard lose one of them.  Each
array therefore has a ``Lane``: its writes go to the ``WritePool`` one after
the other, in order, while different arrays write in parallel.  A write that
fails is kept by its lane and raised at ``drain``; the writes given after it
are not made (the writer starts again from its last commit).

Threads: the writer thread submits and drains; the pool's daemon threads
(``tensortape-chunks``, ``write_threads()`` of them, or none: then the writer
thread writes inline) run the writes and hand a lane its next one.  **Who stops
them**: the pool's owner, ``_store.RunStore.close`` (the writer at close, or
the Recorder when attach fails), with ``WritePool.shutdown``; a store forgotten
without ``close`` shuts its pool down when it is garbage collected.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable

from ..quiet import quiet
from ..errors import ConfigError

__all__ = ["Lane", "WritePool", "write_threads"]

Done = Callable[[BaseException | None], None]   # told how a write ended: its error or None


def write_threads() -> int:
    """Threads that encode and write chunks.  The codecs release the GIL, so on a
    machine with cores to spare (a GPU machine) chunks are written in parallel; on
    a small one (4 cores or fewer) the writer thread writes them itself, as
    training already keeps those cores busy.  ``TENSORTAPE_WRITE_THREADS`` sets it
    (a positive integer; anything else is a ``ConfigError`` in one line)."""
    env = os.environ.get("TENSORTAPE_WRITE_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"TENSORTAPE_WRITE_THREADS={env!r} is not valid; use a positive "
                              f"integer (1: the writer thread writes alone), or leave it unset")
        return int(env)
    cores = os.cpu_count() or 1
    return 1 if cores <= 4 else min(8, cores // 2)


class WritePool:
    """The threads that encode and write chunks, or none (``threads < 2``: the
    caller's thread writes at once).

    Daemon threads, unlike ``concurrent.futures``' pool, whose threads the
    interpreter joins at exit: a store that hangs must not hang the exit.  Each
    write runs inside ``quiet()`` (a dependency's warning is no fault of the
    store) and marks ``progress``, the time of the last write that ended, which
    tells a slow store from one that does not answer."""

    def __init__(self, threads: int):
        self.inline = threads < 2
        self.progress = time.monotonic()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [] if self.inline else [
            threading.Thread(target=self._serve, name="tensortape-chunks", daemon=True)
            for _ in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, args: tuple, done: Done) -> None:
        """Run ``fn(*args)``, then ``done(error or None)``."""
        if self.inline:
            done(self.run(fn, args))
        else:
            self._tasks.put((fn, args, done))

    def run(self, fn: Callable, args: tuple) -> BaseException | None:
        """Run ``fn(*args)`` on this thread now; its error, or None."""
        try:
            with quiet():
                fn(*args)
            return None
        except BaseException as e:
            return e
        finally:
            self.progress = time.monotonic()

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, args, done = task
            done(self.run(fn, args))

    def shutdown(self, wait: bool = True) -> None:
        """End the threads once the writes given are made (``wait``: join them)."""
        for _ in self._threads:
            self._tasks.put(None)
        if wait:
            for t in self._threads:
                t.join()


class Lane:
    """At most one write in flight on one array, in the order given.

    A lane hands its array's writes to the pool one after the other: parallel
    across arrays, serial within one.  ``drain`` waits for every write given and
    raises the first that failed (the writes given after a failure are not made:
    the writer starts again from its last commit)."""

    MAX_WAITING = 8                # blocks queued on one array before the writer waits

    def __init__(self, pool: WritePool):
        self.pool = pool
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._busy = False
        self._error: BaseException | None = None

    @property
    def inline(self) -> bool:
        """Whether a write is made before ``submit`` returns (no pool threads)."""
        return self.pool.inline

    def submit(self, fn: Callable, *args) -> None:
        """Write ``fn(*args)`` after every write given before it."""
        with self._cond:
            while len(self._waiting) >= self.MAX_WAITING and self._error is None:
                self._cond.wait()
            if self._error is not None:
                return                          # raised by drain
            if self._busy:
                self._waiting.append((fn, args))
                return
            self._busy = True
        self.pool.submit(fn, args, self._finish)

    def _finish(self, error: BaseException | None) -> None:
        while True:
            with self._cond:
                if error is not None and self._error is None:
                    self._error = error
                self._cond.notify_all()
                if not self._waiting or self._error is not None:
                    self._waiting.clear()
                    self._busy = False
                    return
                fn, args = self._waiting.popleft()
            if not self.pool.inline:
                self.pool.submit(fn, args, self._finish)
                return
            error = self.pool.run(fn, args)     # inline: the next write, without recursion

    def drain(self) -> None:
        """Wait for every write given; raise the first that failed."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error
