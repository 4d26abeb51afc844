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
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone

from . import format as fmt
from .errors import StoreExistsError

__all__ = ["Claim", "Holder", "live_holder"]

LOCK_FILE = "zarr.json"        # the claim is the group CLAIM_NAME: its zarr.json names the job
SETTLE_S = 1.0                 # fsspec without exclusive create: write, wait, read back
_TRIES = 20                    # a claim that changes under us this often: refuse
_MAX_BYTES = 1 << 16


def heartbeat_s() -> float:
    """Seconds between an owner's heartbeats (``TENSORTAPE_CLAIM_HEARTBEAT``)."""
    return float(os.environ.get("TENSORTAPE_CLAIM_HEARTBEAT") or 30)


def stale_s() -> float:
    """Seconds without a heartbeat after which an owner on another machine is
    gone (``TENSORTAPE_CLAIM_STALE``)."""
    return float(os.environ.get("TENSORTAPE_CLAIM_STALE") or 300)


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def this_node() -> str:
    """This machine and pid namespace: where a pid names the same process."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{_read_text('/proc/sys/kernel/random/boot_id')}|{ns}"


def _proc(pid: int) -> tuple[int | None, str]:
    """A process's start time (clock ticks since boot) and state, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        fields = s[s.rindex(")") + 2:].split()
        return int(fields[19]), fields[0]
    except (OSError, ValueError, IndexError):
        return None, ""


def pid_alive(pid: int, started: int | None) -> bool:
    """Whether ``pid`` on this machine is still the process that started at
    ``started`` (clock ticks since boot, or None if unknown)."""
    if pid <= 0:
        return True                       # not a process we can ask about: assume live
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                        # EPERM: some process has that pid
        pass
    ticks, state = _proc(pid)
    if state in ("Z", "X"):                # killed, not yet reaped by its parent
        return False
    return started is None or ticks is None or ticks == started


@dataclass(frozen=True)
class Holder:
    """What a claim says, and when its owner last showed a sign of life."""
    token: str = ""
    host: str = "?"
    node: str = ""
    pid: int = 0
    pid_started: int | None = None
    started: str = "?"
    world: int = 1
    beat: float = 0.0                      # newest heartbeat: written in it, or its mtime
    readable: bool = True

    def alive(self, now: float | None = None) -> bool:
        """Whether the owner may still be recording (see the module docstring)."""
        if self.readable and self.pid > 0 and self.node == this_node():
            return pid_alive(self.pid, self.pid_started)
        return (time.time() if now is None else now) - self.beat < stale_s()

    def describe(self) -> str:
        if not self.readable:
            return "another job (its claim is still being written)"
        same = self.node == this_node()
        who = "this process (another Recorder)" if same and self.pid == os.getpid() \
            else "another job"
        text = f"{who}: host {self.host}, pid {self.pid}, started {self.started}"
        if not same:
            text += f", last heartbeat {max(0.0, time.time() - self.beat):.0f} s ago"
        return text + (f", {self.world} ranks" if self.world > 1 else "")


def refusal(location: str, mode: str, holder: Holder) -> str:
    """The one-line message of a store that a live job has claimed."""
    doing = {"w": "overwrite", "a": "append to"}.get(mode, "create over")
    lapse = "" if holder.readable and holder.node == this_node() else \
        f"; a claim lapses {stale_s():.0f} s after its owner's last heartbeat"
    return (f"store {location!r} is being recorded by {holder.describe()}; mode={mode!r} will "
            f"not {doing} a run that a live job records: wait for that job to end, or choose "
            f"another path{lapse}")


def _doc(info: dict) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": {"tensortape_claim": info}}, indent=1).encode()


def _parse(raw: bytes, mtime: float) -> Holder:
    try:
        c = json.loads(raw)["attributes"]["tensortape_claim"]
        started = c.get("pid_started")
        return Holder(token=str(c["token"]), host=str(c["host"]), node=str(c["node"]),
                      pid=int(c["pid"]), started=str(c["started"]), world=int(c.get("world", 1)),
                      pid_started=int(started) if started is not None else None,
                      beat=max(float(c.get("heartbeat") or 0), mtime))
    except Exception:
        return Holder(readable=False, beat=mtime)


class _Held(Exception):
    def __init__(self, holder: Holder):
        super().__init__(holder)
        self.holder = holder


