"""The two-run page's server (``/api/compare-map``) while its comparison of the full
tensors is still under way, held back here until the test lets it go: the first
answer comes from the statistics alone, and no request waits on the comparison
holding the server.  The truth is the tensors as plain forward hooks saw them,
compared with numpy."""

from __future__ import annotations

import math
import threading
import urllib.request

import numpy as np
import pytest
import torch
from torch import nn

from tensortape import Recorder
from tensortape.analysis import Run

from test_serve import Served, as_float, whole

STEPS, APART_FROM = 6, 3


class Reshape(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.reshape(self.shape)


class Shaped(nn.Module):
    """``lin`` then ``view``: ``view``'s output is 24 elements in ``shape``."""

    def __init__(self, shape):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 6)
        self.view = Reshape(shape)

    def forward(self, x):
        return self.view(torch.tanh(self.lin(x)))


def record(path: str, shape, scale_from: int | None) -> dict:
    """A run of ``Shaped(shape)``, full tensors every step, the input 1% larger from
    step ``scale_from`` on; what plain forward hooks saw: (layer, step) -> array."""
    model, seen, at = Shaped(shape), {}, {}
    for name in ("lin", "view"):
        getattr(model, name).register_forward_hook(
            lambda m, i, out, name=name: seen.__setitem__((name, at["step"]),
                                                          out.detach().numpy().copy()))
    data = torch.Generator().manual_seed(1)
    with Recorder(model, path, layers=["lin", "view"], capture=("activations",),
                  tensors_every=1, stats_every=1, max_bytes=None) as rec:
        for step in range(STEPS):
            at["step"] = step
            x = torch.randn(4, 4, generator=data)
            with rec.step(step), torch.no_grad():
                model(x * 1.01 if scale_from is not None and step >= scale_from else x)
    return seen


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two runs whose ``view`` holds 24 elements in other shapes, and what hooks saw."""
    d = tmp_path_factory.mktemp("pair")
    a, b = str(d / "a.zarr"), str(d / "b.zarr")
    return a, b, record(a, (24,), None), record(b, (4, 6), APART_FROM)


@pytest.fixture
def held(monkeypatch):
    """The server's comparison of full tensors held back until ``release`` is set;
    ``reads``: the tensor tables' reads (``Run.tensor_layers``, ``Run.tensor_shape``)
    made meanwhile."""
    from tensortape.analysis import _compare
    release, reads = threading.Event(), []
    real = _compare.with_tensors

    def waiting(*args, **kw):
        release.wait(300)
        return real(*args, **kw)
    monkeypatch.setattr(_compare, "with_tensors", waiting)
    for name in ("tensor_layers", "tensor_shape"):
        method = getattr(Run, name)

        def read(self, *a, method=method, name=name, **kw):
            if not release.is_set():
                reads.append((name, threading.current_thread().name))
            return method(self, *a, **kw)
        monkeypatch.setattr(Run, name, read)
    yield release, reads
    release.set()


def rel_l2(seen_a: dict, seen_b: dict, layer: str, step: int) -> float:
    a = seen_a[layer, step].astype(np.float64).ravel()
    b = seen_b[layer, step].astype(np.float64).ravel()
    return float(np.linalg.norm(b - a) / np.linalg.norm(a))


def test_the_first_answer_is_the_statistics_alone_the_shapes_follow_with_the_tensors(pair, held):
    """Before: the first answer read every tensor table for its shape (0.5-1 s at 200
    layers) and left out ``view``, whose 24 elements the runs hold in other shapes.
    Now it is the statistics' alone, ``view`` in it; the whole answer, once the full
    tensors are compared, leaves ``view`` out and says why."""
    release, reads = held
    a, b, seen_a, seen_b = pair
    served = Served(a, b)
    try:
        reads.clear()
        status, first = served.get("compare-map", width=100)
        assert status == 200, first
        assert reads == [] and first["pending"] == {"done": 0, "of": None, "covered": None}
        assert first["layers"] == ["lin", "view"] and first["unlike"] == []
        # the statistics differ from APART_FROM on, in both layers
        assert first["first_divergence"] == {"step": APART_FROM, "layer": "lin"}
        release.set()
        m = whole(served, width=100)
        assert m["layers"] == ["lin"]
        assert m["unlike"] == ["1 shared layer differs in shape (view: shapes (24,) and (4, 6))"]
        r = whole(served, width=100, metric="rel_l2")
        want = [rel_l2(seen_a, seen_b, "lin", s) for s in range(STEPS)]
        assert [as_float(v) for v in r["values"][0]] == pytest.approx(want, rel=1e-9, abs=0)
    finally:
        release.set()
        served.close()


@pytest.mark.parametrize("metric", ["rel_l2", "max_abs"])
def test_a_full_tensor_metric_asked_while_pending_holds_no_other_request(pair, held, metric):
    """Before: ``metric=rel_l2`` while the full tensors were compared waited for the
    whole comparison holding the server's lock, and every other request (the map, a
    histogram) waited behind it.  Now it answers at once: ``pending``, every cell not
    compared yet (``"nan"``, not non-finite); the page asks again until it is whole."""
    release, _ = held
    a, b, seen_a, seen_b = pair
    served = Served(a, b)
    got = {}
    asking = threading.Thread(target=lambda: got.update(
        zip(("status", "body"), served.get("compare-map", metric=metric, width=100))))
    try:
        assert served.get("compare-map", width=100)[0] == 200      # the comparison starts
        asking.start()
        for route in ("map?run=1&width=100", "histogram?run=0&layer=lin&step=0"):
            with urllib.request.urlopen(f"{served.url}/api/{route}", timeout=60) as r:
                assert r.status == 200          # never behind it (before: a timeout here)
        asking.join(300)
        assert got["status"] == 200, got
        pending = got["body"]
        assert pending["pending"] is not None and pending["metric"] == metric
        assert all(v == "nan" for row in pending["values"] for v in row)
        assert not any(any(row) for row in pending["nonfinite"])
        release.set()
        r = whole(served, width=100, metric=metric)
        assert r["layers"] == ["lin"]
        diff = [np.abs(seen_b["lin", s].astype(np.float64) - seen_a["lin", s]).max()
                if metric == "max_abs" else rel_l2(seen_a, seen_b, "lin", s) for s in range(STEPS)]
        assert [as_float(v) for v in r["values"][0]] == pytest.approx(diff, rel=1e-9, abs=0)
        assert not math.isnan(as_float(r["values"][0][-1]))
    finally:
        release.set()
        asking.join(300) if asking.is_alive() else None
        served.close()


def test_a_comparison_dropped_when_a_run_changes_scans_no_further(pair, held):
    """A live run's commit drops the server's comparison (``Served`` reopens the run);
    its thread then compares no further layer, so comparisons dropped one after
    another do not pile up threads reading every full tensor."""
    from tensortape import open_run
    from tensortape.analysis.browser._api import Comparison
    release, _ = held
    a, b, *_ = pair
    comparison = Comparison(open_run(a), open_run(b), "activations", None, 1e-3)
    comparison.stop()
    release.set()
    for t in [t for t in threading.enumerate() if t.name == "tensortape-compare"]:
        t.join(120)
    assert comparison.done == 0


def test_commits_polled_while_a_scan_runs_keep_no_comparison_each(pair, held):
    """A live run's page asks twice a second while a long scan runs, and each commit
    makes a new comparison that follows the last: those that never began end at once
    (their threads and statistics gone), so the comparisons kept do not grow with the
    commits, and the last one still answers with every full tensor compared."""
    from tensortape import open_run
    from tensortape.analysis.browser._api import Comparison
    release, _ = held
    a, b, seen_a, seen_b = pair
    ra, rb = open_run(a), open_run(b)
    comparison = Comparison(ra, rb, "activations", None, 1e-3)
    for _ in range(40):
        comparison = comparison.then(ra, rb)

    def alive():
        return sum(t.name == "tensortape-compare" and t.is_alive() for t in threading.enumerate())
    for _ in range(600):
        if alive() <= 2:
            break
        threading.Event().wait(0.05)
    assert alive() <= 2
    release.set()
    comparison._thread.join(120)
    ds, _, pending = comparison.answer()
    assert pending is None
    assert np.isclose(float(ds["rel_l2"].sel(layer="lin", step=APART_FROM)),
                      rel_l2(seen_a, seen_b, "lin", APART_FROM))


class Gate:
    """The comparison thread's reads of full tensors (``Run.tensor_blocks``), let
    through ``allow(n)`` at a time: a scan exactly as slow as the test says."""

    def __init__(self, monkeypatch):
        self.cond = threading.Condition()
        self.allowed = self.taken = 0
        real = Run.tensor_blocks

        def gated(run, *args, **kw):
            if threading.current_thread().name == "tensortape-compare":
                with self.cond:
                    self.cond.wait_for(lambda: self.taken < self.allowed, timeout=600)
                    self.taken += 1
            return real(run, *args, **kw)
        monkeypatch.setattr(Run, "tensor_blocks", gated)

    def allow(self, n: int) -> None:
        """Let ``n`` more reads through, and wait until they are made (or no
        comparison is left to make them)."""
        with self.cond:
            self.allowed += n
            self.cond.notify_all()
        for _ in range(6000):
            with self.cond:
                if self.taken >= self.allowed:
                    return
            if not any(t.name == "tensortape-compare" for t in threading.enumerate()):
                return
            threading.Event().wait(0.05)


LIVE, FIRST, LAYERS = 10, 3, 3          # steps of the live run; committed at first; layers


def test_a_live_run_committing_faster_than_the_scan_is_compared_further_at_each_commit(
        tmp_path, monkeypatch):
    """Before: each commit of a live run dropped the server's comparison and began the
    scan of every full tensor again, so a scan longer than the time between commits
    never ended: ``rel_l2`` "nan" (pending) at every step, forever.  Now the scan under
    way ends with the steps it began on, the next one scans only the steps since: here
    each commit comes after half a scan of the steps so far (the scan's reads let through
    by the test), and the answer holds more steps' ``rel_l2`` as the run goes on, each
    the truth of plain forward hooks, and is whole once the run stops committing."""
    from tensortape.analysis.browser import _serve
    monkeypatch.setattr(_serve, "REOPEN_S", 0)          # each request sees the last commit

    def chain(path, seen, scale):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(LAYERS)))
        for name, module in model.named_children():
            module.register_forward_hook(lambda m, i, out, name=name: seen.__setitem__(
                (name, len([k for k in seen if k[0] == name])), out.detach().numpy().copy()))
        data = torch.Generator().manual_seed(1)
        rec = Recorder(model, path, layers=[str(i) for i in range(LAYERS)],
                       capture=("activations",), tensors_every=1, max_bytes=None)
        return rec, lambda step: model(torch.randn(4, 4, generator=data) * scale)

    seen_a, seen_b = {}, {}
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    rec, forward = chain(a, seen_a, 1.0)
    with rec, torch.no_grad():
        for step in range(LIVE):
            with rec.step(step):
                forward(step)
    gate = Gate(monkeypatch)
    rec, forward = chain(b, seen_b, 1.01)
    served = None
    try:
        with rec, torch.no_grad():
            for step in range(LIVE):
                with rec.step(step):
                    forward(step)
                if step + 1 < FIRST:
                    continue
                rec.flush()                                 # a commit
                if served is None:
                    served = Served(a, b)
                status, m = served.get("compare-map", metric="rel_l2", width=100)
                assert status == 200, m
                gate.allow(LAYERS)          # half a scan of the steps so far (2 reads a layer)
        got = [[as_float(v) for v in row] for row in m["values"]]
        covered = [s for s, v in zip(m["step_lo"], got[0]) if not math.isnan(v)]
        assert m["pending"] is not None and len(covered) >= FIRST, m
        assert m["covers"] == m["pending"]["covered"]
        assert m["covers"].startswith(f"full tensors: steps 0-{covered[-1]} ")
        for j, layer in enumerate(m["layers"]):
            assert [got[j][s] for s in covered] == pytest.approx(
                [rel_l2(seen_a, seen_b, layer, s) for s in covered], rel=1e-9, abs=0)
        gate.allow(10 ** 6)
        m = whole(served, metric="rel_l2", width=100)
        assert m["step_lo"] == list(range(LIVE))
        for j, layer in enumerate(m["layers"]):
            assert [as_float(v) for v in m["values"][j]] == pytest.approx(
                [rel_l2(seen_a, seen_b, layer, s) for s in range(LIVE)], rel=1e-9, abs=0)
    finally:
        gate.allow(10 ** 6)
        if served is not None:
            served.close()
