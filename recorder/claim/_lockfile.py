"""The claim on a local disk or a shared file system: ``O_EXCL`` and ``flock``.

``LocalLock.acquire`` creates ``tensortape.lock/zarr.json`` with
``open(O_CREAT | O_EXCL)``, takes an ``flock`` on it, and writes and fsyncs the
claim; the owner holds that flock for as long as it records, so a lock file
some process still holds an flock on is never taken over.  A claim whose owner
is gone (``Holder.alive``) is taken over under its flock: re-read, still that
stale claim? then rewritten in place.  The heartbeat is the file's mtime;
``release`` deletes the file, under the flock, only while it is still this
claim.  On a file system without flocks, pids and heartbeats decide alone, and
a claim whose owner is gone is taken over by an exclusive create: a claim
carries its ``generation`` (the takeovers before it), and the job that creates
``taken.<generation + 1>`` beside it (``O_EXCL``, holding the new claim) is the
one that takes it over: it checks that the claim is still the one it found
gone, and renames its own over it.  Any other job that found the same claim
gone is refused, naming the winner, however far apart their writes land.  A
marker whose job is gone (it died taking the claim over) is passed by, to the
next generation.  So is the marker of a job paused between its marker and its
rename for longer than the stale time: once its rename lands, that job finds the
later generation's marker, puts the claim written there back in place and is
refused, naming the job that passed it (``_passed``), whose claim stays its own
(``_follow``: the same claim in a new file).

Runs on the thread that calls it: the training thread at attach
(``acquire``), the ``tensortape-claim`` thread and the writer thread (``beat``,
serialised by ``_heartbeat.Heartbeat``'s lock), and whichever thread releases the
claim (close, the garbage collector's finaliser, interpreter exit).
"""

from __future__ import annotations

import os
import time

from .. import format as fmt
from ._holder import LOCK_FILE, MAX_BYTES, TRIES, Held, Holder, amended, parse_claim

__all__ = ["LocalLock"]

try:
    import fcntl
except ImportError:                        # no flock here: pids and heartbeats decide
    fcntl = None

MARKER = "taken.{}"            # without flocks: the takeover to a claim's generation


def _generation(name: str) -> int:
    """The generation whose marker is named ``name`` (-1: no marker)."""
    digits = name[len("taken."):] if name.startswith("taken.") else ""
    return int(digits) if digits.isascii() and digits.isdigit() else -1


def _flock(fd: int, wait: float) -> bool | None:
    """Take an exclusive flock on ``fd`` within ``wait`` seconds: True when taken,
    False when another process holds it, None on a file system without flocks."""
    if fcntl is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        except OSError:                    # ENOLCK, ENOSYS, EOPNOTSUPP: no flocks here
            return None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _holder_of(fd: int) -> Holder:
    """The claim in the open lock file ``fd``, without its mtime."""
    return parse_claim(os.pread(fd, MAX_BYTES, 0), 0.0)


