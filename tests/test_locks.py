"""``LockTests``: one suite over every mechanism that keeps a run's claim, the way
zarr-python runs its ``StoreTests`` over every store.

Each class names a location kind (``location``) and how a claim is left there
by hand (``plant``: another job's, or the empty file of a job killed between
creating its claim and writing it); the suite asks of each: acquire, refuse a
second job, beat, check, a stale claim taken over by two jobs at once (exactly
one wins), release, and a kill between create and write."""
import contextlib
import json
import os
import time
import uuid

import fsspec
import pytest

from conftest import at_once
from tensortape.recorder import format as fmt
from tensortape.recorder.claim._holder import Held, claim_doc, new_claim
from tensortape.recorder.claim._lock import lock_for

STALE_S = 2.0


def other_job(**over) -> bytes:
    """The claim document of a job on another machine."""
    info = dict(token=uuid.uuid4().hex, host="elsewhere", node="elsewhere|boot|ns", pid=4242,
                started="2026-01-01T00:00:00+00:00", heartbeat=time.time(), world=1, mode="w-")
    info.update(over)
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": {"tensortape_claim": info}}).encode()


class LockTests:
    """The suite; a subclass gives ``location`` (a fixture) and ``plant``."""

    @pytest.fixture(autouse=True)
    def _stale(self, monkeypatch):
        monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", str(STALE_S))

    def plant(self, location: str, raw: bytes, old: bool) -> None:
        """Leave ``raw`` as the claim at ``location`` (``old``: as old as the stale
        time, so that a claim without a live owner there is stale)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def other_machine(self):
        """What runs inside runs as another job would (here: on this machine)."""
        yield

    def take(self, location):
        lock = lock_for(location)
        info = new_claim("w-", 1)
        lock.acquire(claim_doc(info), info["token"])
        return lock, info["token"]

    def test_acquire_and_check(self, location):
        lock, token = self.take(location)
        assert lock.read().token == token and lock.check() is None
        lock.release()

    def test_a_second_job_is_refused_naming_the_first(self, location):
        lock, token = self.take(location)
        with self.other_machine(), pytest.raises(Held) as held:
            self.take(location)
        assert held.value.holder.token == token and held.value.holder.pid == os.getpid()
        assert lock.read().token == token
        lock.release()

    def test_beat_keeps_the_heartbeat(self, location):
        lock, token = self.take(location)
        before = lock.read().beat
        time.sleep(0.05)
        assert lock.beat() is None
        assert lock.read().beat > before and lock.read().token == token
        lock.release()

    def test_check_and_beat_see_a_takeover(self, location):
        lock, _ = self.take(location)
        self.plant(location, other_job(), old=False)
        assert "taken over" in lock.check()
        assert "taken over" in lock.beat()
        assert lock.release() is False and lock.read() is not None    # not its to delete

    def test_a_stale_claim_taken_over_by_two_at_once_has_one_winner(self, location):
        self.plant(location, other_job(heartbeat=0.0), old=True)
        with self.other_machine():
            got = at_once(lambda i: self.take(location))
        won = [g for g in got if isinstance(g, tuple)]
        assert len(won) == 1 and any(isinstance(g, Held) for g in got), got
        lock, token = won[0]
        assert lock.read().token == token and lock.check() is None
        lock.release()

    def test_release(self, location):
        lock, _ = self.take(location)
        assert lock.release() is True and lock.read() is None
        assert lock.release() is False and lock.check() == "released"
        again, token = self.take(location)
        assert again.read().token == token
        again.release()

    def test_a_kill_between_create_and_write(self, location):
        """An empty claim is one still being written: live until it is stale."""
        self.plant(location, b"", old=False)
        with self.other_machine(), pytest.raises(Held) as held:
            self.take(location)
        assert not held.value.holder.readable                # still being written
        self.plant(location, b"", old=True)
        lock, token = self.take(location)
        assert lock.read().token == token
        lock.release()


class _OnDisk(LockTests):
    @pytest.fixture
    def location(self, tmp_path):
        return str(tmp_path / "run.zarr")

    def plant(self, location, raw, old):
        path = os.path.join(fmt.location(location), fmt.CLAIM_NAME, "zarr.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "r+b" if os.path.exists(path) else "wb") as f:   # in place, as a
            f.truncate(0)                                                 # job's own write
            f.write(raw)
        if old:
            os.utime(path, (0, 0))


class TestLocalDisk(_OnDisk):
    """A local disk: O_EXCL and flock."""


class TestSharedDiskWithoutFlock(_OnDisk):
    """A shared file system without flock, seen from two machines: pids and
    heartbeats decide alone."""

    @pytest.fixture(autouse=True)
    def _machines(self, machines):
        self.machines = machines
        machines("A")

    @contextlib.contextmanager
    def other_machine(self):
        self.machines("B")
        try:
            yield
        finally:
            self.machines("A")


class TestFileURL(_OnDisk):
    """A ``file://`` URL: its path's lock."""

    @pytest.fixture
    def location(self, tmp_path):
        return "file://" + str(tmp_path / "run.zarr")


class _AtURL(LockTests):
    def plant(self, location, raw, old):
        fs, root = fsspec.core.url_to_fs(location)
        fs.pipe_file(f"{root.rstrip('/')}/{fmt.CLAIM_NAME}/zarr.json", raw)
        fs.invalidate_cache()
        if old:
            time.sleep(STALE_S + 0.5)


class TestMemory(_AtURL):
    """``memory://``: fsspec without conditional writes (exclusive create, then a
    write, a wait and a read-back)."""

    @pytest.fixture
    def location(self):
        url = f"memory://locks-{uuid.uuid4().hex}/run.zarr"
        yield url
        fs, top = fsspec.filesystem("memory"), url.removeprefix("memory://").split("/")[0]
        if fs.exists(top):
            fs.rm(top, recursive=True)


class TestS3(_AtURL):
    """S3 (SeaweedFS): conditional PUTs and DELETEs."""

    @pytest.fixture
    def location(self, s3_server):
        return f"{s3_server}/run.zarr"


class TestOldS3Client(TestS3):
    """S3 through a client that refuses conditional writes: written without the
    condition, the read-back deciding."""

    @pytest.fixture(autouse=True)
    def _old(self, old_s3_client):
        pass