# --- a local disk or a shared file system ----------------------------------
try:
    import fcntl
except ImportError:                        # no flock here: pids and heartbeats decide
    fcntl = None


def _flock(fd: int, wait: float) -> bool:
    """Take an exclusive flock on ``fd`` within ``wait`` seconds; True on a file
    system without flocks."""
    if fcntl is None:
        return True
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
            return True


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class _Local:
    def __init__(self, location: str):
        self.dir = os.path.join(location, fmt.CLAIM_NAME)
        self.path = os.path.join(self.dir, LOCK_FILE)
        self.fd: int | None = None
        self.token = ""

    def read(self) -> Holder | None:
        h = None
        for _ in range(20):
            try:
                with open(self.path, "rb") as f:
                    raw, mtime = f.read(_MAX_BYTES), os.fstat(f.fileno()).st_mtime
            except (FileNotFoundError, NotADirectoryError):
                return None
            h = _parse(raw, mtime)
            if h.readable or time.time() - mtime > 1:
                return h
            time.sleep(0.05)               # being written: give its owner a moment
        return h

    def acquire(self, doc: bytes, token: str) -> None:
        cloexec = getattr(os, "O_CLOEXEC", 0)
        for _ in range(_TRIES):
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
                if not _flock(fd, 2.0 if created else 0.5):     # a live owner holds it
                    raise _Held(self.read() or Holder(readable=False, beat=time.time()))
                if not _same_file(fd, self.path):    # released and claimed anew meanwhile
                    os.close(fd)
                    continue
                if not created:
                    h = _parse(os.pread(fd, _MAX_BYTES, 0), os.fstat(fd).st_mtime)
                    if h.alive():
                        raise _Held(h)
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
                os.close(fd)
                raise
            self.fd, self.token = fd, token
            return
        raise _Held(self.read() or Holder(readable=False, beat=time.time()))

    def beat(self) -> str | None:
        if self.fd is None:
            return "released"
        if not _same_file(self.fd, self.path):
            return f"its lock {self.path!r} was removed or replaced"
        h = _parse(os.pread(self.fd, _MAX_BYTES, 0), 0.0)
        if h.token != self.token:
            return f"taken over by {h.describe()}"
        os.utime(self.fd if os.utime in os.supports_fd else self.path)
        return None

    def release(self) -> bool:
        fd, self.fd = self.fd, None
        if fd is None:
            return False
        try:
            if not _same_file(fd, self.path) or \
                    _parse(os.pread(fd, _MAX_BYTES, 0), 0.0).token != self.token:
                return False
            os.unlink(self.path)           # under our flock: nobody takes it over meanwhile
            try:
                os.rmdir(self.dir)
            except OSError:
                pass
            return True
        finally:
            os.close(fd)


