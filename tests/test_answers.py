"""Answers a user can trust: compare verdicts, what pictures draw, watch, the CLI's
steps and --debug, Inspector.  Expected numbers come from plain hooks and numpy."""
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tensortape import cli
from tensortape.analysis import Inspector, compare_runs, first_divergence, open_run, plot_comparison
from tensortape.recorder import ConfigError, Recorder

STATS = ("mean", "std", "min", "max", "abs_max", "norm")


class Scaled(nn.Module):
    """y = lin(k * x): the test sets k per step, so it knows where runs differ."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.k = 1.0

    def forward(self, x):
        return self.out(torch.relu(self.lin(x * self.k)))


def record_scaled(store, factors, tensors_every=4, steps=10):
    """A run of ``steps`` steps with k = factors.get(step, 1); also returns what
    plain forward hooks saw of ``lin``'s output at each step."""
    model = Scaled()
    seen = {}
    handle = model.lin.register_forward_hook(
        lambda m, a, out: seen.__setitem__(model.step, out.detach().double().numpy().copy()))
    gen = torch.Generator().manual_seed(0)
    with Recorder(model, store, layers=["lin", "out"], tensors_every=tensors_every, stats_every=1) as rec:
        for i in range(steps):
            model.step, model.k = i, factors.get(i, 1.0)
            x = torch.randn(16, 8, generator=gen)
            with rec.step(i):
                model(x).sum().backward()      # no optimiser: weights stay, only k changes
    handle.remove()
    return store, seen


def by_hand(a, b):
    """The largest relative difference of any statistic, per step, from numpy."""
    out = {}
    for step in a:
        x, y = a[step], b[step]
        worst = 0.0
        for f in (np.mean, np.std, np.min, np.max, lambda v: np.abs(v).max(), np.linalg.norm):
            u, v = float(f(x)), float(f(y))
            if u != v:
                worst = max(worst, abs(v - u) / max(abs(u), abs(v), 1e-30))
        out[step] = worst
    return out


def invoke(*args):
    return CliRunner().invoke(cli.cli, [str(a) for a in args], prog_name="tensortape")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    a, seen_a = record_scaled(str(d / "clean.zarr"), {})
    b, seen_b = record_scaled(str(d / "blown.zarr"), {5: 2.0, 7: 50.0})
    return a, b, seen_a, seen_b


