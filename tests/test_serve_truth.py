"""The served browser API says what was recorded: checked through HTTP against
plain forward hooks and numpy (what the model actually produced), never against
tensortape's own readers.

- The map shows a NaN or an Inf at a step without statistics (``stats_every >
  1``) in the column that holds it, whatever the width, window and statistic,
  also past the events the attributes keep, and a store that kept no complete
  counts says what it could not place.
- A served run is read again when the store changed: a job resumed with
  ``mode="a"``, a run recorded anew with ``mode="w"``, a rank that appears
  while the run is live.
- ``/api/scalars`` refuses an unknown rank; ``/api/runs`` gives the steps of
  every rank together.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from tensortape import Recorder
from tensortape.analysis.browser import _serve
from tensortape.recorder import format as fmt
from tensortape.recorder.errors import StoreFormatError

from test_serve import as_float, serve  # noqa: F401  (serve: the fixture of a server)

LAYERS = ("a", "b", "c")


class Net(nn.Module):
    def __init__(self, width: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = nn.Linear(4, width), nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def record(path, steps, stats_every=1, bad=None, mode="w-", seed=0, width=8, live=None):
    """Record ``steps`` of ``Net``'s activations (statistics only); at a step of
    ``bad`` one input element is that value.  The truth, from plain forward hooks:
    {(step, layer): (NaN + Inf elements, largest finite |value|)}.  ``live``: a
    function called with the open recorder after the steps, before it closes."""
    model, bad = Net(width, seed), bad or {}
    data = torch.Generator().manual_seed(seed + 1)
    truth, now = {}, {}

    def hook(module, args, out, name):
        o = out.detach().double()
        finite = o[torch.isfinite(o)]
        truth[(now["step"], name)] = (int((~torch.isfinite(o)).sum()),
                                      float(finite.abs().max()) if finite.numel() else math.nan)
    handles = [getattr(model, n).register_forward_hook(
        lambda m, a, o, n=n: hook(m, a, o, n)) for n in LAYERS]
    with Recorder(model, path, layers=list(LAYERS), capture=("activations",), tensors_every=None,
                  stats_every=stats_every, mode=mode) as rec:
        for step in steps:
            now["step"] = step
            x = torch.randn(3, 4, generator=data)
            if step in bad:
                x[0, 1] = bad[step]
            with rec.step(step), torch.no_grad():
                model(x)
        if live is not None:
            live(rec)
    for h in handles:
        h.remove()
    return truth


def check_map(m, truth, stats_every, stat, start=None, stop=None):
    """A map answer against the truth: each step that holds statistics, or a NaN or
    an Inf, lies in the one column whose [step_lo, step_hi] it is in (and those
    are the first and last of them); a column is non-finite where any of its steps
    is; its abs_max is the largest of its steps with statistics, and its nonfinite
    value the largest count of the steps it holds."""
    steps = sorted({s for s, _ in truth if (start is None or s >= start)
                    and (stop is None or s < stop)})
    told = [s for s in steps if s % stats_every == 0
            or any(truth[(s, n)][0] for n in LAYERS)]
    assert m["layers"] == list(LAYERS)
    cols = list(zip(m["step_lo"], m["step_hi"]))
    placed = [[s for s in told if a <= s <= b] for a, b in cols]
    assert sum(placed, []) == told                          # each once, in order
    assert all(p and (p[0], p[-1]) == c for p, c in zip(placed, cols))
    for row, name in enumerate(LAYERS):
        for c, held in enumerate(placed):
            counts = [truth[(s, name)][0] for s in held]
            assert m["nonfinite"][row][c] == any(counts), (name, cols[c])
            if stat == "nonfinite":
                want = float(max(counts))
            else:
                vals = [truth[(s, name)][1] for s in held if s % stats_every == 0]
                vals = [v for v in vals if not math.isnan(v)]
                want = max(vals) if vals else math.nan
            got = as_float(m["values"][row][c])
            assert got == want or (math.isnan(got) and math.isnan(want)), (name, cols[c], got, want)


def _map(s, **query):
    status, m = s.get("map", kind="activations", **{k: v for k, v in query.items() if v is not None})
    assert status == 200, m
    return m


# --- NaN and Inf at steps without statistics ------------------------------------------------
BAD = st.sampled_from([math.nan, math.inf, -math.inf])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stats_every=st.integers(2, 12), n=st.integers(24, 90),
       bad=st.dictionaries(st.integers(0, 89), BAD, min_size=1, max_size=3),
       queries=st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 60)), st.integers(1, 40),
                                  st.integers(1, 60), st.sampled_from(["nonfinite", "abs_max"])),
                        min_size=3, max_size=6))
def test_a_nan_between_statistics_steps_shows_in_its_column(tmp_path_factory, serve, stats_every,
                                                            n, bad, queries):
    path = str(tmp_path_factory.mktemp("between") / "run.zarr")
    truth = record(path, range(n), stats_every, {s: v for s, v in bad.items() if s < n})
    s = serve(path)
    for width in (1, 1000):
        check_map(_map(s, stat="nonfinite", width=width), truth, stats_every, "nonfinite")
    for start, span, width, stat in queries:
        stop = None if start is None else start + span
        m = _map(s, stat=stat, width=width, start=start, stop=stop)
        check_map(m, truth, stats_every, stat, start, stop)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """700 steps, statistics every 10th: a NaN at 333 and an Inf at 651 (the last
    partial grain of 64 rows), between statistics steps; the maps of few columns
    are made of grains of 64 rows."""
    path = str(tmp_path_factory.mktemp("long") / "run.zarr")
    return path, record(path, range(700), 10, {333: math.nan, 651: math.inf})


@pytest.mark.parametrize("width", [1, 2, 3, 7, 40, 1000])
@pytest.mark.parametrize("window", [(None, None), (0, 640), (300, 700), (330, 340), (331, 339)])
def test_grains_of_the_pyramid_show_a_nan_between_statistics_steps(long_run, serve, width, window):
    path, truth = long_run
    s = serve(path)
    for stat in ("nonfinite", "abs_max"):
        for _ in range(2):              # the second from the server's cache of grains
            check_map(_map(s, stat=stat, width=width, start=window[0], stop=window[1]),
                      truth, 10, stat, *window)


@pytest.fixture(scope="module")
def many_events(tmp_path_factory):
    """NaN at every step 0..59 (more events than the attributes keep), then a NaN
    at step 173 alone, between statistics steps (every 10th)."""
    path = str(tmp_path_factory.mktemp("many") / "run.zarr")
    bad = {**{s: math.nan for s in range(60)}, 173: math.nan}
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(20)])
    with Recorder(model, path, capture=("activations",), tensors_every=None, stats_every=10) as rec:
        for step in range(200):
            x = torch.ones(1, 2)
            if step in bad:
                x[0, 0] = bad[step]
            with rec.step(step), torch.no_grad():
                model(x)
    return path


def test_counts_between_statistics_steps_are_kept_past_the_events_kept(many_events, serve):
    from tensortape import open_run
    run = open_run(many_events)
    assert run.state().events_total == 61 * 21 > len(run.events)       # 20 layers and the root
    assert 173 not in {e.step for e in run.events}                     # not among those kept
    m = _map(serve(many_events), stat="nonfinite", width=1000)
    col = next(c for c, (a, b) in enumerate(zip(m["step_lo"], m["step_hi"])) if a <= 173 <= b)
    assert (m["step_lo"][col], m["step_hi"][col]) == (170, 173)
    assert all(row[col] for row in m["nonfinite"]) and m["unplaced_events"] == 0
    # the truth: each Linear(2, 2) of a row holding a NaN gives two NaN, and so the model
    assert [as_float(row[col]) for row in m["values"]] == [2.0] * 21


def test_a_store_without_complete_counts_says_what_it_cannot_place(many_events, serve, tmp_path):
    """As a tensortape that kept no counts table wrote it: the kept events are
    placed, and the others counted as not placed."""
    old = str(tmp_path / "old.zarr")
    shutil.copytree(many_events, old)
    g = zarr.open_group(old, mode="r+")
    del g["rank0/nonfinite"]
    attrs = dict(g["rank0"].attrs)
    del attrs["nonfinite"]
    g["rank0"].attrs.put(attrs)
    m = _map(serve(old), stat="nonfinite", width=1000)
    assert m["unplaced_events"] == 61 * 21 - 1000
    col = m["step_lo"].index(170)
    assert m["step_hi"][col] == 170 and not any(row[col] for row in m["nonfinite"])
    assert all(all(row[:6]) for row in m["nonfinite"])             # 0..59: in statistics rows


def test_an_export_keeps_the_counts_and_a_copy_without_them_says_so(many_events, serve, tmp_path):
    from click.testing import CliRunner
    from tensortape import open_run
    from tensortape import cli
    h5 = open_run(many_events).to_hdf5(tmp_path / "run.h5")
    m = _map(serve(h5), stat="nonfinite", width=1000)
    col = m["step_lo"].index(170)
    assert m["step_hi"][col] == 173 and all(row[col] for row in m["nonfinite"])
    assert m["unplaced_events"] == 0
    copy = str(tmp_path / "copy.zarr")                 # tensortape migrate copies no counts table
    assert CliRunner().invoke(cli.cli, ["migrate", h5, copy]).exit_code == 0
    m = _map(serve(copy), stat="nonfinite", width=1000)
    assert m["unplaced_events"] == 61 * 21 - 1000
    assert m["step_hi"][m["step_lo"].index(170)] == 170


# --- a served run is read again when the store changed ---------------------------------------
def _settle():
    time.sleep(_serve.REOPEN_S * 1.5)       # past the interval at which a run is opened again


def _finite_map(s, truth, stats_every=1):
    m = _map(s, stat="abs_max", width=1000)
    check_map(m, truth, stats_every, "abs_max")
    return m


def test_a_resumed_run_is_read_again(tmp_path, serve):
    path = str(tmp_path / "run.zarr")
    record(path, range(30), bad={5: math.nan})
    s = serve(path)
    _, runs = s.get("runs")
    assert runs[0]["first_nonfinite"]["step"] == 5 and runs[0]["steps"] == [0, 29]
    _map(s, stat="abs_max", width=2)
    truth = record(path, range(40), mode="a", seed=3)      # from step 0 again, clean
    _settle()
    _, runs = s.get("runs")
    assert runs[0]["first_nonfinite"] is None and runs[0]["steps"] == [0, 39]
    assert runs[0]["step_count"] == 40 and runs[0]["status"] == "complete"
    m = _finite_map(s, truth)
    assert not any(map(any, m["nonfinite"]))


def test_a_run_recorded_anew_at_its_path_is_read_again(tmp_path, serve):
    path = str(tmp_path / "run.zarr")
    record(path, range(200), width=8)
    s = serve(path)
    _map(s, stat="abs_max", width=2)                   # the server's grains of the first run
    truth = record(path, range(150), mode="w", seed=4, width=16)
    _settle()
    _, runs = s.get("runs")
    assert runs[0]["steps"] == [0, 149] and runs[0]["step_count"] == 150
    for width in (2, 7, 1000):
        status, m = s.get("map", kind="activations", stat="abs_max", width=width)
        assert status == 200, m
        check_map(m, truth, 1, "abs_max")


def as_rank(monkeypatch, rank, path):
    """The recorder of this process records as ``rank`` of a job whose rank 0 made
    the store at ``path``, as that rank does: it opens the store rank 0 prepared,
    under rank 0's claim (its token, which rank 0 sends its ranks at open, read here
    from the claim if rank 0 still holds it, else from the root rank 0 committed
    under it).  Rank 0's check of the mode is left out (here rank 0 made the store
    before)."""
    monkeypatch.setattr("tensortape.recorder._recorder.rank_and_world", lambda: (rank, 1))
    monkeypatch.setattr("tensortape.recorder._recorder.check_mode", lambda *a, **k: None)

    def rank0_told(decide, rank, world):
        claim = os.path.join(path, fmt.CLAIM_NAME, "zarr.json")
        if not os.path.exists(claim):
            with open(os.path.join(path, "zarr.json")) as f:
                return None, json.load(f)["attributes"].get(fmt.CLAIM_TOKEN, "")
        with open(claim) as f:
            return None, json.load(f)["attributes"]["tensortape_claim"]["token"]
    if rank:
        monkeypatch.setattr("tensortape.recorder.store._ranks.rank0_decides", rank0_told)


def test_a_rank_that_appears_while_the_run_is_live_is_served(tmp_path, serve, monkeypatch):
    path = str(tmp_path / "run.zarr")
    truths = {}

    def rank1_arrives(rec):
        rec.flush()
        s = serve(path)
        _, runs = s.get("runs")
        assert runs[0]["ranks"] == [0] and runs[0]["status"] == "recording"
        with monkeypatch.context() as m:
            as_rank(m, 1, path)
            truths[1] = record(path, range(5, 25), seed=7)
        _settle()
        _, runs = s.get("runs")
        assert runs[0]["ranks"] == [0, 1]
        got = _map(s, stat="abs_max", width=1000, rank=1)
        check_map(got, truths[1], 1, "abs_max")
        assert got["rank"] == 1

    truths[0] = record(path, range(20), live=rank1_arrives)


@pytest.mark.parametrize("error", [ValueError("cannot reshape array of size 480 into shape "
                                              "(64,4,6)"), StoreFormatError("a chunk is damaged")])
def test_an_internal_error_is_a_500_not_the_askers_fault(tmp_path, serve, monkeypatch, error):
    path = str(tmp_path / "run.zarr")
    record(path, range(10))
    s = serve(path)

    def fails(*args, **kwargs):
        raise error
    monkeypatch.setattr("tensortape.analysis.browser._api.map_", fails)
    status, body = s.get("map", kind="activations", stat="abs_max", width=3)
    assert status == 500 and str(error) in body["error"] and "\n" not in body["error"]
    status, body = s.get("map", kind="activations", stat="abs_max", width="x")
    assert status == 400 and "width" in body["error"]


# --- ranks --------------------------------------------------------------------------------------
def test_scalars_of_an_unknown_rank_is_a_404(tmp_path, serve):
    path = str(tmp_path / "run.zarr")
    record(path, range(3))
    status, body = serve(path).get("scalars", rank=7)
    assert status == 404 and "rank" in body["error"]


def test_runs_gives_the_steps_of_every_rank(tmp_path, serve, monkeypatch):
    path = str(tmp_path / "run.zarr")
    spans = {0: range(0, 150), 1: range(10, 175), 2: range(20, 200)}
    for rank, steps in spans.items():
        with monkeypatch.context() as m:
            as_rank(m, rank, path)
            record(path, steps, stats_every=1 if rank else 2, seed=rank)
    _, runs = serve(path).get("runs")
    held = set(range(0, 150, 2)) | set(range(10, 200))
    assert runs[0]["ranks"] == [0, 1, 2]
    assert runs[0]["steps"] == [0, 199] and runs[0]["step_count"] == len(held)