# --- an fsspec URL (s3:// with conditional writes) ----------------------------
def _s3_error(e: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status behind an s3fs error."""
    seen = 0
    while e is not None and seen < 8:
        r = getattr(e, "response", None)
        if isinstance(r, dict):
            return (str(r.get("Error", {}).get("Code", "")),
                    r.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return "", None


def _precondition(e: BaseException) -> bool:
    code, status = _s3_error(e)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412) \
        or "pre-condition" in str(e).lower()


def _unsupported(e: BaseException) -> bool:
    """The server answered, but not to the condition: it does not support it
    (501, or a 400 for a header it does not know); not a network error."""
    code, status = _s3_error(e)
    return not _precondition(e) and (status in (400, 501) or code in (
        "NotImplemented", "InvalidArgument", "InvalidRequest"))


def drop_folder(fs, path: str) -> None:
    """Remove the empty "folder" an object store may keep of ``path`` once its
    objects are deleted (SeaweedFS does; zarr would list it and warn)."""
    if not hasattr(fs, "_call_s3"):
        return
    bucket, key, _ = fs.split_path(path.rstrip("/"))
    try:
        fs.call_s3("delete_object", Bucket=bucket, Key=key + "/")
    except Exception:
        pass
    fs.invalidate_cache(path)


class _Url:
    def __init__(self, location: str):
        import fsspec
        self.fs, root = fsspec.core.url_to_fs(location)
        self.key = f"{root.rstrip('/')}/{fmt.CLAIM_NAME}/{LOCK_FILE}"
        self.s3 = hasattr(self.fs, "_call_s3") and hasattr(self.fs, "split_path")
        self.token = ""
        self.info: dict = {}
        self.held = False

    def _get(self) -> tuple[bytes, str | None, float] | None:
        """The claim's bytes, ETag and mtime, read at once; None if there is none."""
        if self.s3:
            from fsspec.asyn import sync
            bucket, key, _ = self.fs.split_path(self.key)

            async def get():
                try:
                    r = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                except FileNotFoundError:
                    return None
                try:
                    data = await r["Body"].read()
                finally:
                    r["Body"].close()
                return data, r.get("ETag"), r["LastModified"].timestamp()
            return sync(self.fs.loop, get)
        try:
            data = self.fs.cat_file(self.key)
            info = self.fs.info(self.key)
        except FileNotFoundError:
            return None
        mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
        if isinstance(mtime, datetime):
            mtime = mtime.timestamp()
        return data, None, float(mtime)

    def read(self) -> Holder | None:
        got = self._get()
        return None if got is None else _parse(got[0], got[2])

    def _put(self, doc: bytes, etag: str | None) -> bool:
        """Overwrite the claim only if it is still the object ``etag`` names."""
        if self.s3 and etag:
            bucket, key, _ = self.fs.split_path(self.key)
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=doc, IfMatch=etag)
                return True
            except Exception as e:
                if isinstance(e, FileNotFoundError) or _precondition(e):
                    return False
                if not _unsupported(e):
                    raise
            finally:
                self.fs.invalidate_cache(self.key)
        self.fs.pipe_file(self.key, doc)   # no conditional overwrite: the read-back decides
        self.fs.invalidate_cache(self.key)
        return True

    def _create(self, doc: bytes) -> bool:
        """Write the claim only if there is none; False if there is one."""
        try:
            if self.s3:
                self.fs.pipe_file(self.key, doc, mode="create")    # If-None-Match: *
            else:
                with self.fs.open(self.key, "xb") as f:
                    f.write(doc)
            return True
        except FileExistsError:
            return False
        except Exception as e:
            if self.s3 and _precondition(e):
                return False
            old_client = isinstance(e, TypeError) or type(e).__name__ == "ParamValidationError"
            if self.s3 and not _unsupported(e) and not old_client:   # (no If-None-Match there)
                raise
        finally:
            self.fs.invalidate_cache(self.key)
        if self.fs.exists(self.key):      # no exclusive create: check, write, wait, read back
            return False
        self.fs.pipe_file(self.key, doc)
        time.sleep(SETTLE_S)
        return True

    def _mine(self) -> bool:
        got = self._get()
        return got is not None and _parse(got[0], got[2]).token == self.token

    def acquire(self, doc: bytes, token: str) -> None:
        self.token = token
        for _ in range(_TRIES):
            # a look first: a server that ignores If-None-Match would overwrite a claim
            if self._get() is None and self._create(doc) and self._mine():
                self.held = True
                return
            got = self._get()
            if got is None:                # released meanwhile
                continue
            h = _parse(got[0], got[2])
            if h.token == token:
                self.held = True
                return
            if h.alive():
                raise _Held(h)
            if self._put(doc, got[1]) and self._mine():    # gone: taken over, If-Match
                self.held = True
                return
        h = self.read()
        raise _Held(h or Holder(readable=False, beat=time.time()))

    def beat(self) -> str | None:
        if not self.held:
            return "released"
        got = self._get()
        if got is None:
            return f"its lock {self.key!r} was deleted"
        h = _parse(got[0], got[2])
        if h.token != self.token:
            return f"taken over by {h.describe()}"
        info = json.loads(got[0])["attributes"]["tensortape_claim"]
        info["heartbeat"] = time.time()
        if not self._put(_doc(info), got[1]):
            return "taken over while its heartbeat was written"
        return None

    def release(self) -> bool:
        if not self.held:
            return False
        self.held = False
        got = self._get()
        if got is None or _parse(got[0], got[2]).token != self.token:
            return False
        if self.s3 and got[1]:
            bucket, key, _ = self.fs.split_path(self.key)
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=got[1])
            except Exception as e:
                if isinstance(e, FileNotFoundError) or _precondition(e):
                    return False
                if not _unsupported(e):
                    raise
                self.fs.rm_file(self.key)
        else:
            self.fs.rm_file(self.key)
        drop_folder(self.fs, self.key.rsplit("/", 1)[0])
        self.fs.invalidate_cache()
        return True


