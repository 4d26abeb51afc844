"""Reading a run while it is recorded: what `watch` counts, what a dask cluster
serves for a store that grew, and reads that fail for a moment."""

import os
import shutil

import dask
import pytest
import torch
import zarr
from torch import nn

from tensortape.analysis import _source, open_run
from tensortape.analysis._watch import render, snapshots
from tensortape.recorder import Recorder
from tensortape.recorder import format as fmt
from tensortape.recorder.errors import StoreFormatError, TensortapeWarning


def _steps(rec, model, steps, scale=1.0):
    for i in steps:
        with rec.step(i):
            model(torch.randn(2, 4) * scale).sum().backward()


def _local(path):
    """The run's statistics as a fresh read computes them here, without a cluster."""
    with dask.config.set(scheduler="sync"):
        return open_run(path).stats().compute()


def test_watch_counts_every_rank_s_events_past_those_kept(tmp_path):
    store = str(tmp_path / "run.zarr")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(10)))
    steps = 50
    with Recorder(model, store, tensors_every=None, stats_every=1) as rec:
        for i in range(steps):
            with rec.step(i):       # NaN everywhere, forward and backward: 22 events a step
                model(torch.full((1, 2), float("nan"))).pow(2).sum().backward()
    # a second rank with the same events (its group copied)
    shutil.copytree(os.path.join(store, "rank0"), os.path.join(store, "rank1"))
    per_rank = steps * 11 * 2                  # (root) and 10 layers, activations and gradients
    assert per_rank > fmt.MAX_EVENTS and len(open_run(store).events_of(0)) == fmt.MAX_EVENTS
    (view,) = snapshots(store, interval=0)
    assert view["events"] == 2 * per_rank
    assert render(view)[-1].startswith(f"non-finite so far: {2 * per_rank} events in 22 ")


@pytest.fixture
def client():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as c:
        yield c


def test_a_store_read_again_on_a_cluster_gives_its_new_values(tmp_path, client):
    """Results a cluster holds (``persist``) are never served for a later read of
    a store whose content changed: a live run that grew, or a run recorded again
    at the same path with as many steps."""
    path = str(tmp_path / "run.zarr")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with Recorder(model, path, tensors_every=None, flush_interval=3600, stats_every=1) as rec:
        _steps(rec, model, range(3))
        rec.flush()
        first = open_run(path).stats().persist()      # held on the cluster
        assert first.step.values.tolist() == [0, 1, 2]
        _steps(rec, model, range(3, 6), scale=10)
        rec.flush()
        grown = open_run(path).stats().persist()
        assert grown.step.values.tolist() == list(range(6))
        assert grown.compute().identical(_local(path))
    with Recorder(model, path, tensors_every=None, flush_interval=3600, mode="w", stats_every=1) as rec:
        _steps(rec, model, range(6), scale=100)
        rec.flush()
        again = open_run(path).stats().persist()
        fresh = _local(path)
        assert not fresh.identical(grown.compute())   # other values in arrays of one shape
        assert again.compute().identical(fresh)


def _failing(monkeypatch, times):
    """The store's reads of statistics chunks fail ``times`` times (all: None), then
    succeed; the failures so far are counted in the list returned."""
    real, failed = zarr.storage.LocalStore.get, []

    async def get(self, key, prototype=None, byte_range=None):
        if "/stats/c/" in key and (times is None or len(failed) < times):
            failed.append(key)
            raise OSError(f"{key} is being replaced")
        return await real(self, key, prototype, byte_range)
    monkeypatch.setattr(zarr.storage.LocalStore, "get", get)
    return failed


