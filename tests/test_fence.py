"""A job writes only a run it owns (SPEC: Lifecycle and guarantees).

Each test is a way a user saw a job write into a run it did not own, or lose
what it recorded, tried as the user did: rank 0's refusal not shared by the
other ranks, a job that keeps committing after another took its claim over, a
job on S3 paused between its commit's read of the claim and its counters, an
old S3 client whose heartbeat is never written, a forgotten Recorder's writer
kept in memory, a ``file://`` URL, two jobs taking one stale claim over at
once (without flock, their renames seconds apart), a takeover paused past the
stale time and passed by another (without flock), and the ranks of one job
that close a Recorder and open the next."""
import gc
import json
import os
import threading
import time
import tracemalloc
import warnings

import pytest
import torch
import zarr
from torch import nn

from conftest import at_once, snapshot
from ranks import BUILT_THEN_GO, PREAMBLE, run_ranks, start_ranks, wait_ranks
from tensortape.analysis import open_run
from tensortape.recorder import Recorder, RecorderError, StoreExistsError
from tensortape.recorder import format as fmt


def train(rec, model, steps):
    for i in steps:
        with rec.step(i):
            model(torch.full((1, 2), float(i))).sum().backward()


def results(out, world=2):
    return [(out / f"result{r}").read_text() for r in range(world)]


def tree(store) -> dict:
    """Every file under a local store, with its bytes."""
    found = {}
    for d, _, names in os.walk(store):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                found[os.path.relpath(p, store)] = f.read()
    return found


# --- rank 0's outcome is every rank's --------------------------------------------------------
def _wait_for(paths, timeout=300):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"no {paths} after {timeout} s"
        time.sleep(0.05)


def test_a_run_claimed_after_the_ranks_built_their_recorders_is_refused_on_every_rank(tmp_path):
    """Another job claims the path between the ranks' constructors and their attach:
    rank 0 is refused, and so is every other rank, before any of them writes."""
    store, go = str(tmp_path / "run.zarr"), tmp_path / "go"
    procs = start_ranks(BUILT_THEN_GO, store, tmp_path, "w-", go)
    try:
        _wait_for([tmp_path / "built0", tmp_path / "built1"])
    except AssertionError:
        wait_ranks(procs, 1)
        raise
    other = nn.Linear(2, 2)
    with Recorder(other, store, max_bytes=None, metadata={"job": "other"}, stats_every=1) as rec:
        go.touch()
        assert wait_ranks(procs) == [0, 0]
        train(rec, other, [7])
    got = results(tmp_path)
    assert all(r.startswith("StoreExistsError") and "being recorded by another job" in r
               and f"pid {os.getpid()}" in r for r in got), got
    run = open_run(store)
    assert run.ranks == [0] and run.steps().tolist() == [7]
    assert run.attrs["metadata"] == {"job": "other"} and run.status == "complete"


def test_a_format_refusal_is_every_rank_s_and_nothing_is_written(tmp_path):
    """mode="a" on a format-2 store: every rank raises rank 0's ConfigError; no rank
    adds its part to the old store."""
    store, go = str(tmp_path / "run.zarr"), tmp_path / "go"
    model = nn.Linear(2, 2)
    with Recorder(model, store, max_bytes=None, stats_every=1) as rec:
        train(rec, model, [0])
    zarr.open_group(store, mode="r+").update_attributes({"tensortape_format": 2})
    before = tree(store)
    go.touch()
    assert run_ranks(BUILT_THEN_GO, store, tmp_path, "a", go) == [0, 0]
    got = results(tmp_path)
    assert all(r.startswith("ConfigError") and "tensortape migrate" in r for r in got), got
    assert tree(store) == before


