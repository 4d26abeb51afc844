"""``RankLogTests``: what a rank commits, and whether it may still commit, asked
the same way of every kind of store (local, ``memory://``, S3), through the
public API: a commit after the claim was lost writes nothing, and the steps
it leaves uncommitted are counted in the Recorder's ``dropped`` and named
(rank 1's too, once its crashed rank 0's claim is taken over, and once the job
that took it over has closed the run), a fault is
written again from the last commit, rank 0's refusal is every rank's under gloo
(2 and 4 ranks; ``memory://`` is one process's, so not there), and
``mode="a"`` resumes a run."""
import json
import time
import uuid
import warnings

import fsspec
import numpy as np
import pytest
import torch
from torch import nn

from conftest import snapshot
from faultstore import faulty
from ranks import BUILT_THEN_GO, PREAMBLE, run_ranks, start_ranks, wait_ranks
from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from tensortape.recorder import format as fmt


def train(rec, model, steps):
    for i in steps:
        with rec.step(i):
            model(torch.full((2, 3), float(i))).sum().backward()


def take_over(location) -> None:
    """Another job's claim written over this one's, as a takeover writes it."""
    fs, root = fsspec.core.url_to_fs(location)
    info = dict(token=uuid.uuid4().hex, host="elsewhere", node="elsewhere|boot|ns", pid=4242,
                started="2026-01-01T00:00:00+00:00", heartbeat=time.time(), world=1, mode="w")
    raw = json.dumps({"zarr_format": 3, "node_type": "group",
                      "attributes": {"tensortape_claim": info}}).encode()
    path = f"{root.rstrip('/')}/{fmt.CLAIM_NAME}/zarr.json"
    if fmt.is_url(location):
        fs.pipe_file(path, raw)
    else:
        with open(path, "r+b") as f:          # in place, as a takeover under flock writes it
            f.truncate(0)
            f.write(raw)
    fs.invalidate_cache()



# Both ranks record steps 0-2 and commit; then rank 0 crashes (its claim's pid gone), and
# rank 1, once the file named by the third argument is there, records steps 3-5, flushes
# and closes: the warnings it was given are its "result1".
RANK_0_CRASHES = PREAMBLE + """
import warnings
go = sys.argv[3]
model = nn.Linear(3, 2)
rec = Recorder(model, store, max_bytes=None, stats_every=1)
def train(steps):
    for i in steps:
        with rec.step(i):
            model(torch.full((2, 3), float(i))).sum().backward()
train(range(3))
rec.flush()
dist.barrier()
if rank == 0:
    os._exit(9)
while not os.path.exists(go):
    time.sleep(0.01)
with warnings.catch_warnings(record=True) as told:
    warnings.simplefilter("always")
    train(range(3, 6))
    rec.flush()
    rec.close()
open(f"{out}/result{rank}", "w").write(json.dumps([str(w.message) for w in told]))
os._exit(0)
"""


