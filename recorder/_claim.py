"""One writer owns a run: the claim a job takes on its store when it opens it.

Rank 0 of a job claims the store before it writes anything there, by creating
``tensortape.lock/zarr.json`` at the store's root (``fmt.CLAIM_NAME``: a Zarr
group, so a reader of a live run sees one more group, never a stray object),
*without overwriting*:

- on a local disk or a shared file system with ``open(O_CREAT | O_EXCL)``, the
  content then written and fsync'd; the owner also holds an ``flock`` on that
  file for as long as it records;
- at an ``s3://`` URL with a conditional PUT (``If-None-Match: *``), then read
  back; on other fsspec file systems with ``open(mode="xb")`` where the file
  system has it, else by checking, writing, waiting ``SETTLE_S`` and reading
  back: two jobs that start within that window there can both believe they own
  the store (S3 and local disks have no such window).

The claim names the job: its host, pid, the pid's start time, when it started,
a token unique to this claim and the world size.  A job that finds a live claim
is refused with ``StoreExistsError`` naming that job, whatever its mode: it
never deletes, overwrites or appends to a run that another job records.  Ranks
other than 0 do not claim: they open what rank 0 prepared, under its claim
(``Claim.acquire`` returns them a claim that holds nothing).

**How an owner that is gone is detected** (``Holder.alive``):

- *The same machine* (same host name, boot id and pid namespace): the owner is
  gone when its pid is not running, is a zombie, or is a process that started
  at another time than the owner did (a reused pid).  Locally the owner's
  ``flock`` must be free as well: a lock file some process still holds an flock
  on is never taken over.  So a SIGKILLed or crashed job's claim can be taken
  over at once.
- *Another machine* (a shared file system, an object store): the owner keeps a
  heartbeat, from a thread of its own every ``TENSORTAPE_CLAIM_HEARTBEAT``
  seconds (30) and whenever ``refresh()`` finds it due (the writer calls it at
  each commit): locally the lock file's mtime, on S3 a rewrite of the object
  (its LastModified, and the time written in it).  The owner is gone when the
  newest of those is more than ``TENSORTAPE_CLAIM_STALE`` seconds old (300).
  The clocks of the machines involved (and of the S3 server) must agree to well
  within that; a job paused (or cut off from the store) for longer than it can
  lose its claim, and then learns so from ``refresh()``.
- A claim still being written (empty or unreadable) is live until it is
  ``TENSORTAPE_CLAIM_STALE`` seconds old.

Taking over a claim whose owner is gone is atomic too: locally under the lock
file's ``flock`` (re-read: still that stale claim? then rewritten in place); on
S3 with a PUT conditional on the stale object's ETag (``If-Match``).  Of two jobs
taking one over at once, one wins and the other is refused, naming the winner.

A claim is released (its lock deleted, only while it is still this claim) by
``release()`` at close, by a finaliser when the ``Claim`` is garbage collected,
and at interpreter exit; never by a forked child of the owner.

**The rooms.**  This module is the ``Claim`` a job holds, and nothing else:

- ``_holder``: the claim record and its policy (``Holder``: who owns, gone or not);
- ``_lock``: the ``Lock`` protocol, the mechanism for a location, ``live_holder``;
- ``_lockfile``: the local mechanism (``O_EXCL`` and ``flock``);
- ``_lockobject``: the object-store mechanism (S3's conditional writes);
- ``_heartbeat``: the ``tensortape-claim`` thread and the ``Keeper`` it shares.

**Threads.**  ``Claim.acquire`` and ``release`` run on the training thread
(attach and close; ``release`` also from the garbage collector's finaliser or
at interpreter exit), ``refresh`` on the writer thread at each commit, and the
heartbeat on the claim's own thread (``_heartbeat``), which ``release`` stops.
"""

from __future__ import annotations

import os
import weakref

from ._heartbeat import Keeper
from ._holder import Held, claim_doc, new_claim, refusal
from ._lock import lock_for
from ._root import check_mode
from .errors import StoreExistsError

__all__ = ["Claim"]


class Claim:
    """A job's claim on its store: ``Claim.acquire(location, mode, rank, world)``.

    Rank 0 holds it from ``acquire`` until ``release()``; other ranks get a claim
    that holds nothing (they write under rank 0's).  ``refresh()`` keeps the
    heartbeat (a thread does too) and says whether the claim is still this job's."""

    def __init__(self, location: str, keeper: Keeper | None = None, info: dict | None = None):
        self.location = location
        self.info = dict(info or {})
        self.token: str = self.info.get("token", "")
        self._keeper = keeper
        if keeper is not None:
            self._finalizer = weakref.finalize(self, Keeper.release, keeper)
            keeper.start()

    @classmethod
    def acquire(cls, location, mode: str = "w-", rank: int = 0, world: int = 1) -> Claim:
        """Claim the store at ``location`` for this job, atomically; raise
        ``StoreExistsError`` naming the job that records there if a live job holds
        it (and what ``check_mode`` raises for what is there).  Ranks other than 0
        claim nothing."""
        location = os.fspath(location)
        if rank != 0:
            return cls(location)
        check_mode(location, mode)         # what is there allows the mode: before creating
        lock = lock_for(location)
        info = new_claim(mode, world)
        try:
            lock.acquire(claim_doc(info), info["token"])
        except Held as e:
            raise StoreExistsError(refusal(location, mode, e.holder)) from None
        return cls(location, Keeper(lock), info)

    @property
    def held(self) -> bool:
        """Whether this object holds the claim (rank 0, not released, not lost)."""
        return self._keeper is not None and self._keeper.holding

    @property
    def lost(self) -> str | None:
        """Why the claim is no longer this job's, or None."""
        return None if self._keeper is None else self._keeper.lost

    def refresh(self) -> bool:
        """Keep the heartbeat when one is due (cheap otherwise: the writer may call
        it at every commit).  True while the claim is this job's (always on ranks
        other than 0); False once it is lost (``lost`` says why) or released.
        Never raises: an unreachable store is tried again at the next call."""
        return True if self._keeper is None else self._keeper.beat_if_due()

    def release(self) -> bool:
        """Delete the lock if it is still this claim's (idempotent; never raises).
        True if this call deleted it."""
        if self._keeper is None:
            return False
        self._finalizer.detach()
        if self._keeper.stop.is_set():
            return False
        return self._keeper.release()

    def keep(self) -> None:
        """Hold the claim until this process ends (a writer that gave up at close may
        still write): neither the garbage collector nor interpreter exit releases
        it; a job after this process sees its pid gone and takes it over."""
        if self._keeper is not None:
            self._finalizer.detach()

    def __repr__(self) -> str:
        state = "held" if self.held else ("shared" if self._keeper is None else "released")
        return f"Claim({self.location!r}, {state})"
