"""One writer owns a run: a job claims its store when it opens it (``tensortape.lock``);
a second job is refused while the first lives, and takes over when it is gone."""
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder, StoreExistsError
from tensortape.recorder import format as fmt
from tensortape.recorder.claim._claim import Claim
from tensortape.recorder.claim._holder import this_node
from conftest import InplaceMLP, at_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20

# A job that waits for its orders on stdin (so that torch is imported before the
# race starts), then for a "go" file (so that two jobs start within a millisecond).
JOB = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from torch import nn
    from tensortape.recorder import Recorder, StoreExistsError
    print("READY", flush=True)
    for line in sys.stdin:
        store, mode, steps, job, hold, go, env = line.split(maxsplit=6)
        os.environ.update(json.loads(env))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        print("WAITING", flush=True)
        while not os.path.exists(go):
            time.sleep(0.0005)
        try:
            with Recorder(model, store, layers=["0"], mode=mode, metadata={"job": int(job)}, stats_every=1) as rec:
                began = time.time()
                for s in range(int(steps)):
                    with rec.step():
                        model(torch.full((3, 4), s + 100.0 * int(job))).sum().backward()
                    print("RECORDING", s, flush=True)
                    time.sleep(float(hold))
            print("OK", began, time.time(), flush=True)
        except StoreExistsError as e:
            print("REFUSED", str(e).replace(chr(10), " | "), flush=True)
        except BaseException as e:
            print("ERROR", type(e).__name__, str(e).replace(chr(10), " | "), flush=True)