def _record(path, steps=3):
    """A live run of ``steps`` committed steps: its Recorder, open, and its model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    rec = Recorder(model, path, tensors_every=None, stats_every=1)
    _steps(rec, model, range(steps))
    rec.flush()
    return rec, model


def test_a_read_that_fails_for_a_while_is_made_again_for_a_bounded_time(tmp_path, monkeypatch):
    path = str(tmp_path / "run.zarr")
    rec = _record(path)[0]                                     # live: a shard may be replaced
    try:
        want = _local(path)
        slept = []
        monkeypatch.setattr(_source.time, "sleep", slept.append)   # the pauses, not waited
        failed = _failing(monkeypatch, 4)                          # more than 3 tries in a row
        assert _local(path).identical(want) and len(failed) == 4
        assert slept == [0.05, 0.1, 0.2, 0.4]                      # each pause twice the last
        slept.clear()
        failed = _failing(monkeypatch, None)                       # a chunk that is damaged:
        with pytest.warns(TensortapeWarning, match="cannot be read"):   # its rows, missing
            got = _local(path)
        assert (got["count"].values == -1).all() and 1 < sum(slept)
        assert max(slept) <= 0.8 and len(failed) > len(slept)     # each read's pauses bounded
    finally:
        monkeypatch.undo()
        rec.close()


def test_a_finished_run_that_fails_a_read_is_not_waited_for(tmp_path, monkeypatch):
    """A finished run's shards are never replaced: a read that fails is made again a
    stored chunk at a time at once, with no pause; a chunk that still fails is local
    damage (its rows missing, named in a warning)."""
    path = str(tmp_path / "run.zarr")
    _record(path)[0].close()
    want = _local(path)
    slept = []
    monkeypatch.setattr(_source.time, "sleep", slept.append)
    failed = _failing(monkeypatch, 1)                          # one failure
    assert _local(path).identical(want) and slept == [] and len(failed) == 1
    failed = _failing(monkeypatch, None)                       # every read of the chunk
    with pytest.warns(TensortapeWarning, match="cannot be read"):
        got = _local(path)
    assert (got["count"].values == -1).all() and slept == []


def test_watch_notes_a_failed_read_of_a_live_run_and_reads_again(tmp_path, monkeypatch):
    path = str(tmp_path / "run.zarr")
    monkeypatch.setattr(_source, "RETRIES", 0)                 # one read: it fails at once
    rec, model = _record(path)
    try:
        views = snapshots(path, interval=0.5, sleep=lambda s: None)
        good = next(views)
        assert good["step"] == 2 and "note" not in good
        failed = _failing(monkeypatch, 1)
        again = next(views)                # a read that failed once is made a chunk at a time
        assert failed and again["status"] == fmt.STATUS_RECORDING and "note" not in again
        assert (again["step"], again["rows"]) == (good["step"], good["rows"])
        _steps(rec, model, range(3, 5))
        rec.flush()
        after = next(views)                                    # the next refresh reads
        assert after["step"] == 4 and "note" not in after
    finally:
        rec.close()
    _failing(monkeypatch, None)                # no longer live, a chunk damaged: named
    with pytest.warns(TensortapeWarning, match="cannot be read"):
        views = list(snapshots(path, interval=0.5, sleep=lambda s: None))
    assert views and views[-1]["step"] == 4


def test_the_sources_a_process_keeps_for_unpickled_arrays_are_bounded(tmp_path):
    """An array pickles as its store's location and path (dask workers); the sources
    opened again to unpickle them are kept, the latest used, up to ``SOURCES``."""
    import pickle
    path = str(tmp_path / "run0.zarr")
    _record(path)[0].close()
    for i in range(1, _source.SOURCES + 3):
        shutil.copytree(path, str(tmp_path / f"run{i}.zarr"))
    _source._opened.clear()
    for i in range(_source.SOURCES + 3):
        run = open_run(str(tmp_path / f"run{i}.zarr"))
        arr = pickle.loads(pickle.dumps(run.source.array("rank0/stats/activations/step")))
        assert list(arr[:3]) == [0, 1, 2]
        assert len(_source._opened) == min(i + 1, _source.SOURCES)
    kept = list(_source._opened)
    assert kept == [str(tmp_path / f"run{i}.zarr") for i in range(3, _source.SOURCES + 3)]
    _source._opened.clear()