def test_unrelated_runs_cannot_be_compared(tmp_path):
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2))
    mlp = Scaled()
    stores = [str(tmp_path / "cnn.zarr"), str(tmp_path / "mlp.zarr")]
    with Recorder(cnn, stores[0], tensors_every=1, stats_every=1) as rec:          # every layer, the root "(root)" too
        with rec.step(0):
            cnn(torch.randn(1, 1, 4, 4)).sum().backward()
    with Recorder(mlp, stores[1], tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            mlp(torch.randn(2, 8)).sum().backward()
    for call in (lambda: compare_runs(*stores), lambda: first_divergence(*stores)):
        with pytest.raises(ConfigError, match="share no recorded"):
            call()
    r = invoke("compare", *stores)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "share no recorded" in r.output and "Empty DataFrame" not in r.output


def test_a_clean_run_against_a_blown_one_is_judged_by_the_statistics(pair):
    a, b, seen_a, seen_b = pair
    hand = by_hand(seen_a, seen_b)
    diverged = [s for s in sorted(hand) if hand[s] > 1e-3]
    assert diverged == [5, 7]                           # the schedule the test chose
    assert first_divergence(a, b) == (5, "lin")
    ds = compare_runs(a, b)
    rel = ds["stat_rel"].sel(layer="lin").values
    np.testing.assert_allclose(rel, [hand[s] for s in sorted(hand)], rtol=1e-5, atol=1e-12)
    assert ds.attrs["tensor_steps"] == [0, 4, 8]        # tensors_every=4, and they agree there
    assert np.nanmax(ds["rel_l2"].values) == 0
    r = invoke("compare", a, b)
    lines = r.output.splitlines()
    assert r.exit_code == 1
    assert lines[0] == "first divergence: step 5, layer lin (activations), shown by statistics"
    assert "the full tensors agree at every step both runs hold them" in lines[1] \
        and lines[1].endswith("the statistics differ")
    assert "3 steps (0, 4, 8) x 2 layers" in r.output and "steps 0-9 (10) x 2 layers" in r.output
    j = json.loads(invoke("compare", a, b, "--format", "json").output)
    worst = max(hand, key=hand.get)
    assert j["layers"]["lin"]["worst_step"] == worst == 7
    assert j["first_divergence"] == {"step": 5, "layer": "lin", "kind": "activations",
                                     "by": "statistics"}
    assert j["coverage"]["full_tensors"]["steps"] == [0, 4, 8]
    assert type(j["layers"]["lin"]["delta_nan"]) is int


def test_counts_are_int64_everywhere(pair):
    a, b, *_ = pair
    ds = open_run(a).stats()
    for k in ("count", "nan", "posinf", "neginf"):
        assert ds[k].dtype == np.int64
    assert compare_runs(a, b)["delta_count"].dtype == np.int64
    assert "count 128.0" not in invoke("stats", a, "--steps", "0:1").output


def test_the_compare_picture_marks_nonfinite_cells_in_the_tables_metric(tmp_path, pair):
    a, *_ = pair
    c, seen_c = record_scaled(str(tmp_path / "nan.zarr"), {6: float("inf")})
    fig = plot_comparison(a, c, "lin")
    heat = fig.axes[0]
    assert "stat_rel" in heat.get_title()
    layers = [t.get_text() for t in heat.get_yticklabels()]
    marks = next(ln for ln in heat.get_lines() if ln.get_marker() == "x")
    cells = sorted(zip(marks.get_xdata().tolist(), [layers[int(i)] for i in marks.get_ydata()]))
    run_c = open_run(c).stats().compute()
    bad = (run_c.nan + run_c.posinf + run_c.neginf) > 0
    expected = sorted((int(s), str(l)) for s in run_c.step.values for l in run_c.layer.values
                      if bool(bad.sel(step=s, layer=l)))
    assert cells == expected and (6, "lin") in cells
    assert marks.get_color() not in ("black", "white")   # visible on the darkest and lightest cells
    mesh = heat.collections[0]
    cmap = mesh.get_cmap()
    assert sum(cmap(0.0)[:3]) > sum(cmap(1.0)[:3])     # darker means more different


def test_histogram_is_drawn_over_values_with_a_zero_tick_and_nonfinite_bars(tmp_path):
    model = nn.Linear(4, 64)
    store = str(tmp_path / "h.zarr")
    x = torch.randn(32, 4)
    with Recorder(model, store, layers="", capture="activations", tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            model(x)
        bad = x.clone()
        bad[0, 0], bad[1, 0] = float("nan"), float("inf")
        with rec.step(1):
            y1 = model(bad)
    fig = open_run(store).plot_histogram("(root)", steps=1, scale="symlog", density=False)
    ax, side = fig.axes
    assert ax.get_xscale() == "symlog" and 0.0 in ax.get_xticks()
    ticks = [t for t in ax.get_xticks() if t != 0 and ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(np.isclose(np.log10(abs(t)), round(np.log10(abs(t)))) for t in ticks)
    finite = y1.detach().numpy()[np.isfinite(y1.detach().numpy())]
    left = min(p.get_x() for p in ax.patches)
    right = max(p.get_x() + p.get_width() for p in ax.patches)
    # the bars span the values, to within a stored bin (a quarter octave: 19%)
    assert left <= finite.min() and right >= finite.max()
    assert np.isclose(left, finite.min(), rtol=0.19) and np.isclose(right, finite.max(), rtol=0.19)
    assert sum(p.get_height() for p in ax.patches) == finite.size           # counts per bin
    v = y1.detach().numpy()
    heights = [p.get_height() for p in side.patches]
    assert heights == [int(np.isnan(v).sum()), int((v == np.inf).sum()), int((v == -np.inf).sum())]
    assert heights[0] > 0
    dense = open_run(store).plot_histogram("(root)", steps=1, density=True).axes[0]
    area = sum(p.get_height() * p.get_width() for p in dense.patches if p.get_width() > 0)
    point = sum(p.get_height() for p in ax.patches if p.get_width() == 0)   # one-value bins
    assert np.isclose(area, 1 - point / finite.size, rtol=1e-6)


def test_evolution_past_six_layers_is_small_multiples_naming_the_run(tmp_path):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    store = str(tmp_path / "many.zarr")
    with Recorder(model, store, layers="*", capture="activations", tensors_every=None, stats_every=1) as rec:
        for i in range(3):
            with rec.step(i):
                model(torch.randn(2, 4))
    fig = open_run(store).plot_evolution(stat="std")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 9                          # (root) and 8 layers, a panel each
    assert "many.zarr" in fig._suptitle.get_text()


WRITER = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    from tensortape.recorder import Recorder
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with Recorder(model, sys.argv[1], flush_interval=0.3, tensors_every=None, stats_every=1) as rec:
        time.sleep(1.0)                                  # nothing committed yet
        for i in range(60):
            x = torch.randn(2, 4)
            if i >= 10:
                x[0, 0] = float("nan")                   # every step after 10: both layers
            with rec.step(i):
                model(x).sum().backward()
            time.sleep(0.05)                             # about 20 steps a second at most
""")


def test_watch_alerts_once_per_layer_and_kind_and_keeps_a_steady_rate(tmp_path):
    from tensortape.analysis._watch import render, snapshots
    store = str(tmp_path / "live.zarr")
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, str(script), store], cwd=root,
                             env=dict(os.environ, PYTHONPATH=root))
    seen = []                                    # (when the test saw it, its step)
    try:
        views = []
        for v in snapshots(store, interval=0.1):
            seen.append((time.monotonic(), v.get("step")))
            views.append(v)
    finally:
        child.wait(timeout=300)
    seconds = time.monotonic() - t0
    texts = [render(v) for v in views]
    assert any(t[0].endswith("waiting for the first commit") for t in texts)
    alerts = [line for t in texts for line in t if line.startswith("ALERT")]
    # (root), 0 and 1 go NaN forward from step 10 on (their gradients stay finite): one
    # alert each, though every step after adds events
    assert sorted(a.split(" went")[0] for a in alerts) == [
        "ALERT (root) (activations)", "ALERT 0 (activations)", "ALERT 1 (activations)"]
    assert views[-1]["events"] > 3 * 10
    rates = [v["rate"] for v in views if v.get("rate") is not None]
    true_rate = 60 / seconds                     # a lower bound: start-up is in `seconds`
    assert rates and min(rates[len(rates) // 2:]) > 0              # never drops to 0 between commits
    # steps a second, as the test saw the committed step change over the last 30 s (a loaded
    # machine commits, and watches, in bursts: no bound in wall-clock terms holds); a rate of
    # rows or layers would be 4 times it (2 layers, 2 kinds)
    changes = [(t, s) for i, (t, s) in enumerate(seen)
               if s is not None and (i == 0 or s != seen[i - 1][1])]
    window = [(t, s) for t, s in changes if changes[-1][0] - t <= 30.0] or changes
    (ta, sa), (tb, sb) = window[0], window[-1]
    assert tb > ta
    assert 0.5 < rates[-1] / ((sb - sa) / (tb - ta)) < 2, (rates[-1], window)
    assert rates[-1] > true_rate * 0.7 or len(window) < len(changes)
    assert texts[-1][-1].startswith("non-finite so far: ")


def test_steps_ranges_and_out_of_range_steps_name_the_range(pair):
    a, *_ = pair
    j = json.loads(invoke("stats", a, "--layer", "lin", "--steps", "2:5", "--format", "json").output)
    assert [r["step"] for r in j] == [2, 3, 4]
    for args in (("stats", a, "--step", 99), ("plot", a, "--layer", "lin", "--step", 99, "-o", "x.png"),
                 ("stats", a, "--steps", "50:60")):
        r = invoke(*args)
        assert r.exit_code == 2 and "steps 0-9 (10)" in r.output, r.output


def test_debug_works_anywhere_on_the_line(tmp_path):
    missing = str(tmp_path / "none.zarr")
    plain = invoke("info", missing)
    assert plain.exit_code == 2 and "Traceback" not in plain.output
    late = invoke("info", missing, "--debug")
    assert late.exception is not None and not isinstance(late.exception, SystemExit)


def test_inspector_needs_watch_and_keeps_its_internals_private():
    model = Scaled()
    insp = Inspector(model)
    with pytest.raises(ConfigError, match="watch"):
        insp.run_inspection(torch.randn(2, 8))
    assert not any(hasattr(insp, n) for n in ("add", "begin_pass", "current_token", "fault"))
    insp.watch("lin")
    insp.run_inspection(torch.randn(2, 8))
    stats = insp.get_statistics("lin")
    assert type(stats["count"]) is int and type(stats["nan"]) is int


def test_every_cli_option_has_help_and_is_in_the_reference():
    import click
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "REFERENCE.md")) as f:
        reference = f.read()
    for name, command in cli.cli.commands.items():
        for p in command.params:
            if isinstance(p, click.Option):
                assert p.help, f"tensortape {name} {p.opts[0]} has no help"
                assert p.opts[-1] in reference.split(f"### `tensortape {name}`")[1].split("### ")[0], \
                    f"docs/REFERENCE.md lacks tensortape {name} {p.opts[-1]}"