REOPEN = PREAMBLE + """
model = nn.Linear(2, 2)
result = "ok"
for mode, steps in (("w-", range(0, 3)), ("a", range(3, 5))):
    try:
        with Recorder(model, store, mode=mode, max_bytes=None, stats_every=1) as rec:
            for i in steps:
                with rec.step(i):
                    model(torch.ones(1, 2)).sum().backward()
                if rank == 0:
                    time.sleep(2.0)          # rank 0 is the slower one
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
        break
open(f"{out}/result{rank}", "w").write(result)
dist.destroy_process_group()
"""


def test_the_ranks_of_one_job_close_a_recorder_and_append_with_the_next(tmp_path):
    """A second phase of training: every rank closes its Recorder and opens another
    with mode="a"; the faster rank is not refused by its own job's claim."""
    store = str(tmp_path / "run.zarr")
    assert run_ranks(REOPEN, store, tmp_path) == [0, 0]
    assert results(tmp_path) == ["ok", "ok"]
    run = open_run(store)
    assert run.ranks == [0, 1] and run.status == "complete"
    for r in (0, 1):
        assert run.steps(rank=r).tolist() == [0, 1, 2, 3, 4]


# --- a claim lost to another job ------------------------------------------------------------
@pytest.mark.parametrize("on_error", ["warn", "raise"])
def test_a_job_that_lost_its_claim_writes_nothing_more(tmp_path, machines, monkeypatch, on_error):
    """Job A pauses past the stale time; job B takes the run over with mode="w",
    records steps 1000-1004 and completes.  A resumes: it trains on, is told once,
    and writes nothing more: B's run reads back as B recorded it."""
    monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "1")
    monkeypatch.setenv("TENSORTAPE_CLAIM_HEARTBEAT", "3600")     # A's pause: no heartbeat
    store = str(tmp_path / "run.zarr")
    machines("A")
    a_model = nn.Linear(2, 2)
    a = Recorder(a_model, store, tensors_every=1, max_bytes=None, metadata={"job": "A"},
                 on_error=on_error, stats_every=1)
    train(a, a_model, range(3))
    a.flush()
    time.sleep(1.5)
    machines("B")
    b_model = nn.Linear(2, 2)
    with Recorder(b_model, store, mode="w", tensors_every=1, max_bytes=None,
                  metadata={"job": "B"}, stats_every=1) as b:
        train(b, b_model, range(1000, 1005))
    before = tree(store)
    machines("A")
    errors = []
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        for i in range(3, 8):
            try:
                train(a, a_model, [i])
            except RecorderError as e:
                errors.append(e)
        try:
            a.close()
        except RecorderError as e:
            errors.append(e)
    told = [str(w.message) for w in told]
    lost = [t for t in told if "was lost" in t]
    if on_error == "raise":
        assert len(errors) == 1 and "claim" in str(errors[0]) and not lost, (errors, lost)
        lost = [str(errors[0])]
    else:
        assert not errors and len(lost) == 1, told
    assert "claim on" in lost[0] and "was lost" in lost[0] and "after step 2" in lost[0], lost[0]
    unstored = [t for t in told if "could not commit" in t]      # said at close, as a warning
    assert len(unstored) == 1 and "5 steps (steps 3 to 7)" in unstored[0], told
    assert tree(store) == before
    run = open_run(store)
    assert run.steps().tolist() == list(range(1000, 1005))
    assert run.status == "complete" and run.attrs["metadata"] == {"job": "B"}
    assert a_model.weight.grad is not None                 # A's training went on


# --- an S3 client that knows no conditional writes ---------------------------------------------
def _claim_object(fs, url):
    fs.invalidate_cache()
    key = f"{url.removeprefix('s3://')}/{fmt.CLAIM_NAME}/zarr.json"
    return json.loads(fs.cat(key))["attributes"]["tensortape_claim"] if fs.exists(key) else None