class RankLogTests:
    """The suite; a subclass gives ``location`` (a fixture: a new store's)."""

    shared = True                  # the store is seen by other processes

    def test_a_commit_after_the_claim_was_lost_writes_nothing(self, location, monkeypatch):
        monkeypatch.setenv("TENSORTAPE_CLAIM_STALE", "1")
        monkeypatch.setenv("TENSORTAPE_CLAIM_HEARTBEAT", "3600")    # the job pauses: no beat
        model = nn.Linear(3, 2)
        rec = Recorder(model, location, tensors_every=1, max_bytes=None, stats_every=1)
        train(rec, model, range(3))
        rec.flush()
        time.sleep(1.2)                      # past the stale time: another job takes it over
        take_over(location)
        before, dropped = snapshot(location), rec.dropped
        seen = []                            # what plain hooks see of the steps not stored

        def seen_forward(module, args, out):
            seen.append("activation")
            out.register_hook(lambda g: seen.append("gradient"))
        hook = model.register_forward_hook(seen_forward)
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            train(rec, model, range(3, 6))
            rec.flush()
            rec.close()
        hook.remove()
        told = [str(w.message) for w in told]
        lost = [t for t in told if "was lost" in t]
        assert len(lost) == 1 and "after step 2" in lost[0], told
        unstored = [t for t in told if "could not commit" in t]
        assert len(unstored) == 1 and "3 steps (steps 3 to 5)" in unstored[0] \
            and f"their {len(seen)} captures" in unstored[0], told
        assert len(seen) == 6 and rec.dropped == dropped + len(seen)
        assert snapshot(location) == before
        run = open_run(location)
        assert run.steps().tolist() == [0, 1, 2] and run.status == "recording"

    def test_a_fault_is_written_again_from_the_last_commit(self, location):
        model = nn.Linear(3, 2)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            with Recorder(model, location, tensors_every=None, max_bytes=None,
                          flush_interval=60.0, stats_every=1) as rec:
                train(rec, model, range(2))
                rec.flush()
                with faulty(fail=1.0, after=0.0) as faults:
                    train(rec, model, range(2, 5))
                    rec.flush()              # a commit that fails
                assert faults.failures
                train(rec, model, range(5, 7))
        assert any("cannot be written" in str(w.message) for w in told), \
            [str(w.message) for w in told]
        run = open_run(location)
        assert run.steps().tolist() == list(range(7)) and run.status == "complete"
        means = run.stats(kind="activations")["mean"].sel(layer="(root)").values
        with torch.no_grad():
            want = [model(torch.full((2, 3), float(i))).double().mean().item() for i in range(7)]
        np.testing.assert_allclose(means, want, rtol=1e-6)

    def test_mode_a_resumes_the_run(self, location):
        model = nn.Linear(3, 2)
        with Recorder(model, location, max_bytes=None, stats_every=1) as rec:
            train(rec, model, range(3))
        with Recorder(model, location, mode="a", max_bytes=None, stats_every=1) as rec:
            train(rec, model, range(2, 5))          # step 2 recorded again
        run = open_run(location)
        assert run.steps().tolist() == [0, 1, 2, 3, 4] and run.status == "complete"
        assert run.state().recording == 1

    @pytest.mark.parametrize("world", [2, 4])
    def test_rank_0_s_refusal_is_every_rank_s_and_no_rank_writes(self, location, tmp_path,
                                                                   world, monkeypatch):
        if not self.shared:
            pytest.skip("a memory:// store is one process's")
        monkeypatch.setenv("TENSORTAPE_CLAIM_HEARTBEAT", "3600")   # the owner's claim, unchanged
        model = nn.Linear(3, 2)
        with Recorder(model, location, max_bytes=None, stats_every=1) as rec:     # another job records there
            train(rec, model, [0])
            rec.flush()
            before = snapshot(location)
            go = tmp_path / "go"
            go.touch()
            assert run_ranks(BUILT_THEN_GO, location, tmp_path, "w", go,
                             world=world) == [0] * world
            assert snapshot(location) == before
        got = [(tmp_path / f"result{r}").read_text() for r in range(world)]
        assert all(g.startswith("StoreExistsError") and "being recorded by another job" in g
                   for g in got), got
        assert open_run(location).ranks == [0]

    @pytest.mark.parametrize("b_closes", [False, True])
    def test_a_rank_whose_rank_0_crashed_writes_nothing_once_another_job_took_over(
            self, location, tmp_path, monkeypatch, b_closes):
        """Rank 0 crashes; on its machine its claim is taken over at once (its pid is
        gone), by a job with mode="w", which records (and, with ``b_closes``, closes
        the run: its claim gone, which is not rank 0's close, as the run's root names
        another job's claim).  Rank 1 trains on and commits: it writes nothing into
        the other job's run, says once that its claim was lost, and at close which
        steps it could not commit."""
        if not self.shared:
            pytest.skip("a memory:// store is one process's")
        monkeypatch.setenv("TENSORTAPE_CLAIM_HEARTBEAT", "3600")    # no heartbeat rewrites
        before, after, told = rank_1_after_a_takeover(location, tmp_path, b_closes)
        assert after == before
        lost = [t for t in told if "was lost" in t]
        why = "has since closed the run" if b_closes else "taken over by another job"
        assert len(lost) == 1 and why in lost[0] and "after step 2" in lost[0], told
        assert len([t for t in told if "could not commit 3 steps (steps 3 to 5)" in t]) == 1, told
        run = open_run(location)
        assert run.ranks == [0] and run.steps().tolist() == [1000, 1001, 1002]
        assert run.attrs["metadata"] == {"job": "B"} and run.status == "complete"


def rank_1_after_a_takeover(location, tmp_path, b_closes: bool):
    """Two ranks record; rank 0 crashes; job B takes the run over (mode="w") and
    records (and closes it first, with ``b_closes``); then rank 1 trains and commits.
    The store before and after rank 1's commit, and what rank 1 was told."""
    go, rec = tmp_path / "go", None
    procs = start_ranks(RANK_0_CRASHES, location, tmp_path, go)
    try:
        assert procs[0].wait(timeout=300) == 9
        model = nn.Linear(3, 2)
        rec = Recorder(model, location, mode="w", max_bytes=None, stats_every=1,
                       metadata={"job": "B"})
        train(rec, model, range(1000, 1003))
        rec.flush()
        if b_closes:
            rec.close()
        before = snapshot(location)
        go.touch()
        assert procs[1].wait(timeout=300) == 0
        after = snapshot(location)
    finally:
        if rec is not None:
            rec.close()
        wait_ranks(procs, 1)
    return before, after, json.loads((tmp_path / "result1").read_text())


class TestLocal(RankLogTests):
    @pytest.fixture
    def location(self, tmp_path):
        return str(tmp_path / "run.zarr")


class TestMemory(RankLogTests):
    shared = False

    @pytest.fixture
    def location(self):
        name = f"ranklog-{uuid.uuid4().hex}"
        yield f"memory://{name}/run.zarr"
        fs = fsspec.filesystem("memory")
        if fs.exists(name):                   # a skipped test made nothing
            fs.rm(name, recursive=True)


class TestS3(RankLogTests):
    @pytest.fixture
    def location(self, s3_server):
        return f"{s3_server}/run.zarr"