# --- the claim ---------------------------------------------------------------
class _Keeper:
    """What the heartbeat thread and the finaliser share (never the Claim itself,
    so that a forgotten Claim is collected and released)."""

    def __init__(self, backend):
        self.backend = backend
        self.pid = os.getpid()             # a forked child never beats nor releases
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.lost: str | None = None
        self.last_beat = time.monotonic()

    def beat(self) -> bool:
        if os.getpid() != self.pid or self.stop.is_set():
            return self.lost is None
        with self.lock:
            if self.stop.is_set() or self.lost is not None:
                return self.lost is None
            try:
                self.lost = self.backend.beat()
            except Exception:              # the store is unreachable: try at the next one
                return True
            self.last_beat = time.monotonic()
        return self.lost is None

    def release(self) -> bool:
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


def _beat_every(keeper: _Keeper) -> None:
    from ._quiet import quiet
    while not keeper.stop.wait(heartbeat_s()):
        with quiet():                     # a dependency's warning is no lost claim
            if not keeper.beat():
                return


class Claim:
    """A job's claim on its store: ``Claim.acquire(location, mode, rank, world)``.

    Rank 0 holds it from ``acquire`` until ``release()``; other ranks get a claim
    that holds nothing (they write under rank 0's).  ``refresh()`` keeps the
    heartbeat (a thread does too) and says whether the claim is still this job's."""

    def __init__(self, location: str, backend=None, info: dict | None = None):
        self.location = location
        self.info = dict(info or {})
        self.token: str = self.info.get("token", "")
        self._keeper = None if backend is None else _Keeper(backend)
        if self._keeper is not None:
            self._finalizer = weakref.finalize(self, _Keeper.release, self._keeper)
            threading.Thread(target=_beat_every, args=(self._keeper,), daemon=True,
                             name="tensortape-claim").start()

    @classmethod
    def acquire(cls, location, mode: str = "w-", rank: int = 0, world: int = 1) -> "Claim":
        """Claim the store at ``location`` for this job, atomically; raise
        ``StoreExistsError`` naming the job that records there if a live job holds
        it (and what ``check_mode`` raises for what is there).  Ranks other than 0
        claim nothing."""
        location = os.fspath(location)
        if rank != 0:
            return cls(location)
        from ._store import check_mode
        check_mode(location, mode)         # what is there allows the mode: before creating
        backend = _Url(location) if fmt.is_url(location) else _Local(location)
        info = dict(token=uuid.uuid4().hex, host=socket.gethostname(), node=this_node(),
                    pid=os.getpid(), pid_started=_proc(os.getpid())[0],
                    started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    heartbeat=time.time(), world=int(world), mode=mode)
        try:
            backend.acquire(_doc(info), info["token"])
        except _Held as e:
            raise StoreExistsError(refusal(location, mode, e.holder)) from None
        return cls(location, backend, info)

    @property
    def held(self) -> bool:
        """Whether this object holds the claim (rank 0, not released, not lost)."""
        k = self._keeper
        return k is not None and not k.stop.is_set() and k.lost is None

    @property
    def lost(self) -> str | None:
        """Why the claim is no longer this job's, or None."""
        return None if self._keeper is None else self._keeper.lost

    def refresh(self) -> bool:
        """Keep the heartbeat when one is due (cheap otherwise: the writer may call
        it at every commit).  True while the claim is this job's (always on ranks
        other than 0); False once it is lost (``lost`` says why) or released.
        Never raises: an unreachable store is tried again at the next call."""
        k = self._keeper
        if k is None:
            return True
        if k.stop.is_set() or k.lost is not None:
            return False
        if time.monotonic() - k.last_beat < heartbeat_s():
            return True
        return k.beat()

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


def live_holder(location, ignore: str = "") -> Holder | None:
    """The live job whose claim is on the store at ``location`` (not the claim
    whose token is ``ignore``), or None: read only, nothing taken."""
    location = os.fspath(location)
    backend = _Url(location) if fmt.is_url(location) else _Local(location)
    h = backend.read()
    if h is None or (ignore and h.token == ignore) or not h.alive():
        return None
    return h
