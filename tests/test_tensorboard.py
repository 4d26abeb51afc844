"""`tensortape export RUN DIR --format tensorboard`: TensorBoard's own reader
(EventAccumulator) reads back what open_run reads (bin edges, counts, statistics,
NaN/Inf counts, scalars)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import nn

from tensortape import cli
from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from tensortape.recorder import format as fmt

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Spike(nn.Module):
    def forward(self, x):
        return torch.where(x > 1.5, torch.full_like(x, float("nan")), x)   # NaN at some steps


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tb") / "run.zarr")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), Spike(), nn.Linear(8, 2))
    with Recorder(m, path, max_bytes=None, tensors_every=None, stats_every=1) as rec:
        for i in range(5):
            with rec.step(i):
                loss = m(torch.randn(6, 4) * (i + 1)).pow(2).mean()
                loss.backward()
                rec.log({"loss": loss, "lr": 0.5 ** i})
    return path


def read(folder):
    ea = EventAccumulator(folder, size_guidance={"histograms": 0, "scalars": 0})
    ea.Reload()
    return ea


def test_event_files_hold_open_runs_numbers(store, tmp_path):
    out = str(tmp_path / "tb")
    r = CliRunner().invoke(cli.cli, ["export", store, out, "--format", "tensorboard"])
    assert r.exit_code == 0, r.output
    run, ea = open_run(store), read(out)
    nonfinite = 0
    for kind in run.kinds:
        stats = run.stats(kind).compute()
        for layer in stats.layer.values.tolist():
            tag = f"{kind}/{layer}"
            hist = run.histogram(layer, kind).values
            events = {e.step: e.histogram_value for e in ea.Histograms(tag)}
            for j, step in enumerate(stats.step.values.tolist()):
                counts = hist[j]
                held = np.nonzero(counts > 0)[0]
                if not len(held):
                    assert step not in events
                    continue
                h = events[step]
                a, b = held[0], held[-1] + 1
                assert np.all(np.diff(h.bucket_limit) > 0)                  # as TensorBoard needs
                assert h.bucket == [0, *counts[a:b]]
                assert h.num == counts.sum()
                for s in fmt.STATS:                                         # as float32
                    got = [e.value for e in ea.Scalars(f"{tag}/{s}") if e.step == step]
                    want = np.float32(stats[s].sel(layer=layer, step=step).values)
                    np.testing.assert_array_equal(np.float32(got), [want], err_msg=f"{tag} {s}")
                nonfinite += int(stats["nan"].sel(layer=layer, step=step))
    assert nonfinite > 0                                                   # NaN counts exported
    ds = run.scalars()
    for name in ("loss", "lr"):
        got = [(e.step, np.float32(e.value)) for e in ea.Scalars(f"scalars/{name}")]
        assert [s for s, _ in got] == ds.step.values.tolist()        # a NaN loss included
        np.testing.assert_array_equal([v for _, v in got], np.float32(ds[name].values))


def test_an_existing_export_is_refused_without_force_and_torch_is_not_imported(store, tmp_path):
    out = str(tmp_path / "tb")
    code = ("import sys, cli\n"
            "try:\n"
            f"    cli.main(['export', {store!r}, {out!r}, '--format', 'tensorboard'])\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    r = CliRunner().invoke(cli.cli, ["export", store, out, "--format", "tensorboard"])
    assert r.exit_code == 2 and "--force" in r.output
    r = CliRunner().invoke(cli.cli, ["export", store, out, "--format", "tensorboard", "--force"])
    assert r.exit_code == 0
    assert len([f for f in os.listdir(out) if f.startswith("events.out.tfevents.")]) == 1


def test_without_tensorboard_the_export_says_what_to_install(store, tmp_path):
    code = ("import sys; sys.modules['tensorboard'] = None; import cli; "
            f"cli.main(['export', {store!r}, {str(tmp_path / 'tb')!r}, '--format', 'tensorboard'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install tensorboard" in lines[0], p.stderr


# values at the bins' edges (both signs, zero, the underflow and overflow bins) and any others
EDGES = [0.0, -0.0, 1.0, -1.0, 0.75, -0.75, 1.25, -1.25, 2.0 ** -64, -2.0 ** -64, 2.0 ** 64,
         -2.0 ** 64, 1e-45, -1e-45, 1e-30, -1e-30, 3e38, -3e38]
values = st.one_of(st.sampled_from(EDGES), st.floats(width=32))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(arrays(np.float32, st.integers(1, 16), elements=values), min_size=1,
                      max_size=3))
@example(steps=[np.array(EDGES, np.float32), np.array([0.0, 0.5], np.float32),
                np.array([-0.0, -1.0], np.float32)])
def test_each_value_lies_in_the_bucket_of_its_bin(steps, tmp_path_factory):
    """By TensorBoard's rule (a bucket holds the values from the previous limit up to, not
    including, its own: TensorFlow's Histogram::Add), each recorded value lies in a
    bucket whose count is its bin's, and the limits strictly increase."""
    tmp = tmp_path_factory.mktemp("tbv")
    store, out = str(tmp / "run.zarr"), str(tmp / "tb")
    m = nn.Sequential(nn.Identity())
    with Recorder(m, store, layers="0", capture=("activations",), tensors_every=None,
                  max_bytes=None, stats_every=1) as rec:
        for i, x in enumerate(steps):
            with rec.step(i):
                m(torch.from_numpy(x))
    assert CliRunner().invoke(cli.cli, ["export", store, out, "--format", "tensorboard"]
                              ).exit_code == 0
    run = open_run(store)
    events = {e.step: e.histogram_value for e in read(out).Histograms("activations/0")}
    for i, x in enumerate(steps):
        finite = x[np.isfinite(x)].astype(np.float64)
        if not len(finite):
            assert i not in events
            continue
        h = events[i]
        limits = np.array(h.bucket_limit)
        assert np.all(np.diff(limits) > 0), limits
        bucket = np.searchsorted(limits, finite, side="right")      # the first limit above
        assert bucket.min() >= 1 and bucket.max() < len(limits)     # none in the empty first
        np.testing.assert_array_equal(np.bincount(bucket, minlength=len(limits)), h.bucket)
        held = run.histogram("0").sel(step=i).values                 # the run's histogram
        np.testing.assert_array_equal(held[held > 0], np.array(h.bucket)[np.array(h.bucket) > 0])