def test_an_old_s3_client_keeps_the_heartbeat_and_releases_the_claim(s3_server, old_s3_client,
                                                                      monkeypatch):
    import s3fs
    monkeypatch.setenv("TENSORTAPE_CLAIM_HEARTBEAT", "0.2")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
                           skip_instance_cache=True)
    url = f"{s3_server}/run.zarr"
    model = nn.Linear(2, 2)
    with Recorder(model, url, max_bytes=None, stats_every=1) as rec:
        first = _claim_object(fs, url)["heartbeat"]
        deadline, step = time.monotonic() + 60, 0
        while _claim_object(fs, url)["heartbeat"] < first + 0.5:
            assert time.monotonic() < deadline, "the heartbeat was never written"
            train(rec, model, [step])
            step += 1
            time.sleep(0.1)
    assert _claim_object(fs, url) is None                  # released at close
    assert open_run(url).status == "complete"


def test_on_s3_a_job_paused_between_its_claim_read_and_its_commit_leaves_the_new_run(
        s3_server, machines, monkeypatch):
    """Job A reads its claim at a commit, and is paused before it writes its counters
    (a stalled process, a slow network); meanwhile its claim goes stale and job B,
    on another machine, takes the run over with mode="w" and records.  A's counters
    do not land on B's run: A says once that another job holds it, and trains on."""
    from tensortape.recorder.claim._lockobject import ObjectLock
    monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "1")
    monkeypatch.setenv("TENSORTAPE_CLAIM_HEARTBEAT", "3600")     # A's pause: no heartbeat
    url = f"{s3_server}/run.zarr"
    machines("A")
    a_model = nn.Linear(2, 2)
    a = Recorder(a_model, url, max_bytes=None, metadata={"job": "A"}, stats_every=1)
    train(a, a_model, range(3))
    a.flush()
    check, paused, resume = ObjectLock.check, threading.Event(), threading.Event()

    def pausing_check(self):
        why = check(self)
        if not paused.is_set():                    # A's next commit, once its claim is read
            paused.set()
            resume.wait(300)
        return why
    monkeypatch.setattr(ObjectLock, "check", pausing_check)
    train(a, a_model, range(3, 6))
    with warnings.catch_warnings(record=True) as told:     # A's flush warns on its thread
        warnings.simplefilter("always")
        flushing = threading.Thread(target=a.flush)
        flushing.start()
        try:
            assert paused.wait(300), "A's commit never read its claim"
            time.sleep(1.5)                        # past the stale time
            machines("B")
            b_model = nn.Linear(2, 2)
            b = Recorder(b_model, url, mode="w", max_bytes=None, metadata={"job": "B"},
                         stats_every=1)
            train(b, b_model, range(1000, 1003))
            b.flush()
            before = snapshot(url)
        finally:
            machines("A")
            resume.set()
            flushing.join(300)
        train(a, a_model, [6])
        a.close()
    lost = [str(w.message) for w in told if "claim" in str(w.message)]
    assert len(lost) == 1 and "taken over by another job" in lost[0] \
        and "after step 2" in lost[0], [str(w.message) for w in told]
    assert snapshot(url) == before
    assert a_model.weight.grad is not None             # A's training went on
    b.close()
    run = open_run(url)
    assert run.steps().tolist() == [1000, 1001, 1002]
    assert run.status == "complete" and run.attrs["metadata"] == {"job": "B"}


# --- a Recorder dropped without close ------------------------------------------------------------
def _writers_alive() -> int:
    return sum(t.name == "tensortape-writer" and t.is_alive() for t in threading.enumerate())


def _settle():
    deadline = time.monotonic() + 120
    while _writers_alive():
        assert time.monotonic() < deadline, "a forgotten Recorder's writer did not end"
        time.sleep(0.05)
    gc.collect()