""")


class Job:
    """A python process that records when told to (started: ``ready()`` waits for it)."""

    def __init__(self, log):
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, "-c", JOB], cwd=ROOT, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, env={**os.environ, "PYTHONPATH": ROOT})
        self.lines: queue.Queue = queue.Queue()
        self.orders = 0                            # orders given and not yet answered
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self) -> "Job":
        assert self.readline() == "READY"
        return self

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    @property
    def pid(self) -> int:
        return self.p.pid

    def readline(self, timeout=120) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"job {self.pid} said nothing for {timeout} s") from None
        assert line is not None, f"job {self.pid} ended (exit {self.p.poll()}): see {self.log.name}"
        return line

    def order(self, store, mode, job, go, steps=STEPS, hold=0.01):
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}   # the S3 server's
        self.p.stdin.write(f"{store} {mode} {steps} {job} {hold} {go} {json.dumps(env)}\n")
        self.p.stdin.flush()
        self.orders += 1
        assert self.readline() == "WAITING"        # for the go file

    def outcome(self) -> str:
        """Skip the RECORDING lines; the job's last word."""
        while True:
            line = self.readline()
            if not line.startswith("RECORDING"):
                self.orders -= 1
                return line

    @property
    def idle(self) -> bool:
        """Alive, every order answered and every line read: fit for the next test."""
        return self.p.poll() is None and self.orders == 0 and self.lines.empty()

    def stop(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        for f in (self.p.stdin, self.p.stdout, self.log):
            f.close()

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        self.p.wait()


def expected_means(job: int, steps=STEPS) -> np.ndarray:
    """The mean of layer "0"'s activation that ``job`` records at each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        return np.array([model[0](torch.full((3, 4), s + 100.0 * job)).double().mean().item()
                         for s in range(steps)])


def assert_whole_run_of(store, job, steps=STEPS):
    run = open_run(store)
    assert run.metadata["job"] == job and run.status == "complete"
    assert run.steps().tolist() == list(range(steps))
    means = run.stats("activations", layers="0")["mean"].values[:, 0]
    np.testing.assert_allclose(means, expected_means(job, steps), rtol=1e-5)


def claim_of(store):
    return os.path.join(store, fmt.CLAIM_NAME, "zarr.json")


def claim_doc(store) -> dict:
    with open(claim_of(store)) as f:
        return json.load(f)


def race(jobs, stores, mode, tmp_path, tag):
    """Start both jobs together on each store; each store's outcomes."""
    results = []
    for i, store in enumerate(stores):
        go = str(tmp_path / f"go-{tag}-{i}")
        for k, job in enumerate(jobs):
            job.order(store, mode, k + 1, go)      # both wait on the go file
        open(go, "w").close()
        results.append([job.outcome() for job in jobs])
    return results


def check_race(results, stores, mode):
    for store, outs in zip(stores, results):
        kinds = sorted(o.split()[0] for o in outs)
        if kinds == ["OK", "OK"]:                  # one after the other ("w"): never overlapping
            assert mode == "w", ("two 'w-' jobs both recorded", store, outs)
            (b1, e1), (b2, e2) = ([float(x) for x in o.split()[1:3]] for o in outs)
            assert e1 < b2 or e2 < b1, ("both recorded at once", store, outs)
            assert_whole_run_of(store, 1 if e1 > e2 else 2)
            continue
        assert kinds == ["OK", "REFUSED"], (store, outs)
        winner = 1 + [o.split()[0] for o in outs].index("OK")
        loser = outs[2 - winner]
        assert "being recorded by another job" in loser or "already exists" in loser, loser
        assert_whole_run_of(store, winner)
        assert not os.path.exists(os.path.join(store, fmt.CLAIM_NAME)) if "://" not in store \
            else True


def start_jobs(where, n=2) -> list:
    """``n`` jobs, started together."""
    return [j.ready() for j in [Job(where / f"job{i + 1}.log") for i in range(n)]]


@pytest.fixture(scope="module")
def _job_pool(tmp_path_factory):
    """Two jobs kept across this file's tests (each start imports torch): one that a test
    killed, or left busy, is replaced before the next test.  Each order carries the
    environment's S3 server."""
    pool = start_jobs(tmp_path_factory.mktemp("jobs"))
    yield pool
    for j in pool:
        j.stop()


@pytest.fixture
def jobs(_job_pool, tmp_path):
    spent = [i for i, j in enumerate(_job_pool) if not j.idle]
    for i in spent:
        _job_pool[i].stop()
    for i, j in zip(spent, start_jobs(tmp_path, len(spent))):
        _job_pool[i] = j
    return list(_job_pool)


@pytest.mark.parametrize("mode", ["w-", "w"])
def test_two_jobs_started_together_one_records_the_other_is_refused(tmp_path, jobs, mode):
    stores = [str(tmp_path / f"run{i}.zarr") for i in range(10)]
    if mode == "w":                                # "w" over a finished run: both may overwrite it
        for s in stores:
            model = InplaceMLP()
            with Recorder(model, s, layers="fc1", metadata={"job": 0}, tensors_every=1, stats_every=1) as rec:
                with rec.step():
                    model(torch.randn(2, 8)).sum().backward()
    results = race(jobs, stores, mode, tmp_path, mode)
    check_race(results, stores, mode)


def test_mode_w_while_a_live_job_records_is_refused_naming_it(tmp_path, jobs):
    store = str(tmp_path / "run.zarr")
    a = jobs[0]
    go = str(tmp_path / "go")
    open(go, "w").close()
    a.order(store, "w-", 1, go, steps=STEPS, hold=0.15)
    assert a.readline().startswith("RECORDING")
    for mode in ("w", "w-", "a"):
        model = InplaceMLP()
        with pytest.raises(StoreExistsError) as e:
            Recorder(model, store, mode=mode, tensors_every=1, stats_every=1)
        msg = str(e.value)
        assert "\n" not in msg and f"pid {a.pid}" in msg and socket.gethostname() in msg, msg
        assert "being recorded by another job" in msg and "started " in msg, msg
    # refused at attach too (the claim is taken there, atomically), e.g. by a job whose
    # look found the path free just before the other claimed it
    store2 = str(tmp_path / "run2.zarr")
    late = Recorder(InplaceMLP(), store2, mode="w", tensors_every=1, stats_every=1)
    b = jobs[1]
    b.order(store2, "w-", 2, go, steps=STEPS, hold=0.15)
    assert b.readline().startswith("RECORDING")
    with pytest.raises(StoreExistsError, match=f"pid {b.pid}"):
        late.attach()
    assert a.outcome().startswith("OK") and b.outcome().startswith("OK")
    assert_whole_run_of(store, 1)                  # the running job's data is intact
    assert_whole_run_of(store2, 2)
    assert sorted(os.listdir(store)) == ["rank0", "zarr.json"]      # released at close
    model = InplaceMLP()
    with Recorder(model, store, layers="fc1", mode="w", tensors_every=1, stats_every=1) as rec:   # now "w" may
        with rec.step():
            model(torch.randn(2, 8)).sum().backward()
    assert open_run(store).steps().tolist() == [0] and open_run(store).status == "complete"


@pytest.mark.parametrize("mode", ["w", "a"])
def test_a_killed_owner_s_claim_is_taken_over(tmp_path, jobs, mode):
    store = str(tmp_path / "run.zarr")
    a = jobs[0]
    go = str(tmp_path / "go")
    open(go, "w").close()
    a.order(store, "w-", 1, go, steps=1000, hold=0.05)
    for _ in range(3):
        assert a.readline().startswith("RECORDING")
    a.kill()
    assert os.path.exists(claim_of(store))         # the dead job's claim is left behind
    assert claim_doc(store)["attributes"]["tensortape_claim"]["pid"] == a.pid
    with pytest.raises(StoreExistsError, match="already exists"):
        Recorder(InplaceMLP(), store, mode="w-", tensors_every=1, stats_every=1)   # "w-" never touches an existing run
    model = InplaceMLP()
    with Recorder(model, store, layers="fc1", mode=mode, tensors_every=1, stats_every=1) as rec:
        for _ in range(2):
            with rec.step():
                model(torch.randn(2, 8)).sum().backward()
    run = open_run(store)
    assert run.status == "complete" and "fc1" in run.layers
    if mode == "w":
        assert run.steps().tolist() == [0, 1]
    assert sorted(os.listdir(store)) == ["rank0", "zarr.json"]


def test_claim_api(tmp_path):
    store = str(tmp_path / "run.zarr")
    claim = Claim.acquire(store, "w-")
    info = claim_doc(store)["attributes"]["tensortape_claim"]
    assert info["pid"] == os.getpid() and info["token"] == claim.token and claim.held
    with pytest.raises(StoreExistsError, match="this process"):
        Claim.acquire(store, "w")
    assert claim.confirm() is True and claim.confirm(read=True) is True
    other = Claim.shared(store, claim.token)                  # other ranks share rank 0's
    assert not other.held and other.confirm(read=True) and not other.release()
    zarr.open_group(store, mode="a", attributes={fmt.CLAIM_TOKEN: claim.token})   # rank 0's commit
    assert claim.release() is True and not os.path.exists(os.path.join(store, fmt.CLAIM_NAME))
    assert claim.release() is False and claim.confirm() is False
    assert other.confirm(read=True)                 # released at rank 0's close: not lost
    zarr.open_group(store, mode="a").update_attributes({fmt.CLAIM_TOKEN: "someone-else"})
    assert other.confirm(read=True) is False and "since closed" in other.lost   # another job's
    # a claim taken over (here: rewritten by hand) is lost, and confirm() says so
    claim = Claim.acquire(store, "w-")
    other = Claim.shared(store, claim.token)
    doc = claim_doc(store)
    doc["attributes"]["tensortape_claim"]["token"] = "someone-else"
    with open(claim_of(store), "w") as f:
        json.dump(doc, f)
    assert claim.confirm() is True                  # within its lease: the store is not asked
    assert claim.confirm(read=True) is False and "taken over" in claim.lost
    assert other.confirm(read=True) is False and "taken over" in other.lost
    assert claim.release() is False and os.path.exists(claim_of(store))   # not ours to delete


def claims_at_once(location, n=6) -> list:
    """``n`` threads claim ``location`` at once: what each got (a Claim or the error)."""
    return at_once(lambda i: Claim.acquire(location, "w-"), n)


def check_one_claim(got):
    won = [g for g in got if isinstance(g, Claim)]
    assert len(won) == 1, got
    assert all(isinstance(g, StoreExistsError) and ("this process" in str(g) or
                                                     "still being written" in str(g))
               for g in got if g is not won[0]), got
    assert won[0].release()


def test_claims_taken_at_once_one_wins(tmp_path):
    for i in range(10):
        check_one_claim(claims_at_once(str(tmp_path / f"run{i}.zarr")))


def fake_claim(store, **over):
    """A claim left at ``store`` by a job described by ``over``."""
    info = dict(token="t" * 32, host="elsewhere", node="elsewhere|boot|ns", pid=4242,
                pid_started=None, started="2026-01-01T00:00:00+00:00", heartbeat=time.time(),
                world=1, mode="w-")
    info.update(over)
    os.makedirs(os.path.join(store, fmt.CLAIM_NAME), exist_ok=True)
    with open(claim_of(store), "w") as f:
        json.dump({"zarr_format": 3, "node_type": "group",
                   "attributes": {"tensortape_claim": info}}, f)
    mtime = over.get("heartbeat", time.time())
    os.utime(claim_of(store), (mtime, mtime))


def test_who_is_gone(tmp_path, monkeypatch):
    dead = subprocess.Popen(["true"])
    dead.wait()
    # the same machine: the pid decides at once
    fake_claim(str(tmp_path / "a"), node=this_node(), host=socket.gethostname(), pid=dead.pid)
    Claim.acquire(str(tmp_path / "a"), "w-").release()
    fake_claim(str(tmp_path / "b"), node=this_node(), pid=os.getppid(), heartbeat=0)
    with pytest.raises(StoreExistsError, match=f"pid {os.getppid()}"):
        Claim.acquire(str(tmp_path / "b"), "w")          # live, however old its heartbeat
    # another machine: its heartbeat decides
    fake_claim(str(tmp_path / "c"), heartbeat=time.time() - 10)
    with pytest.raises(StoreExistsError, match="host elsewhere.*last heartbeat 1\\d s ago"):
        Claim.acquire(str(tmp_path / "c"), "w")
    monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "5")
    Claim.acquire(str(tmp_path / "c"), "w").release()  # 10 s without one: gone
    # a claim still being written (empty) is live until it is stale
    os.makedirs(tmp_path / "d" / fmt.CLAIM_NAME)
    open(claim_of(str(tmp_path / "d")), "w").close()
    with pytest.raises(StoreExistsError, match="still being written"):
        Claim.acquire(str(tmp_path / "d"), "w-")
    os.utime(claim_of(str(tmp_path / "d")), (time.time() - 60,) * 2)
    Claim.acquire(str(tmp_path / "d"), "w-").release()