def _read_file(path: str) -> Holder | None:
    """The claim in the file at ``path`` (None if there is none)."""
    try:
        with open(path, "rb") as f:
            return parse_claim(f.read(MAX_BYTES), os.fstat(f.fileno()).st_mtime)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write(fd: int, doc: bytes) -> None:
    """``doc`` written to the new file ``fd``, fsync'd, and the file closed."""
    try:
        os.pwrite(fd, doc, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class LocalLock:
    """The lock file of the store at ``location``; ``fd`` while this job holds it."""

    def __init__(self, location: str):
        self.dir = os.path.join(location, fmt.CLAIM_NAME)
        self.path = os.path.join(self.dir, LOCK_FILE)
        self.fd: int | None = None
        self.token = ""
        self.generation = 0            # of a claim this job took over without flocks

    def read(self) -> Holder | None:
        """The claim there (None if there is none), given a moment if being written."""
        h = None
        for _ in range(20):
            h = _read_file(self.path)
            if h is None or h.readable or time.time() - h.beat > 1:
                return h
            time.sleep(0.05)               # being written: give its owner a moment
        return h

    def acquire(self, doc: bytes, token: str) -> None:
        """Write the claim ``doc`` (whose token is ``token``) if there is none or
        its owner is gone; else raise ``Held``."""
        cloexec = getattr(os, "O_CLOEXEC", 0)
        for _ in range(TRIES):
            os.makedirs(self.dir, exist_ok=True)
            try:
                # held read-only (the flock needs no more): an open file for writing
                # would keep its file system from a read-only remount
                fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | cloexec, 0o644)
                created = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, os.O_RDONLY | cloexec)
                except FileNotFoundError:  # released meanwhile
                    continue
                created = False
            except FileNotFoundError:      # its folder removed by a release meanwhile
                continue
            try:
                locked = _flock(fd, 2.0 if created else 0.5)
                if locked is False:                  # a live owner holds it
                    raise Held(self.read() or Holder.unreadable())
                if not _same_file(fd, self.path):    # released and claimed anew meanwhile
                    os.close(fd)
                    continue
                if not created:
                    h = parse_claim(os.pread(fd, MAX_BYTES, 0), os.fstat(fd).st_mtime)
                    if h.alive():
                        raise Held(h)
                    if locked is None:               # no flocks: an exclusive takeover
                        os.close(fd)
                        fd = -1
                        fd = self._take_over(doc, token, h)
                        self.fd, self.token = fd, token
                        return
                w = os.open(self.path, os.O_WRONLY | cloexec)    # under the flock
                try:
                    os.ftruncate(w, 0)     # a gone owner's: taken over
                    os.pwrite(w, doc, 0)
                    os.fsync(w)
                finally:
                    os.close(w)
            except BaseException:
                if created and _same_file(fd, self.path) and not os.fstat(fd).st_size:
                    os.unlink(self.path)   # the empty file this call made: not left behind
                if fd >= 0:
                    os.close(fd)
                raise
            self.fd, self.token = fd, token
            return
        raise Held(self.read() or Holder.unreadable())

    def _take_over(self, doc: bytes, token: str, gone: Holder) -> int:
        """Without flocks: the claim of ``gone`` (an owner that is gone) replaced by
        ``doc`` (whose token is ``token``), if this job is the one that creates the
        marker of its next generation; the lock file, open.  Else ``Held`` names
        who took it."""
        cloexec = getattr(os, "O_CLOEXEC", 0)
        generation = gone.generation
        for _ in range(TRIES):
            generation += 1
            doc = amended(doc, generation=generation)
            marker = os.path.join(self.dir, MARKER.format(generation))
            try:
                m = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | cloexec, 0o644)
            except FileExistsError:
                h = _read_file(marker) or Holder.unreadable(0.0)
                if h.alive():                  # another job takes it over, or took it
                    raise Held(h) from None
                continue                       # a job that died taking it over: passed by
            try:
                _write(m, doc)
            except BaseException:              # a disk full: no empty marker left to refuse others
                _unlink(marker)
                raise
            break
        else:
            raise Held(self.read() or Holder.unreadable())
        try:
            now = self.read()
            if now is None or now.token not in (gone.token, token):   # released, or taken
                raise Held(now or Holder.unreadable())    # meanwhile (ours: put back, ``_passed``)
            self._put(doc, token)
            passed = self._passed(generation, token)
            if passed is not None:
                raise Held(passed)
            fd = os.open(self.path, os.O_RDONLY | cloexec)
        except BaseException:
            _unlink(marker)                    # not taken: the generation is free again
            raise
        self.generation = generation
        for name in os.listdir(self.dir):      # the markers of earlier takeovers
            if 0 <= _generation(name) < generation:
                _unlink(os.path.join(self.dir, name))
        return fd

    def _put(self, doc: bytes, token: str) -> None:
        """``doc`` renamed into place as the lock file."""
        tmp = os.path.join(self.dir, f"zarr.{token}.partial")
        _write(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                       0o644), doc)
        os.replace(tmp, self.path)

    def _passed(self, generation: int, token: str) -> Holder | None:
        """After this job's rename to ``generation``: the claim of a later generation's
        marker (a job that passed this one by while it was paused past the stale time),
        put back in place; None where there is none."""
        for name in sorted(os.listdir(self.dir), key=_generation, reverse=True):
            if _generation(name) <= generation:
                return None
            try:
                with open(os.path.join(self.dir, name), "rb") as f:
                    raw = f.read(MAX_BYTES)
            except FileNotFoundError:          # released meanwhile
                continue
            h = parse_claim(raw, time.time())
            if h.readable:                     # else still being written: its job reads ours
                self._put(raw, token)          # in place, and is refused
                return h
        return None

    def check(self) -> str | None:
        """Why the claim is no longer this job's, or None: a ``stat`` and a ``pread``
        of the lock file held open."""
        if self.fd is None:
            return "released"
        self._follow()
        if not _same_file(self.fd, self.path):
            h = self.read()
            if h is not None and h.token != self.token:
                if h.generation < self.generation:  # a takeover this claim passed, its late
                    return None                     # rename about to be undone (``_passed``)
                return f"taken over by {h.describe()}"
            return f"its lock {self.path!r} was removed (a job that took the run over ended?)"
        h = _holder_of(self.fd)
        if h.token != self.token:
            return f"taken over by {h.describe()}"
        return None

    def beat(self) -> str | None:
        """Touch the lock file; why the claim is no longer this job's, or None."""
        why = self.check()
        if why is None:
            os.utime(self.fd if os.utime in os.supports_fd else self.path)
        return why

    def _follow(self) -> None:
        """This claim put back in place as a new file (by a job paused in its takeover
        past the stale time, ``_passed``): that file is held from now on."""
        if self.fd is None or _same_file(self.fd, self.path):
            return
        h = self.read()
        if h is not None and h.token == self.token:
            try:
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                return
            os.close(self.fd)
            self.fd = fd

    def release(self) -> bool:
        """Delete the lock file if it is still this claim; True if this call did."""
        self._follow()
        fd, self.fd = self.fd, None
        if fd is None:
            return False
        try:
            if not _same_file(fd, self.path) or _holder_of(fd).token != self.token:
                return False
            os.unlink(self.path)           # under our flock: nobody takes it over meanwhile
            if self.generation:
                _unlink(os.path.join(self.dir, MARKER.format(self.generation)))
            try:
                os.rmdir(self.dir)
            except OSError:
                pass
            return True
        finally:
            os.close(fd)