def test_a_forgotten_recorder_keeps_no_memory(tmp_path):
    """A notebook cell run again drops its Recorder without close(): the run is closed
    'interrupted', and the writer's table buffers go with it."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(48)])

    def forget(i):
        rec = Recorder(model, str(tmp_path / f"run{i}.zarr"), max_bytes=None, stats_every=1)
        with rec.step():
            model(torch.ones(1, 2)).sum().backward()
        rec.flush()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        with pytest.warns(ResourceWarning, match="never closed"):
            held = forget(0) - start               # what one open writer holds
        _settle()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(1, 4):
            with pytest.warns(ResourceWarning, match="never closed"):
                forget(i)
            _settle()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held > 4 << 20, held                    # the table buffers are what is measured
    assert grown < held / 2, (grown, held)
    for i in range(4):
        assert open_run(str(tmp_path / f"run{i}.zarr")).status == "interrupted"


# --- fsspec URLs ---------------------------------------------------------------------------------
def test_a_file_url_records_like_its_path(tmp_path):
    path = str(tmp_path / "run.zarr")
    model = nn.Linear(2, 2)
    with Recorder(model, "file://" + path, tensors_every=1, stats_every=1) as rec:
        train(rec, model, range(2))
    run = open_run(path)
    assert run.steps().tolist() == [0, 1] and run.status == "complete"
    assert sorted(os.listdir(path)) == ["rank0", "zarr.json"]      # the claim released
    with pytest.raises(StoreExistsError, match="already exists"):
        Recorder(model, "file://" + path, stats_every=1)


def test_two_jobs_taking_one_stale_claim_over_at_once_one_wins(monkeypatch):
    """On an fsspec store without conditional writes (``memory://``, whose writes are
    made slow here as a remote file system's are), two jobs take over a claim whose
    owner is gone at the same moment: one records, the other is refused."""
    from fsspec.implementations.memory import MemoryFileSystem
    pipe = MemoryFileSystem.pipe_file

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return pipe(self, *args, **kwargs)
    monkeypatch.setattr(MemoryFileSystem, "pipe_file", slow)
    monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "1")
    for trial in range(3):
        url = f"memory://fence-race-{os.getpid()}-{trial}/run.zarr"
        gone = dict(token="t" * 32, host="elsewhere", node="elsewhere|boot|ns", pid=4242,
                    started="2026-01-01T00:00:00+00:00", heartbeat=0.0, world=1, mode="w")
        MemoryFileSystem().pipe_file(f"{url.removeprefix('memory://')}/{fmt.CLAIM_NAME}/zarr.json",
                                     json.dumps({"zarr_format": 3, "node_type": "group",
                                                 "attributes": {"tensortape_claim": gone}}).encode())
        time.sleep(1.5)                            # its owner is gone: no heartbeat since
        recs = [Recorder(nn.Linear(2, 2), url, mode="w", max_bytes=None, stats_every=1) for _ in range(2)]
        got = at_once(lambda i: recs[i].attach())
        won = [g for g in got if isinstance(g, Recorder)]
        assert len(won) == 1, got
        assert any(isinstance(g, StoreExistsError) for g in got), got
        won[0].close()
        MemoryFileSystem().rm(url.removeprefix("memory://"), recursive=True)


# --- a shared disk without flock: two takeovers further apart than any settle ------------------
def claim_of_a_gone_job(store):
    """The lock file of ``store``, holding the claim of a job of machine A that is gone
    (no heartbeat since 1970); its path."""
    lock = store / fmt.CLAIM_NAME / "zarr.json"
    lock.parent.mkdir(parents=True)
    gone = dict(token="t" * 32, host="elsewhere", node="machine-A|boot|ns", pid=4242,
                started="2026-01-01T00:00:00+00:00", heartbeat=0.0, world=1, mode="w")
    lock.write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                "attributes": {"tensortape_claim": gone}}))
    os.utime(lock, (0, 0))
    return lock


def test_two_takeovers_without_flock_renamed_seconds_apart_have_one_winner(tmp_path, machines,
                                                                           monkeypatch):
    """A shared disk without flock: two jobs on machine B take over the claim of a job
    of machine A that is gone, at once; the first to rename its claim into place is
    held up 2 s (a slow file server) before the rename lands.  One records, the
    other is refused naming a job of machine B, and the claim is the winner's."""
    monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "1")
    store = tmp_path / "run.zarr"
    lock = claim_of_a_gone_job(store)
    replace, held_up = os.replace, []

    def slow_replace(src, dst, *args, **kwargs):
        if os.fspath(dst) == str(lock) and not held_up:
            held_up.append(src)
            time.sleep(2.0)
        return replace(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", slow_replace)
    machines("B")
    recs = [Recorder(nn.Linear(2, 2), str(store), mode="w", max_bytes=None, stats_every=1)
            for _ in range(2)]
    got = at_once(lambda i: recs[i].attach())
    won = [g for g in got if isinstance(g, Recorder)]
    try:
        lost = [g for g in got if isinstance(g, StoreExistsError)]
        assert len(won) == 1 and len(lost) == 1, got
        assert "host" in str(lost[0]) and "elsewhere" not in str(lost[0]), lost[0]
        claim = json.loads(lock.read_text())["attributes"]["tensortape_claim"]
        assert claim["node"] == "machine-B|boot|ns"
    finally:
        for r in won:
            r.close()
    assert open_run(str(store)).status == "complete"
    assert fmt.CLAIM_NAME not in os.listdir(store)             # the claim released whole


def test_a_takeover_paused_past_the_stale_time_loses_to_the_job_that_passed_it(
        tmp_path, machines, monkeypatch):
    """A shared disk without flock: job B takes over the claim of a job of machine A
    that is gone, and is paused after it made its marker, before its rename lands,
    past the stale time.  Job C, on machine C, passes B's marker by, takes the claim
    over and records.  When B's rename lands, B is refused (naming C's job), and C
    records on: its run and its claim stay its own, C's commit in the moment B's claim
    is in the file (before B puts C's back) included."""
    from tensortape.recorder.claim._lockfile import LocalLock
    monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "1")
    store = tmp_path / "run.zarr"
    lock = claim_of_a_gone_job(store)
    replace, paused, resume = os.replace, threading.Event(), threading.Event()

    def pausing_replace(src, dst, *args, **kwargs):
        if os.fspath(dst) == str(lock) and not paused.is_set():    # B's rename, held up
            paused.set()
            resume.wait(300)
        return replace(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "replace", pausing_replace)
    passed = LocalLock._passed

    def c_commits_first(self, *args):     # B's rename has landed; C's claim is not back yet
        if threading.current_thread().name == "B":
            c.flush()
        return passed(self, *args)
    monkeypatch.setattr(LocalLock, "_passed", c_commits_first)
    machines("B")
    b, got = Recorder(nn.Linear(2, 2), str(store), mode="w", max_bytes=None, stats_every=1), []

    def attach_b():
        try:
            got.append(b.attach())
        except StoreExistsError as e:
            got.append(e)
    b_attaching = threading.Thread(target=attach_b, name="B")
    b_attaching.start()
    c = None
    try:
        assert paused.wait(300), "B never renamed its claim into place"
        time.sleep(1.5)                               # B's marker: past the stale time
        machines("C")
        c_model = nn.Linear(2, 2)
        c = Recorder(c_model, str(store), mode="w", max_bytes=None, stats_every=1,
                     metadata={"job": "C"})
        train(c, c_model, range(3))        # committed by ``c_commits_first``
    finally:
        resume.set()
        b_attaching.join(300)
    try:
        assert len(got) == 1 and isinstance(got[0], StoreExistsError), got
        assert "this process (another Recorder)" in str(got[0]), got[0]     # C's job, named
        claim = json.loads(lock.read_text())["attributes"]["tensortape_claim"]
        assert claim["node"] == "machine-C|boot|ns"     # C's, not B's
        train(c, c_model, range(3, 6))                # a lost claim would warn: an error here
        c.close()
    finally:
        for r in [c, *got]:
            if isinstance(r, Recorder):
                r.close()
    run = open_run(str(store))
    assert run.steps().tolist() == list(range(6)) and run.status == "complete"
    assert run.attrs["metadata"] == {"job": "C"}
    assert fmt.CLAIM_NAME not in os.listdir(store)             # the claim released whole
