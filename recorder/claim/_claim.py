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
other than 0 do not claim: they open what rank 0 prepared, under its claim,
whose token rank 0 tells them (``Claim.shared``: a claim that holds nothing and
checks rank 0's).

**How an owner that is gone is detected** (``Holder.alive``):

- *The same machine* (same host name, boot id and pid namespace): the owner is
  gone when its pid is not running, is a zombie, or is a process that started
  at another time than the owner did (a reused pid).  Locally the owner's
  ``flock`` must be free as well: a lock file some process still holds an flock
  on is never taken over.  So a SIGKILLed or crashed job's claim can be taken
  over at once.
- *Another machine* (a shared file system, an object store): the owner keeps a
  heartbeat, from a thread of its own every ``TENSORTAPE_CLAIM_HEARTBEAT``
  seconds (30): locally the lock file's mtime, on S3 a rewrite of the object
  (its LastModified, and the time written in it).  The owner is gone when the
  newest of those is more than ``TENSORTAPE_CLAIM_STALE`` seconds old (300).
  The clocks of the machines involved (and of the S3 server) must agree to well
  within that; a job paused (or cut off from the store) for longer than it can
  lose its claim.

**The fence.**  A job writes only while its claim is its own (``confirm``):
within half the stale time of its last heartbeat no other job can have taken
it, so a write needs no question to the store; past that (a job paused, a
heartbeat not written) it beats first; and every commit reads the lock first
(a ``pread`` of the lock file held open, one GET on S3).  Other ranks read
rank 0's claim so (``Claim.shared``), within half the stale time of the
heartbeat they last read in it, and at the start of every commit too: a
crashed rank 0's claim is taken over at once on its machine, so their lease
does not hold.  A claim they find gone is rank 0's close only while the run's
root still names this claim (``fmt.CLAIM_TOKEN``, written by each of rank 0's
commits): else another job took the run over and has closed it.  On S3 the
commit's records are written conditionally besides (``_fenced``).  A claim
found taken over is lost for good.
- A claim still being written (empty or unreadable) is live until it is
  ``TENSORTAPE_CLAIM_STALE`` seconds old.

Taking over a claim whose owner is gone is atomic too: locally under the lock
file's ``flock`` (re-read: still that stale claim? then rewritten in place);
without ``flock`` by the exclusive create of a marker of the claim's next
generation (``_lockfile``); on S3 with a PUT conditional on the stale object's
ETag (``If-Match``).  Of two jobs taking one over at once, one wins and the
other is refused, naming the winner.

A claim is released (its lock deleted, only while it is still this claim) by
``release()`` at close, by a finaliser when the ``Claim`` is garbage collected,
and at interpreter exit; never by a forked child of the owner.

**The rooms.**  This module is the ``Claim`` a job holds, and nothing else:

- ``_holder``: the claim record and its policy (``Holder``: who owns, gone or not);
- ``_lock``: the ``Lock`` protocol, the mechanism for a location, ``live_holder``;
- ``_lockfile``: the local mechanism (``O_EXCL`` and ``flock``);
- ``_lockobject``: the object-store mechanism (S3's conditional writes);
- ``_fenced``: a commit's records on S3, written conditionally (``If-Match``);
- ``_heartbeat``: the ``tensortape-claim`` thread and the ``Heartbeat`` it shares.

**Threads.**  ``Claim.acquire`` and ``release`` run on the training thread
(attach and close; ``release`` also from the garbage collector's finaliser or
at interpreter exit), ``confirm`` on the writer thread, and the heartbeat on
the claim's own thread (``_heartbeat``), which ``release`` stops.
"""

from __future__ import annotations

import os
import time
import weakref

from ._heartbeat import Heartbeat
from ._holder import Held, claim_doc, new_claim, refusal, stale_s
from ._lock import lock_for
from ._root import run_claim
from ..errors import StoreExistsError

__all__ = ["Claim"]


class Claim:
    """A job's claim on its store: ``Claim.acquire(location, mode, world)`` on rank 0,
    ``Claim.shared(location, token)`` on the others.

    Rank 0 holds it from ``acquire`` until ``release()``, a thread keeping its
    heartbeat; a shared claim holds nothing (its rank writes under rank 0's).
    ``confirm()`` says whether the claim is still this job's, ``lost`` why not."""

    def __init__(self, location: str, token: str, heartbeat: Heartbeat | None = None,
                 info: dict | None = None):
        self.location = location
        self.token = token
        self.info = dict(info or {})
        self.lost: str | None = None           # why the claim is no longer this job's
        self._heartbeat = heartbeat
        self._lock = None                      # a shared claim's reader of rank 0's
        self._beat = 0.0                       # and the heartbeat it last read there
        if heartbeat is not None:
            self._finalizer = weakref.finalize(self, Heartbeat.release, heartbeat)
            heartbeat.start()

    @classmethod
    def acquire(cls, location, mode: str = "w-", world: int = 1) -> Claim:
        """Claim the store at ``location`` for this job, atomically; raise
        ``StoreExistsError`` naming the job that records there if a live job
        holds it (``mode`` only words the refusal)."""
        location = os.fspath(location)
        lock = lock_for(location)
        info = new_claim(mode, world)
        try:
            lock.acquire(claim_doc(info), info["token"])
        except Held as e:
            raise StoreExistsError(refusal(location, mode, e.holder)) from None
        return cls(location, info["token"], Heartbeat(lock), info)

    @classmethod
    def shared(cls, location, token: str) -> Claim:
        """Rank 0's claim ``token``, as another rank of its job sees it."""
        claim = cls(os.fspath(location), token)
        claim._lock = lock_for(claim.location)
        return claim

    @property
    def shared_by_rank(self) -> bool:
        """A rank other than 0's view of rank 0's claim: it has no lease of its own
        (a crashed rank 0's claim is taken over at once on its machine), so each of
        its commits reads the claim before it writes anything."""
        return self._lock is not None

    @property
    def held(self) -> bool:
        """Whether this object holds the claim (rank 0, not released, not lost)."""
        return self._heartbeat is not None and self._heartbeat.holding

    def confirm(self, read: bool = False) -> bool:
        """Whether the claim is still this job's (see the module: the fence).
        ``read``: ask the store even within the lease.  A store that cannot be read
        raises; a claim found lost stays lost (``lost`` says why)."""
        if self.lost is None:
            if self._heartbeat is not None:
                self._heartbeat.confirm(read)
                self.lost = self._heartbeat.lost or (None if self._heartbeat.holding
                                                     else "released")
            elif self._lock is not None and (read or time.time() - self._beat >= stale_s() / 2):
                self._watch()
        return self.lost is None

    def _watch(self) -> None:
        h = self._lock.read()
        if h is None and run_claim(self.location) != self.token:   # another job's root
            self.lost = "taken over by another job, which has since closed the run"
        elif h is None:                # released by rank 0's close: this rank's last commit
            self._beat = 0.0           # goes on, asking again each time
        elif h.token != self.token:
            self.lost = f"taken over by {h.describe()}"
        else:
            self._beat = h.beat

    def release(self) -> bool:
        """Delete the lock if it is still this claim's (idempotent; never raises).
        True if this call deleted it."""
        if self._heartbeat is None:
            return False
        self._finalizer.detach()
        if self._heartbeat.stop.is_set():
            return False
        return self._heartbeat.release()

    def keep(self) -> None:
        """Hold the claim until this process ends (a writer that gave up at close may
        still write): neither the garbage collector nor interpreter exit releases
        it; a job after this process sees its pid gone and takes it over."""
        if self._heartbeat is not None:
            self._finalizer.detach()

    def __repr__(self) -> str:
        state = "held" if self.held else ("shared" if self._heartbeat is None else "released")
        return f"Claim({self.location!r}, {state})"
