"""The claim record and its policy: what a claim says, and whether its owner lives.

A claim (``tensortape.lock/zarr.json``, ``fmt.CLAIM_NAME``) is a Zarr group
document whose attribute ``tensortape_claim`` names the job that records the
run: its host, node (machine and pid namespace), pid, the pid's start time,
when it started, a token unique to the claim, the world size, and its last
heartbeat.  ``claim_doc`` writes that document, ``parse_claim`` reads it back
as a ``Holder``, and ``Holder.alive`` is the one rule that says whether an
owner is gone (see ``_claim``'s docstring for why it is sound).

Pure functions and a frozen record, no state: they run on whichever thread asks
(the training thread at attach, the ``tensortape-claim`` heartbeat thread, the
writer thread at a commit's ``refresh``).  The two mechanisms that store a
claim are ``_lockfile`` (a local or shared file system) and ``_lockobject``
(an object store).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from ..errors import argument

__all__ = ["Held", "Holder", "amended", "beaten", "claim_doc", "heartbeat_s", "new_claim",
           "parse_claim", "refusal", "stale_s", "this_node"]

LOCK_FILE = "zarr.json"        # the claim is the group CLAIM_NAME: its zarr.json names the job
TRIES = 20                     # a claim that changes under us this often: refuse
MAX_BYTES = 1 << 16            # read no more of a claim than this


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
    """What a claim says, and when its owner last showed a sign of life.

    ``readable=False``: a claim still being written (empty or not JSON yet), of
    which only its file's time is known (``Holder.unreadable``)."""
    token: str = ""
    host: str = "?"
    node: str = ""
    pid: int = 0
    pid_started: int | None = None
    started: str = "?"
    world: int = 1
    generation: int = 0                    # takeovers without flock before it (``_lockfile``)
    beat: float = 0.0                      # newest heartbeat: written in it, or its mtime
    readable: bool = True

    @classmethod
    def unreadable(cls, beat: float | None = None) -> Holder:
        """A claim still being written, last touched at ``beat`` (now if None)."""
        return cls(readable=False, beat=time.time() if beat is None else beat)

    def alive(self, now: float | None = None) -> bool:
        """Whether the owner may still be recording (see ``_claim``'s docstring)."""
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


class Held(Exception):
    """A live job holds the claim (``holder``): raised by a lock's ``acquire``."""

    def __init__(self, holder: Holder):
        super().__init__(holder)
        self.holder = holder


def refusal(location: str, mode: str, holder: Holder) -> str:
    """The one-line message of a store that a live job has claimed."""
    doing = {"w": "overwrite", "a": "append to"}.get(mode, "create over")
    lapse = "" if holder.readable and holder.node == this_node() else \
        f"; a claim lapses {stale_s():.0f} s after its owner's last heartbeat"
    return (f"store {location!r} is being recorded by {holder.describe()}; {argument('mode', mode)} will "
            f"not {doing} a run that a live job records: wait for that job to end, or choose "
            f"another path{lapse}")


def new_claim(mode: str, world: int) -> dict:
    """The record of a claim this process takes now (a new token)."""
    return dict(token=uuid.uuid4().hex, host=socket.gethostname(), node=this_node(),
                pid=os.getpid(), pid_started=_proc(os.getpid())[0],
                started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                heartbeat=time.time(), world=int(world), mode=mode)


def claim_doc(info: dict) -> bytes:
    """A claim's record as the ``zarr.json`` of the group ``fmt.CLAIM_NAME``."""
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": {"tensortape_claim": info}}, indent=1).encode()


def amended(raw: bytes, **fields) -> bytes:
    """The claim document ``raw`` with ``fields`` set (all else kept)."""
    info = json.loads(raw)["attributes"]["tensortape_claim"]
    info.update(fields)
    return claim_doc(info)


def beaten(raw: bytes) -> bytes:
    """The claim document ``raw`` with its heartbeat set to now (all else kept)."""
    return amended(raw, heartbeat=time.time())


def parse_claim(raw: bytes, mtime: float) -> Holder:
    """A claim document as read (its file or object last changed at ``mtime``)."""
    try:
        c = json.loads(raw)["attributes"]["tensortape_claim"]
        started = c.get("pid_started")
        return Holder(token=str(c["token"]), host=str(c["host"]), node=str(c["node"]),
                      pid=int(c["pid"]), started=str(c["started"]), world=int(c.get("world", 1)),
                      pid_started=int(started) if started is not None else None,
                      generation=int(c.get("generation") or 0),
                      beat=max(float(c.get("heartbeat") or 0), mtime))
    except Exception:
        return Holder.unreadable(mtime)
