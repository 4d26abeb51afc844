"""The browser view's answers about one layer, over HTTP, against independent truths:
the samples themselves (numpy), the PNG's own bars as matplotlib holds them, and the
run's statistics summed or maximised with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder

from test_serve import NAN_STEP, SPIKE, as_float, serve, spiky  # noqa: F401 (fixtures)

STEPS, SIZE = 30, 16384
ZEROS_AT, BAD_AT = 7, 20                     # a step with exact zeros; one with NaN and Inf


class Feed(nn.Module):
    """A layer whose output is its input: what it records is what the test feeds it."""

    def forward(self, x):
        return x * 1.0


def samples(step: int) -> np.ndarray:
    """What the layer sees at ``step`` (float32): an embedding's output, N(0, 0.028)."""
    x = np.random.default_rng(step).normal(0, 0.028, SIZE).astype(np.float32)
    if step == ZEROS_AT:
        x[:4000] = 0
    if step == BAD_AT:
        x[:3], x[3:5], x[5] = np.nan, np.inf, -np.inf
    return x


def record_embedding(path: str) -> str:
    """A run of one layer, ``embed``, that records ``samples(step)`` at each step."""
    model = nn.Sequential()
    model.add_module("embed", Feed())
    with Recorder(model, path, capture="activations", tensors_every=None, stats_every=1) as rec:
        for step in range(STEPS):
            with rec.step(step):
                model(torch.from_numpy(samples(step)))
    return path


@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    return record_embedding(str(tmp_path_factory.mktemp("views") / "embed.zarr"))


def floats(values) -> np.ndarray:
    return np.array([as_float(v) for v in values], float)


def png_bars(run, step: int, scale: str):
    ax = run.plot_histogram("embed", steps=step, scale=scale).axes[0]
    rects = [r for c in ax.containers for r in c]
    lo = np.array([r.get_x() for r in rects])
    return lo, lo + np.array([r.get_width() for r in rects]), np.array([r.get_height() for r in rects])


@pytest.mark.parametrize("scale", ["linear", "symlog"])
def test_the_histogram_is_the_pictures_bars_and_the_samples_density(embedding, serve, scale):
    s = serve(embedding)
    run = open_run(embedding)
    for step in (3, ZEROS_AT):
        status, h = s.get("histogram", layer="embed", step=step, scale=scale)
        assert status == 200 and h["scale"] == scale
        lo, hi, height = (floats(h["bars"][k]) for k in ("lo", "hi", "height"))
        png = png_bars(run, step, scale)
        np.testing.assert_array_equal(lo, png[0])
        np.testing.assert_array_equal(hi, png[1])
        np.testing.assert_allclose(height, png[2], rtol=1e-12)
        x = samples(step).astype(float)
        v = x[x != 0][:, None]
        count = (((v >= lo) & (v < hi)) | ((v == hi) & (hi == x.max()))).sum(axis=0)
        assert count.sum() == v.size and h["bars"]["count"] == count.tolist()
        width = drawn(hi, h["linthresh"]) - drawn(lo, h["linthresh"])
        np.testing.assert_allclose(height, count / (x.size * width), rtol=1e-12)
        assert h["total"] == SIZE
        zeros = int((x == 0).sum())
        assert [(m["value"], m["count"]) for m in h["masses"]] == ([(0.0, zeros)] if zeros else [])
    if scale == "linear":                             # a Gaussian: one bell, ticks of values
        _, h = s.get("histogram", layer="embed", step=3)
        height = floats(h["bars"]["height"])
        top = int(np.argmax(height))
        mid = (floats(h["bars"]["lo"]) + floats(h["bars"]["hi"])) / 2
        assert abs(mid[top]) < 0.02
        assert np.all(np.diff(height[:top + 1]) > -0.15 * height[top])
        assert np.all(np.diff(height[top:]) < 0.15 * height[top])
        assert h["xlabel"].startswith("value (linear axis)") and "per unit" in h["ylabel"]
    else:
        _, h = s.get("histogram", layer="embed", step=3, scale="symlog")
        assert "0" in [t["label"] for t in h["ticks"]] and "symmetric-log" in h["xlabel"]


def drawn(x, lt):
    """Where values sit on the axis drawn: themselves (linear), or in decades on
    matplotlib's symmetric-log axis of linear threshold ``lt`` (linscale 0.5)."""
    if lt is None:
        return x
    from matplotlib.scale import SymmetricalLogTransform
    return SymmetricalLogTransform(10, lt, 0.5).transform(x) / lt


