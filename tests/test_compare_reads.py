"""``compare_runs``' round trips to zarr's event loop: a run's tensor tables are opened
together, so their number does not grow with the layers (before: one round trip per array
opened and per attribute read, about seven a table, 1-2 ms of CPU each).  The answer is
checked against plain forward hooks and numpy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from torch import nn

from tensortape import Recorder, open_run
from tensortape.analysis import compare_runs

STEPS = 3


def record(path: str, layers: int, scale: float) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
    seen = {}
    for name, m in model.named_children():
        m.register_forward_hook(lambda m, i, out, name=name: seen.setdefault(name, []).append(
            out.detach().numpy().astype(np.float64)))
    data = torch.Generator().manual_seed(1)
    with Recorder(model, path, layers=[str(i) for i in range(layers)], capture=("activations",),
                  tensors_every=1, max_bytes=None) as rec, torch.no_grad():
        for step in range(STEPS):
            with rec.step(step):
                model(torch.randn(3, 4, generator=data) * scale)
    return seen


def round_trips(tmp_path, layers: int, monkeypatch) -> int:
    a, b = str(tmp_path / f"a{layers}.zarr"), str(tmp_path / f"b{layers}.zarr")
    seen_a, seen_b = record(a, layers, 1.0), record(b, layers, 1.01)
    ra, rb = open_run(a), open_run(b)
    calls, real = [], asyncio.run_coroutine_threadsafe

    def counted(coro, loop):
        calls.append(1)
        return real(coro, loop)
    with monkeypatch.context() as m:
        m.setattr(asyncio, "run_coroutine_threadsafe", counted)
        ds = compare_runs(ra, rb)
    want = [[np.linalg.norm(seen_b[n][s] - seen_a[n][s]) / np.linalg.norm(seen_a[n][s])
             for n in map(str, range(layers))] for s in range(STEPS)]
    assert ds["rel_l2"].transpose("step", "layer").values == pytest.approx(np.array(want),
                                                                            rel=1e-9, abs=0)
    return len(calls)


def test_the_round_trips_to_zarr_do_not_grow_with_the_layers(tmp_path, monkeypatch):
    few, many = round_trips(tmp_path, 2, monkeypatch), round_trips(tmp_path, 10, monkeypatch)
    assert many - few < 8, (few, many)          # before: about 7 a table, 2 x 8 tables more


def test_a_live_comparison_reads_the_full_tensors_a_dump_stores_after_their_step(tmp_path):
    """A run dumps its ring at a NaN: the full tensors of the steps before it are stored
    with the NaN step's commit, after those steps were compared without them.  The live
    comparison carried over from before that commit reads them, and answers as a fresh
    ``compare_runs`` of the finished runs does."""
    import shutil
    from tensortape.analysis._compare import statistics, with_tensors
    paths = {n: str(tmp_path / f"{n}.zarr") for n in ("a", "b", "early")}

    def train(path, nan_at=None, snap=None):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        kw = (dict(tensors_every=1) if nan_at is None
              else dict(tensors_every=None, ring=2, on_nonfinite="dump"))
        data = torch.Generator().manual_seed(2)
        with Recorder(m, path, layers="0", stats_every=1, max_bytes=None, **kw) as rec:
            for s in range(7):
                with rec.step(s):
                    x = torch.randn(3, 4, generator=data)
                    if s == nan_at:
                        x[0, 0] = float("nan")
                    m(x).sum().backward()
                if s == snap:
                    rec.flush()
                    shutil.copytree(path, paths["early"])

    train(paths["a"])
    train(paths["b"], nan_at=5, snap=4)
    a, b, early = (open_run(paths[n]) for n in ("a", "b", "early"))
    assert early.steps(tensors=True).tolist() == [] and b.steps(tensors=True).tolist() == [3, 4, 5]
    known = with_tensors(statistics(a, early, "activations", shapes=False), paths["a"], paths["early"])
    live = with_tensors(statistics(a, b, "activations", shapes=False), paths["a"], paths["b"],
                        known=known)
    fresh = compare_runs(paths["a"], paths["b"], kind="activations")
    np.testing.assert_array_equal(live["rel_l2"].values, fresh["rel_l2"].values)
    assert np.isfinite(live["rel_l2"].sel(step=[3, 4]).values).all()