def test_a_stale_claim_without_a_claim_of_ones_own_is_a_store_error(tmp_path):
    """open_root without a claim (tools) never lets zarr's raw FileExistsError out."""
    from tensortape.recorder.claim._root import open_root
    store = str(tmp_path / "run.zarr")
    fake_claim(store, heartbeat=0)                        # a stale claim: the store is "empty"
    with pytest.raises(StoreExistsError):
        open_root(store, "w-", attributes={})


def test_on_s3_a_live_job_is_refused_and_a_killed_one_taken_over(s3_server, jobs, tmp_path):
    import s3fs
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
                           skip_instance_cache=True)
    for i in range(5):                             # the conditional PUT: one of many wins
        check_one_claim(claims_at_once(f"{s3_server}/claims{i}.zarr"))
    stores = [f"{s3_server}/race{i}.zarr" for i in range(3)]
    check_race(race(jobs, stores, "w-", tmp_path, "s3"), stores, "w-")
    for s in stores:
        assert not fs.exists(f"{s.removeprefix('s3://')}/{fmt.CLAIM_NAME}/zarr.json")
    url = f"{s3_server}/run.zarr"
    a = jobs[0]
    go = str(tmp_path / "go")
    open(go, "w").close()
    a.order(url, "w-", 1, go, steps=1000, hold=0.05)
    for _ in range(3):
        assert a.readline().startswith("RECORDING")
    for mode in ("w", "w-", "a"):
        with pytest.raises(StoreExistsError, match=f"being recorded by another job.*pid {a.pid}"):
            Recorder(InplaceMLP(), url, mode=mode, tensors_every=1, stats_every=1)
    a.kill()
    model = InplaceMLP()
    with Recorder(model, url, layers="fc1", mode="w", tensors_every=1, stats_every=1) as rec:
        for _ in range(2):
            with rec.step():
                model(torch.randn(2, 8)).sum().backward()
    assert open_run(url).steps().tolist() == [0, 1]
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"))) == \
        ["rank0", "zarr.json"]
