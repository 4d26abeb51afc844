"""The writer's thread: a bounded inbox, a flush barrier, liveness, and an outbox.

Threads: ``send``, ``barrier`` and ``post_nowait`` run on the training
thread (``post_nowait`` also from a finaliser); ``_loop`` and the handler's
methods run on the worker thread, and nowhere else.

- **The inbox** holds messages for the handler, bounded in count and in the
  bytes of their snapshots (back-pressure).  ``send`` waits while the worker
  makes progress, and never longer than ``stall`` seconds without any: a worker
  that died, or has not moved for that long (a hung store), gets nothing more,
  and ``send`` says why so the caller counts what it drops.
- **The loop** never ends on an exception: whatever a handler call raises goes
  to the handler's ``failed``, and what that raises to the outbox.
- **The outbox** carries warnings and errors back to the training thread, which
  issues them (``tell``): the worker thread never calls ``warnings.warn``, so a
  filter that turns warnings into errors cannot kill it.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from ..quiet import quiet

__all__ = ["Barrier", "Handler", "Notice", "Worker", "grace"]

DEAD = "the writer thread died"
STUCK = "the writer made no progress (the store does not answer)"


@dataclass(frozen=True)
class Notice:
    """A message for the training thread: a warning, or (``error``) an error that
    ``on_error="raise"`` raises there."""
    key: str                      # one warning per key
    message: str
    error: BaseException | None = None


@dataclass
class Barrier:
    """Everything sent before it is written and committed (with ``status``, and,
    when ``final``, the last commit: then the thread ends)."""
    status: str | None = None
    final: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Handler(Protocol):
    def put(self, item) -> None: ...
    def barrier(self, msg: Barrier) -> None: ...
    def tick(self) -> None: ...
    def failed(self, error: BaseException) -> None: ...
    def last_words(self) -> None: ...


def grace(close_timeout: float) -> float:
    """How long a close that gave up waits more for a thread it asked to stop."""
    return max(1.0, min(5.0, close_timeout))


class Worker:
    """One daemon thread that feeds a ``Handler`` the messages it is sent."""

    def __init__(self, handler: Handler, outbox: collections.deque, *, max_bytes: int,
                 max_items: int = 64, poll: float = 0.05, stall: float = 60.0,
                 progress=lambda: 0.0, name: str = "tensortape-writer"):
        self.handler = handler
        self.max_bytes, self.max_items = max_bytes, max_items
        self.poll, self.stall = poll, stall
        self._inbox: collections.deque = collections.deque()   # (message, bytes)
        self._bytes = 0
        self._cond = threading.Condition()
        self.beat = time.monotonic()          # the worker's last message handled
        self.progress = progress              # and the time of its last write that ended
        self.outbox = outbox                  # Notices, for the training thread
        self._halted = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    # --- training-thread side -----------------------------------------------------
    def trouble(self) -> str | None:
        """Why the worker takes nothing more (``DEAD`` or ``STUCK``), or None."""
        if not self.thread.is_alive():
            return DEAD
        if time.monotonic() - max(self.beat, self.progress()) > self.stall:
            return STUCK
        return None

    def pressed(self) -> bool:
        """Whether the inbox is half full, in count or bytes: the worker had better not
        wait for anything now (read without the lock: a hint, from the worker)."""
        return len(self._inbox) * 2 >= self.max_items or self._bytes * 2 > self.max_bytes

    def send(self, item, nbytes: int = 0, deadline: float | None = None) -> str | None:
        """Queue ``item`` (holding ``nbytes`` of snapshots); None when queued, else why
        not.  Waits while the inbox is full and the worker makes progress, up to
        ``deadline`` (a ``time.monotonic()`` value)."""
        with self._cond:
            while (self._inbox or self._bytes) and (len(self._inbox) >= self.max_items
                                   or self._bytes + nbytes > self.max_bytes):
                why = self.trouble()
                if why is None and deadline is not None and time.monotonic() > deadline:
                    why = STUCK
                if why is not None:
                    return why
                self._cond.wait(self.poll)
            why = self.trouble()
            if why is not None:
                return why
            self._inbox.append((item, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()
        return None

    def barrier(self, msg: Barrier, deadline: float | None) -> bool:
        """Send ``msg`` and wait until it is handled, the worker is in trouble, or
        ``deadline`` passes; whether it was handled."""
        if self.send(msg, 0, deadline) is not None:
            return False
        while not msg.done.wait(self.poll):
            if self.trouble() is not None or (deadline is not None and time.monotonic() > deadline):
                return msg.done.is_set()
        return True

    def halt(self, close_timeout: float) -> None:
        """Handle no more messages, and wait (``grace(close_timeout)``) for the thread
        to end after the one it handles now; one blocked in a store stays blocked.
        For a run given up: its work is no longer wanted, and a thread still inside
        torch when the interpreter finalizes aborts the process (CPython ends such a
        thread through torch's C++ frames: "terminate called")."""
        self._halted = True
        self.thread.join(grace(close_timeout))

    def post_nowait(self, msg) -> None:
        """Queue ``msg`` without waiting or taking a lock (from a finaliser, which may
        run while this thread holds the inbox's lock), past the inbox's bounds; the
        worker finds it at its next poll."""
        self._inbox.append((msg, 0))

    # --- worker-thread side ---------------------------------------------------------
    def _take(self):
        with self._cond:
            if not self._inbox:
                self._cond.wait(self.poll)
            return self._inbox.popleft() if self._inbox else (None, 0)

    def _done(self, nbytes: int) -> None:
        """A message handled: its snapshots' bytes are free (they count against the
        bound until then, as the handler holds them)."""
        with self._cond:
            self._bytes -= nbytes
            self._cond.notify_all()

    def _loop(self) -> None:
        while not self._halted:
            msg, nbytes = self._take()
            if self._halted:
                return
            self.beat = time.monotonic()
            final = isinstance(msg, Barrier) and msg.final
            try:
                with quiet():                     # the dependencies' warnings are not news
                    if isinstance(msg, Barrier):
                        self.handler.barrier(msg)
                    elif msg is not None:
                        self.handler.put(msg)
                    self.handler.tick()
            except BaseException as e:            # the loop never ends on an error
                self._failed(e)
            if final:
                self._last_words()
            self._done(nbytes)
            self.beat = time.monotonic()
            if isinstance(msg, Barrier):
                msg.done.set()
            if final:
                return

    def _failed(self, error: BaseException) -> None:
        try:
            self.handler.failed(error)
        except BaseException as e:                # told, never fatal
            self.outbox.append(Notice(f"handler {type(e).__name__}",
                                      f"tensortape: the writer failed ({type(e).__name__}: {e})"))

    def _last_words(self) -> None:
        try:
            with quiet():
                self.handler.last_words()
        except BaseException as e:
            self._failed(e)