def test_histograms_over_time_are_each_columns_samples_never_a_sample_of_them(embedding, serve):
    s = serve(embedding)
    for width, window in ((7, {}), (4, {"start": 5, "stop": 23}), (100, {"start": 18, "stop": 22})):
        status, d = s.get("distribution", layer="embed", width=width, **window)
        assert status == 200
        steps = list(range(window.get("start", 0), window.get("stop", STEPS)))
        assert len(d["step_lo"]) == min(width, len(steps))
        covered = [t for a, b in zip(d["step_lo"], d["step_hi"]) for t in range(a, b + 1)]
        assert covered == steps                           # every step in one column
        lo, hi = floats(d["row_lo"]), floats(d["row_hi"])
        assert np.all(hi > lo) and np.all(lo[1:] >= hi[:-1])
        density = np.array([[as_float(v) for v in row] for row in d["density"]], float)
        for c, (a, b) in enumerate(zip(d["step_lo"], d["step_hi"])):
            x = np.concatenate([samples(t) for t in range(a, b + 1)]).astype(float)
            finite = x[np.isfinite(x)]
            v = finite[finite != 0][:, None]
            top = v.max() if v.size else np.nan
            count = (((v >= lo) & (v < hi)) | ((v == hi) & (hi == top))).sum(axis=0)
            assert count.sum() == v.size                  # each value in one row
            assert d["finite"][c] == finite.size and d["zeros"][c] == int((finite == 0).sum())
            assert (d["nan"][c], d["posinf"][c], d["neginf"][c]) == (
                int(np.isnan(x).sum()), int((x == np.inf).sum()), int((x == -np.inf).sum()))
            np.testing.assert_allclose(density[:, c], count / (finite.size * (hi - lo)), rtol=1e-12)


def test_the_evolution_of_a_long_window_is_its_steps_largest_from_the_grains(spiky, serve):
    """The map's statistics come from the server's grains (the pyramid), the others from
    the rows; either way each column is the largest of its steps, and says whether any of
    them held a NaN or an Inf."""
    s = serve(spiky)
    ds = open_run(spiky).stats("activations", ["first"]).isel(layer=0).compute()
    bad = (ds.nan + ds.posinf + ds.neginf).values > 0
    finite = (ds["count"] - ds.nan - ds.posinf - ds.neginf).values
    truth = {k: ds[k].values for k in ("mean", "std", "min", "max", "abs_max", "norm", "zero_frac")}
    truth["rms"] = ds["norm"].values / np.sqrt(np.where(finite > 0, finite, np.nan))
    truth["nonfinite"] = (ds.nan + ds.posinf + ds.neginf).values.astype(float)
    steps = ds.step.values
    for width, window in ((20, {}), (9, {"start": 100, "stop": 1150}), (None, {"start": 725, "stop": 740})):
        query = {"width": width} if width else {}
        for part in ("abs_max,std,norm,rms,nonfinite", "mean,min,max,zero_frac"):
            status, st = s.get("stats", layer="first", stats=part, **query, **window)
            assert status == 200
            for c, (a, b) in enumerate(zip(st["step"], st["step_hi"])):
                at = (steps >= a) & (steps <= b)
                assert st["column_nonfinite"][c] == bool(bad[at].any())
                for k in part.split(","):
                    assert as_float(st[k][c]) == np.nanmax(truth[k][at]), (k, a, b)
    _, st = s.get("stats", layer="first", width=7)
    spike = next(c for c, (a, b) in enumerate(zip(st["step"], st["step_hi"])) if a <= SPIKE <= b)
    assert as_float(st["abs_max"][spike]) == truth["abs_max"][steps == SPIKE][0]
    assert [c for c, b in enumerate(st["column_nonfinite"]) if b] == \
        [c for c, (a, b) in enumerate(zip(st["step"], st["step_hi"])) if a <= NAN_STEP <= b]


def test_a_scalar_logged_once_is_named_apart_from_the_lines(tmp_path, serve):
    model = nn.Linear(2, 2)
    path = str(tmp_path / "run.zarr")
    with Recorder(model, path, capture="activations", tensors_every=None, stats_every=1) as rec:
        for step in range(5):
            with rec.step(step):
                model(torch.ones(1, 2))
                rec.log({"loss": 1.0 / (step + 1)})
        rec.log({"train_runtime": 12.5, "total_flos": 3.0e9})
    _, sc = serve(path).get("scalars")
    assert sorted(sc["once"]) == ["total_flos", "train_runtime"]
    assert sc["series"]["loss"] == {"step": [0, 1, 2, 3, 4], "value": [1.0, 0.5, 1 / 3, 0.25, 0.2]}
    assert sc["series"]["train_runtime"] == {"step": [4], "value": [12.5]}
