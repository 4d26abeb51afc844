"""The lock of a store location: which mechanism keeps its claim, and who holds it now.

``Lock`` is what both mechanisms do (``_lockfile.LocalLock`` on a file system,
``_lockobject.ObjectLock`` at an fsspec URL); ``lock_for`` picks one for a
location, and ``live_holder`` reads, without taking anything, whether a live
job has claimed it (what ``_root.check_mode`` asks before any mode applies).

No state: runs on the thread that calls it (the training thread at attach,
tools on theirs).
"""

from __future__ import annotations

import os
from typing import Protocol

from .. import format as fmt
from ._holder import Holder
from ._lockfile import LocalLock
from ._lockobject import ObjectLock

__all__ = ["Lock", "live_holder", "lock_for"]


class Lock(Protocol):
    """A claim's mechanism.  ``acquire`` writes the claim ``doc`` atomically or
    raises ``_holder.Held``; ``check`` reads whether the claim is still this
    job's and ``beat`` also keeps its heartbeat: both return why it is lost (None
    while it is this job's); ``release`` deletes it while it is still this job's
    (True if this call did); ``read`` is the claim there.  A store that cannot be
    read raises (no claim is lost for it)."""

    def read(self) -> Holder | None: ...
    def acquire(self, doc: bytes, token: str) -> None: ...
    def check(self) -> str | None: ...
    def beat(self) -> str | None: ...
    def release(self) -> bool: ...


def lock_for(location: str) -> Lock:
    """The mechanism that keeps the claim of the store at ``location`` (a ``file://``
    URL's is its path's)."""
    location = fmt.location(location)
    return ObjectLock(location) if fmt.is_url(location) else LocalLock(location)


def live_holder(location, ignore: str = "") -> Holder | None:
    """The live job whose claim is on the store at ``location`` (not the claim
    whose token is ``ignore``), or None: read only, nothing taken."""
    h = lock_for(os.fspath(location)).read()
    if h is None or (ignore and h.token == ignore) or not h.alive():
        return None
    return h
