"""The drop ledger: what a recording dropped instead of recording, counted by reason.

Nothing tensortape drops goes uncounted: a late gradient, a full tensor of a
dtype the store cannot hold, a capture that failed, a snapshot past a memory
cap, the captures of a record the writer thread could not be given.  Each
drop is counted here with its reason (a short sentence, the key of the run's
``drop_reasons``); a step's record takes the counts since the last one
(``take``) to the writer thread, which adds them to the run's; a record the
writer's handle could not hand on gives its counts back (``restore``), and
the next record takes them.  One ledger a recording: the step buffer and the
writer's handle share it, and ``total`` is what the Recorder reports.

Any thread: the training thread, autograd's threads (gradients) count here,
under one lock.  What the writer thread itself drops (a table that changed
dtype, full tensors lost at a new start) it counts in the rank's state, with
the commit that stores it.
"""

from __future__ import annotations

import threading

__all__ = ["DropLedger", "cause"]


def cause(e: BaseException) -> str:
    """A drop's reason for an exception: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


class DropLedger:
    """Drops counted by reason since the last ``take``, and in all."""

    def __init__(self):
        self._lock = threading.Lock()
        self._since: dict[str, int] = {}
        self.total = 0                        # every drop counted here, taken or not

    def drop(self, reason: str, n: int = 1) -> None:
        """Count ``n`` captures (or rows) dropped for ``reason``."""
        with self._lock:
            self._since[reason] = self._since.get(reason, 0) + n
            self.total += n

    def take(self) -> dict[str, int]:
        """The counts since the last ``take`` (for a record), by reason."""
        with self._lock:
            since, self._since = self._since, {}
        return since

    def restore(self, counts: dict[str, int]) -> None:
        """Give back counts taken for a record that was not handed on: the next
        record takes them (``total`` holds them already)."""
        with self._lock:
            for reason, n in counts.items():
                self._since[reason] = self._since.get(reason, 0) + n
