"""A default that cannot fill a disk: ``max_bytes="auto"`` and what a budget keeps.

The budget is checked against numbers computed here: the disk's free space from
``shutil.disk_usage`` and the bytes of the tensors the model makes, read back
through ``open_run``.
"""
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortape.analysis import open_run
from tensortape.recorder import Recorder, TensortapeWarning
from tensortape.recorder.errors import ConfigError, LayerNotFoundError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDE = 256                                       # a Linear(16, 256) output at batch 32


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, WIDE))


def _batch(i):
    return torch.randn(32, 16, generator=torch.Generator().manual_seed(i))


def _row():
    return 32 * WIDE * 4                          # bytes of one output (or its gradient)


def test_the_default_budget_is_a_tenth_of_the_free_space_and_is_printed(tmp_path, capfd):
    path = str(tmp_path / "run.zarr")
    want = min(shutil.disk_usage(tmp_path).free // 10, 10 * 10**9)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a default run warns nothing (-W error)
        with Recorder(model, path, tensors_every=1, stats_every=1) as rec:
            with rec.step(0):
                model(_batch(0)).sum().backward()
    err = capfd.readouterr().err
    assert "max_bytes='auto'" in err and path in err
    stored = open_run(path).attrs["config"]["max_bytes"]
    assert abs(stored - want) <= 10**8            # the free space moves a little while it runs
    assert f"{stored / 1e9:.1f} GB" in err or f"{stored / 1e6:.0f} MB" in err


def test_an_explicit_budget_prints_nothing(tmp_path, capfd):
    model = _model()
    with Recorder(model, str(tmp_path / "run.zarr"), max_bytes=None, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            model(_batch(0)).sum().backward()
    assert "max_bytes" not in capfd.readouterr().err


def test_a_small_disk_gets_a_small_budget_statistics_go_on(tmp_path, monkeypatch):
    """A disk with 20 rows free: 2 rows of budget, so step 0's two tensors only."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=20 * _row()))
    path = str(tmp_path / "run.zarr")
    model = _model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Recorder(model, path, layers="0", tensors_every=1, stats_every=1) as rec:
            for i in range(5):
                with rec.step(i):
                    model(_batch(i)).sum().backward()
    run = open_run(path)
    assert run.steps().tolist() == [0, 1, 2, 3, 4]                  # statistics every step
    assert run.steps(tensors=True, layer="0").tolist() == [0]
    assert run.steps("gradients", tensors=True, layer="0").tolist() == [0]
    assert run.attrs["over_budget"] == 8                            # 4 steps x 2 tensors
    budget = [str(w.message) for w in seen if "max_bytes=" in str(w.message)]
    assert len(budget) == 2, budget        # the projection, then the budget reached: once each
    assert "reached in about 2 steps" in budget[0] or "reached in about 1 step," in budget[0]
    assert "every 100 steps" in budget[0]
    assert "reached at step 1" in budget[1]


@pytest.mark.parametrize("nan_at", [3, 6])
def test_past_the_budget_the_nonfinite_dump_still_stores_the_ring(tmp_path, nan_at):
    path = str(tmp_path / "run.zarr")
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(model, path, layers="0", capture="activations", ring=2,
                      on_nonfinite="dump", max_bytes=2 * _row(), tensors_every=1, stats_every=1) as rec:
            for i in range(8):
                x = _batch(i)
                if i == nan_at:
                    x[0, 0] = float("nan")
                with rec.step(i):
                    model(x).sum().backward()
    run = open_run(path)
    # the budget holds steps 0 and 1; the dump stores the ring (the 2 steps before) and
    # the NaN step itself, whatever the budget says
    want = sorted({0, 1, nan_at - 2, nan_at - 1, nan_at})
    assert run.steps(tensors=True, layer="0").tolist() == want
    assert np.isnan(run.tensor("0", step=nan_at).values).sum() == WIDE    # the NaN row
    # the tensors planned at their step but stored by none: the dump took the ring's
    assert run.attrs["over_budget"] == 8 - len(want)


def test_a_bad_budget_is_one_line_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"max_bytes='lots' is not valid; use 'auto'"):
        Recorder(_model(), str(tmp_path / "run.zarr"), max_bytes="lots", tensors_every=1, stats_every=1)


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "plain_train.py")


def _record(tmp_path, *flags):
    store = str(tmp_path / "run.zarr")
    p = subprocess.run([sys.executable, "-m", "tensortape", "record", "--stats-every", "1", "-o", store,
                        "--layers", "0",
                        "--capture", "activations", *flags, "--", "python", SCRIPT, "4"],
                       capture_output=True, text=True, cwd=ROOT)
    return store, p


def test_the_cli_takes_a_budget_and_a_sample_cap(tmp_path):
    row = 16 * 4                                   # one sample of Linear(8, 16)'s output
    store, p = _record(tmp_path, "--tensors-every", "1", "--max-bytes", f"{row * 2 * 2}B",
                       "--max-samples", "2")
    assert p.returncode == 3, p.stderr             # the script's own status
    run = open_run(store)
    assert run.steps().tolist() == [0, 1, 2, 3]
    assert run.steps(tensors=True, layer="0").tolist() == [0, 1]     # 2 steps of 2 samples
    assert run.tensor("0", step=1).shape[-2:] == (2, 16)             # of the batch's 4
    assert run.attrs["over_budget"] == 2
    # the warnings name the flags the user typed, not Python's arguments
    assert "--max-bytes 256 (256 bytes) of full tensors reached at step 2" in p.stderr, p.stderr
    assert "max_bytes=" not in p.stderr and "tensors_every=" not in p.stderr


def test_the_cli_refuses_a_size_it_cannot_read(tmp_path):
    store, p = _record(tmp_path, "--max-bytes", "lots")
    assert p.returncode == 2 and "--max-bytes" in p.stderr and "500MB" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


# --- over_budget is an exact count ---------------------------------------------------
# Of every full tensor due at a step (``tensors_every``) of the latest recording of that
# step, over_budget counts those a reader cannot read.  The oracle asks open_run for each
# one; the schedules mix a budget of a few tensors, a ring, NaN steps and a resume.
LAYERS = ["0", "1", "2"]
KINDS = ("activations", "gradients")


def _small():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _recording(path, steps, nan, mode, **kw):
    model = _small()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")               # the budget's own notices
        with Recorder(model, path, layers=LAYERS, mode=mode, **{"stats_every": 1, **kw}) as rec:
            for i in steps:
                x = _batch(i)[:5, :4].clone()
                if i in nan:
                    x[0, 0] = float("nan")
                with rec.step(i):
                    model(x).sum().backward()


@st.composite
def _schedules(draw):
    rows = 5 * 8 * 4                                 # bytes of the widest tensor (5 x 8 float32)
    out = []
    start, mode = 0, "w-"
    for _ in range(draw(st.integers(1, 2))):         # a first recording, maybe a resume
        n = draw(st.integers(1, 10))
        dump = draw(st.booleans())
        out.append(dict(
            steps=range(start, start + n), mode=mode,
            nan=set(draw(st.lists(st.integers(start, start + n - 1), max_size=3))),
            tensors_every=draw(st.integers(1, 3)), on_nonfinite="dump" if dump else "record",
            ring=draw(st.integers(0, 3)) if dump else 0,
            max_bytes=draw(st.one_of(st.none(), st.integers(rows // 2, 14 * rows)))))
        start, mode = draw(st.integers(0, start + n)), "a"     # a resume from a checkpoint
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(_schedules())
def test_over_budget_counts_exactly_the_due_tensors_a_reader_cannot_read(tmp_path_factory,
                                                                         schedule):
    path = str(tmp_path_factory.mktemp("run") / "run.zarr")
    latest = {}                                      # step -> the tensors_every it was recorded with
    for rec in schedule:
        _recording(path, **rec)
        latest.update({s: rec["tensors_every"] for s in rec["steps"]})
    run = open_run(path)
    unreadable = 0
    for step, every in latest.items():
        if step % every:
            continue
        for layer in LAYERS:
            for kind in KINDS:
                try:
                    run.tensor(layer, kind, step=step)
                except (ConfigError, LayerNotFoundError):
                    unreadable += 1
    assert run.attrs["dropped"] == 0
    assert run.attrs["over_budget"] == unreadable, schedule
