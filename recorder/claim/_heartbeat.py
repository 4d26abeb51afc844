"""An owner's heartbeat: the ``tensortape-claim`` thread, and what it shares.

A ``Heartbeat`` holds a claim's ``Lock`` for its ``Claim``: it beats (serialised
by its lock, whichever thread asks), remembers why the claim was lost, and
releases it once.  It never refers to the ``Claim``, so that a forgotten
``Claim`` is collected and its finaliser releases the lock.

**The lease.**  No other job can take a claim over until ``stale_s()`` seconds
after its last heartbeat; the owner counts half of that from the start of its
last heartbeat that it knows was written, on its own monotonic clock, and within
it writes without asking the store (``confirm``).  Past it (a job paused, a
store that did not take the heartbeat) ``confirm`` beats first, and a claim
found lost then is lost for good.

Threads: ``start`` runs ``Heartbeat.beat`` every ``heartbeat_s()`` seconds on a
daemon thread ``tensortape-claim``, one per held claim; the writer thread
confirms the claim before it writes (``confirm``: a heartbeat past the lease,
a read at each commit).  **Who stops the
thread**: ``release`` (the ``Claim``'s, at close; its finaliser when it is
collected; interpreter exit) sets ``stop``, and the thread ends at its next
wake; it also ends once the claim is lost.  After ``Claim.keep()`` it runs
until the process ends (a daemon: it never holds the exit).  A forked child
never beats nor releases its parent's claim.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from ._holder import heartbeat_s, stale_s
from ..quiet import quiet

if TYPE_CHECKING:
    from ._lock import Lock

__all__ = ["Heartbeat"]


class Heartbeat:
    """What the heartbeat thread and the finaliser share (never the Claim itself)."""

    def __init__(self, lock: Lock):
        self.backend = lock
        self.pid = os.getpid()             # a forked child never beats nor releases
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.lost: str | None = None
        self.last_beat = time.monotonic()

    @property
    def holding(self) -> bool:
        """Neither released nor lost."""
        return not self.stop.is_set() and self.lost is None

    def start(self) -> None:
        """Beat from a thread of its own until ``release`` or the claim is lost."""
        threading.Thread(target=_beat_every, args=(self,), daemon=True,
                         name="tensortape-claim").start()

    def beat(self) -> bool:
        """Keep the heartbeat now; False once the claim is lost.  An unreachable
        store is no lost claim: it is tried again at the next beat."""
        try:
            return self._ask(beat=True)
        except Exception:                  # the store is unreachable: try at the next one
            return self.lost is None

    def confirm(self, read: bool = False) -> bool:
        """Whether the claim is still this job's: within the lease without asking the
        store unless ``read`` (then one read of the lock), past it a heartbeat.
        False once lost or released; a store that cannot be read raises."""
        if not self.holding:
            return False
        lease = time.monotonic() - self.last_beat < stale_s() / 2
        if lease and not read:
            return True
        return self._ask(beat=not lease)

    def _ask(self, beat: bool) -> bool:
        if os.getpid() != self.pid or self.stop.is_set():
            return self.lost is None and not self.stop.is_set()
        with self.lock:
            if self.stop.is_set() or self.lost is not None:
                return False
            began = time.monotonic()
            self.lost = self.backend.beat() if beat else self.backend.check()
            if beat and self.lost is None:
                self.last_beat = began
        return self.lost is None

    def release(self) -> bool:
        """Stop the heartbeat and delete the lock if it is still this claim's
        (never raises: an unreachable store lets the claim lapse)."""
        self.stop.set()
        if os.getpid() != self.pid:
            return False
        if not self.lock.acquire(timeout=60):
            return False
        try:
            return self.backend.release()
        except Exception:                  # the store is unreachable: the claim lapses
            return False
        finally:
            self.lock.release()


def _beat_every(keeper: Heartbeat) -> None:
    while not keeper.stop.wait(heartbeat_s()):
        with quiet():                     # a dependency's warning is no lost claim
            if not keeper.beat():
                return
