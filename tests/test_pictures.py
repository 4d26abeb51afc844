"""Pictures whose shape is the data's (issue 32).

Known samples (numpy) go through the public Recorder into a store; the public
plot API draws them; the drawn bars are read back from the Axes and checked
against the density of the samples themselves (exactly) and against the true
density of the distribution they were drawn from (within sampling error).
Small multiples are laid out by matplotlib's renderer and their titles'
boxes compared."""

import math
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder

N = 100_000
RNG = np.random.default_rng(32)


def _phi(x, mu=0.0, sd=1.0):
    return 0.5 * (1 + np.vectorize(math.erf)((np.asarray(x, float) - mu) / (sd * math.sqrt(2))))


def _lognormal_cdf(x):
    x = np.asarray(x, float)
    return np.where(x > 0, _phi(np.log(np.maximum(x, 1e-300))), 0.0)


# name: (samples, the true CDF of their finite nonzero part, its share of all values)
CASES = OrderedDict(
    normal=(RNG.normal(0, 1, N), _phi, 1.0),
    mixture=(np.concatenate([RNG.normal(-2, 0.5, N // 2), RNG.normal(1.5, 0.8, N // 2)]),
             lambda x: 0.5 * _phi(x, -2, 0.5) + 0.5 * _phi(x, 1.5, 0.8), 1.0),
    lognormal=(RNG.lognormal(0, 1, N), _lognormal_cdf, 1.0),
    spike=(np.where(RNG.random(N) < 0.4, 0.0, RNG.normal(0, 0.6, N)),
           lambda x: _phi(x, 0, 0.6), 0.6),
)


class Feed(nn.Module):
    """A layer whose output is its input: what it records is what we feed it."""

    def forward(self, x):
        return x * 1.0


def _record(path, arrays):
    model = Feed()
    with Recorder(model, path, layers="", capture="activations", tensors_every=None, stats_every=1) as rec:
        for i, a in enumerate(arrays):
            with rec.step(i):
                model(torch.from_numpy(np.asarray(a, np.float32)))
    return open_run(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    extra = [np.zeros(1000), np.full(1000, 0.5),
             np.concatenate([RNG.normal(0, 1, 5000), [np.nan] * 7, [np.inf] * 3])]
    return _record(str(tmp_path_factory.mktemp("pics") / "cases.zarr"),
                   [c[0] for c in CASES.values()] + extra)


def _bars(ax):
    rects = [r for c in ax.containers for r in c]
    lo = np.array([r.get_x() for r in rects])
    return lo, lo + np.array([r.get_width() for r in rects]), np.array([r.get_height() for r in rects])


def _drawn_coordinate(ax, x):
    """Where values ``x`` sit on the axis: the value itself on a linear axis; on a
    symmetric-log axis, decades (log10) beyond its linear threshold."""
    if ax.get_xscale() == "linear":
        return np.asarray(x, float)
    return np.sign(x) * np.log10(np.abs(x))


@pytest.mark.parametrize("scale", ["linear", "symlog"])
@pytest.mark.parametrize("case", list(CASES))
def test_bars_are_the_density_of_the_values_drawn(run, case, scale):
    samples, cdf, share = CASES[case]
    x = np.asarray(samples, np.float32).astype(float)
    fig = run.plot_histogram("(root)", steps=list(CASES).index(case), scale=scale)
    ax = fig.axes[0]
    lo, hi, height = _bars(ax)
    assert lo.size > 10 and np.all(hi > lo) and np.all(lo[1:] >= hi[:-1] - 1e-12)  # disjoint
    assert ax.get_xscale() == scale
    assert ("linear" if scale == "linear" else "symmetric-log") in ax.get_xlabel()
    assert ("per unit of value" if scale == "linear" else "per decade") in ax.get_ylabel()
    v = x[x != 0][:, None]                               # exact zeros: a point mass, not a bar
    count = (((v >= lo) & (v < hi)) | ((v == hi) & (hi == x.max()))).sum(axis=0)
    assert count.sum() == v.size                         # every nonzero value in one bar
    if scale == "linear":
        width = hi - lo
    else:                                                # bars beyond the linear part
        lt = ax.xaxis.get_transform().linthresh
        keep = (lo >= lt) | (hi <= -lt)
        lo, hi, height, count = lo[keep], hi[keep], height[keep], count[keep]
        width = np.abs(_drawn_coordinate(ax, hi) - _drawn_coordinate(ax, lo))
        assert keep.sum() > 10
    np.testing.assert_allclose(height, count / (N * width), rtol=1e-9)      # the samples'
    p = share * (cdf(hi) - cdf(lo))                                          # the truth
    sd = np.sqrt(np.maximum(p * (1 - p), 1 / N) / N) / width
    assert np.all(np.abs(height - p / width) <= 5 * sd), case


def test_a_gaussian_is_one_bell_on_the_default_axis(run):
    lo, hi, height = _bars(run.plot_histogram("(root)", steps=0).axes[0])
    top = np.argmax(height)
    assert lo[top] <= 0.3 and hi[top] >= -0.3
    assert np.all(np.diff(height[:top + 1]) > -0.02) and np.all(np.diff(height[top:]) < 0.02)


def test_exact_zeros_are_a_marked_point_mass_not_a_bar(run):
    x = CASES["spike"][0].astype(np.float32)
    ax = run.plot_histogram("(root)", steps=3).axes[0]
    lo, hi, height = _bars(ax)
    assert np.isclose((height * (hi - lo)).sum(), (x != 0).mean(), rtol=1e-9)
    zero = [t.get_text() for t in ax.get_legend().get_texts() if "exactly 0" in t.get_text()]
    assert zero and f"{int((x == 0).sum()):,} values" in zero[0]
    assert [ln.get_xdata()[0] for ln in ax.get_lines()] == [0]


@pytest.mark.parametrize("step,value", [(4, 0.0), (5, 0.5)])
def test_a_step_of_one_value_draws_without_warnings(run, step, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = run.plot_histogram("(root)", steps=step)
        FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert lo < value < hi and not ax.containers
    assert "exactly" in ax.get_legend().get_texts()[0].get_text()


def test_nonfinite_values_are_counted_beside_never_as_values(run):
    fig = run.plot_histogram("(root)", steps=6)
    ax, side = fig.axes
    assert [round(r.get_height()) for r in side.patches] == [7, 3, 0]
    lo, hi, height = _bars(ax)
    assert np.isclose((height * (hi - lo)).sum(), 1.0) and np.isfinite(hi).all()
    clean = run.plot_histogram("(root)", steps=0).axes[1]
    assert not clean.patches and not clean.get_lines()   # nothing to strike "none" through
    assert "none" in [t.get_text() for t in clean.texts]


def test_plot_command_takes_the_scale(run, tmp_path):
    from tensortape.cli import cli
    out = tmp_path / "h.png"
    for args in (["--scale", "symlog"], ["--step", "4"], ["--counts"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r = CliRunner().invoke(cli, ["plot", run.path, "--layer", "(root)", "-o", str(out)]
                                   + args)
        assert r.exit_code == 0, r.output
        assert out.read_bytes()[:4] == b"\x89PNG"
    r = CliRunner().invoke(cli, ["plot", run.path, "--layer", "(root)", "--scale", "log",
                                  "-o", str(out)])
    assert r.exit_code == 2 and "'log' is not one of" in r.output


# --- small multiples ---------------------------------------------------------------
LONG = "self_attention_output_projection_after_the_residual_branch"


class Deep(nn.Module):
    """40 layers with long names, feeding their input through; some go NaN."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleDict(
            {"layers": nn.ModuleList([nn.ModuleDict({LONG: Feed()}) for _ in range(40)])})

    def forward(self, x, bad=()):
        for i, layer in enumerate(self.encoder["layers"]):
            layer[LONG](x + float("nan") if i in bad else x)
        return x


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    model = Deep()
    path = str(tmp_path_factory.mktemp("deep") / "deep.zarr")
    with Recorder(model, path, layers=f"encoder.layers.*.{LONG}", capture="activations",
                  tensors_every=None, stats_every=1) as rec:
        for step in range(8):
            with rec.step(step):
                model(torch.randn(16), bad={1, 7, 12} if step >= 5 else ())
    return open_run(path)


def _titles(ax):
    return [c for c in ax.get_children() if isinstance(c, Text) and c.get_text()
            and c.get_text() in (ax.get_title("left"), ax.get_title(), ax.get_title("right"))]


def _overlap(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """24 layers whose std moves in its sixth digit (a log axis over it labels every tick
    with all its digits); 23 of them go NaN at step 30."""
    model = Deep()
    path = str(tmp_path_factory.mktemp("narrow") / "narrow.zarr")
    base = torch.from_numpy(RNG.normal(0, 0.3, 64).astype(np.float32))
    with Recorder(model, path, layers=f"encoder.layers.*.{LONG}", capture="activations",
                  tensors_every=None, stats_every=1) as rec:
        for step in range(50):
            with rec.step(step):
                model(base * (1 + 1e-5 * (step % 7)), bad=set(range(1, 24)) if step >= 30 else ())
    return open_run(path)


@pytest.mark.parametrize("panels", [1, 2, 7, 8, 13, 24, 40])
def test_small_multiples_titles_are_whole_and_never_collide(deep, panels):
    _titles_whole_and_apart(deep, deep.layers[:panels], "abs_max")


def test_small_multiples_of_values_within_a_decade_keep_their_titles_whole(narrow):
    _titles_whole_and_apart(narrow, narrow.layers[:24], "std")


def _titles_whole_and_apart(run, names, stat):
    """Every title (the full names, wrapped) inside the figure, apart from each other
    and from every other panel, as the renderer lays them out."""
    fig = run.plot_evolution(layers=names, stat=stat)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    axes = [a for a in fig.axes if a.get_visible()]
    shown = " ".join(t.get_text().replace("\n", "") for a in axes for t in _titles(a))
    shown += " ".join(t.get_text() for a in axes if a.get_legend() for t in a.get_legend().get_texts())
    assert all(name in shown for name in names)                    # full names
    boxes = [(a, t.get_window_extent(renderer)) for a in axes for t in _titles(a)]
    if fig._suptitle is not None:
        boxes.append((None, fig._suptitle.get_window_extent(renderer)))
    parts = {b: [p for p in (b.get_window_extent(renderer), b.xaxis.get_tightbbox(renderer),
                             b.yaxis.get_tightbbox(renderer)) if p is not None and p.width]
             for b in axes}                   # each axis's boxes, measured once
    for a, box in boxes:
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1
        for b, other in boxes:
            assert b is a or not _overlap(box, other)
        for b in axes:
            if b is not a:
                for part in parts[b]:
                    assert not _overlap(box, part)


def test_nonfinite_steps_are_never_drawn_as_values(deep):
    ds = deep.stats("activations").compute()
    bad = (ds.nan + ds.posinf + ds.neginf).values > 0             # (step, layer)
    for panels in (3, 13):
        fig = deep.plot_evolution(layers=deep.layers[:panels], stat="abs_max")
        lines = [ln for a in fig.axes for ln in a.get_lines()]
        assert not [ln for ln in lines if ln.get_marker() in ("x", "X")]
        for ln in lines:
            if ln.get_label().split("\n")[0] in deep.layers:
                i = deep.layers.index(ln.get_label().split("\n")[0])
                assert np.isnan(np.asarray(ln.get_ydata(), float)[bad[:, i]]).all()
