"""Under a strict warning filter (``python -W error``, pytest's ``filterwarnings =
["error"]``) tensortape records what it records otherwise: a plain loop, the Hugging
Face and Lightning callbacks and ``tensortape record``, each checked step by step
against the oracle, with every compiled statistics kernel still compiled.  And
tensortape's own warnings are a class of their own, ``recorder.TensortapeWarning``,
that a user turns into errors or silences apart from everyone else's.
"""
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from tensortape.analysis import open_run
from oracle import STATS, bin_edges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "strict_train.py")
EXACT = ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac")
# what pyproject.toml's filterwarnings lets through: third-party noise, outside tensortape
NOISE = ["ignore:`isinstance(treespec, LeafSpec)` is deprecated:FutureWarning"]


def strict(*args, timeout=600):
    """``python -W error ARGS`` in the repository, its environment cleared of the
    switches that would keep the compiled kernels out."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORTAPE_COMPILE", "TENSORTAPE_ENGINE", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    noise = [a for n in NOISE for a in ("-W", n)]
    return subprocess.run([sys.executable, "-W", "error", *noise, *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


def check_against_oracle(store, out):
    """Every step's statistics, histograms and events against the oracle's."""
    with open(out) as f:
        want = json.load(f)
    assert want["compiled_kept"] is True          # compiled, and never demoted
    run = open_run(store)
    assert run.status == "complete"
    assert run.layers == want["names"]
    assert run.dropped == want["dropped"] == 0
    lo, hi = bin_edges()
    tables = {kind: run.stats(kind).compute() for kind in run.kinds}
    keys = {(step, kind, name) for step, kind, name, _ in want["stats"]}
    for kind, ds in tables.items():               # no step or layer the oracle lacks
        assert {(int(s), kind, n) for s in ds.step.values for n in ds.layer.values
                if int(ds["count"].sel(step=s, layer=n)) != -1} == \
            {k for k in keys if k[1] == kind}, kind
    for step, kind, name, stats in want["stats"]:
        row = tables[kind].sel(step=step, layer=name)
        for stat in STATS:
            got, expect = float(row[stat]), stats[stat]
            what = (step, kind, name, stat)
            if np.isnan(expect):
                assert np.isnan(got), (what, got)
            elif stat in EXACT:
                assert got == expect, (what, got, expect)
            else:     # float64 sums: to 1e-9 of the values' scale (a mean may cancel)
                scale = max(abs(expect), stats["abs_max"])
                assert abs(got - expect) <= 1e-9 * scale, (what, got, expect)
    for step, kind, name, counts in want["hists"]:
        h = run.histogram(name, kind, step=step)
        np.testing.assert_array_equal(h.bin_lo.values, lo)
        np.testing.assert_array_equal(h.bin_hi.values, hi)
        np.testing.assert_array_equal(h.values, 0 if counts is None else counts,
                                      err_msg=f"{step} {kind} {name}")
    events = [[e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf] for e in run.events]
    assert events == want["events"]
    return run, want


def test_a_plain_loop_under_W_error_records_what_the_oracle_sees(tmp_path):
    store, out = str(tmp_path / "run.zarr"), str(tmp_path / "want.json")
    p = strict(SCRIPT, "plain", out, store)
    assert p.returncode == 0, p.stderr[-3000:]
    run, want = check_against_oracle(store, out)
    assert run.steps(tensors=True).tolist() == [0, 1, 2, 3]  # tensors_every=2, the NaN step and its ring of 2
    assert want["events"] and run.first_nonfinite().replay["op"] == "aten::div.Tensor"


def test_the_hugging_face_trainer_under_W_error_records_what_the_oracle_sees(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    store, out = str(tmp_path / "hf.zarr"), str(tmp_path / "want.json")
    p = strict(SCRIPT, "hf", out, store)
    assert p.returncode == 0, p.stderr[-3000:]
    run, want = check_against_oracle(store, out)
    assert run.steps().tolist() == [0, 1, 2, 3]
    assert run.attrs["outside_steps"] == want["outside"] > 0       # the evaluations ran


def test_lightning_under_W_error_records_what_the_oracle_sees(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    store, out = str(tmp_path / "pl.zarr"), str(tmp_path / "want.json")
    p = strict(SCRIPT, "lightning", out, store)
    assert p.returncode == 0, p.stderr[-3000:]
    run, _ = check_against_oracle(store, out)
    assert run.steps().tolist() == [0, 1, 2, 3]


def test_tensortape_record_under_W_error_records_what_the_oracle_sees(tmp_path):
    store, out = str(tmp_path / "rec.zarr"), str(tmp_path / "want.json")
    p = strict(os.path.join(ROOT, "cli.py"), "record", "--stats-every", "1", "-o", store, "--", "python", SCRIPT,
               "bare", out)
    assert p.returncode == 0, p.stderr[-3000:]
    run, want = check_against_oracle(store, out)
    assert run.steps().tolist() == [0, 1, 2, 3]
    assert run.attrs["outside_steps"] == want["outside"] == 4


OUTSIDE = textwrap.dedent("""
    import sys, warnings
    import torch
    from tensortape.recorder import Recorder, TensortapeWarning
    {setup}
    model = torch.nn.Linear(4, 4)
    with Recorder(model, sys.argv[1], tensors_every=None, mode="w", stats_every=1) as rec:
        with rec.step(0):
            model(torch.randn(2, 4)).sum().backward()
        try:
            model(torch.randn(2, 4))               # outside a step: outside_step="warn"
        except TensortapeWarning as e:
            print("RAISED", e)
        with rec.step(1):
            model(torch.randn(2, 4)).sum().backward()
        print("TRAINED")
""")


def outside(tmp_path, *cases):
    """Each case (a setup line, then interpreter flags) run as its own interpreter, all at
    once; their finished processes (``stdout``, ``stderr``), in order."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = []
    for i, (setup, *flags) in enumerate(cases):
        store = str(tmp_path / f"out{i}.zarr")
        procs.append((store, subprocess.Popen(
            [sys.executable, *flags, "-c", OUTSIDE.format(setup=setup), store],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)))
    done = []
    for store, proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "TRAINED" in out and open_run(store).steps().tolist() == [0, 1]
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_tensortape_warnings_are_their_own_class_to_raise_or_silence(tmp_path):
    raised, ignored, default, prefix, prefix_ignored = outside(
        tmp_path,
        ('warnings.filterwarnings("error", category=TensortapeWarning)',),
        ('warnings.filterwarnings("ignore", category=TensortapeWarning)', "-W", "error"),
        ("",),                                            # Python's default filters
        ("", "-W", "error:tensortape"),   # on the command line, -W names builtin categories
        ("", "-W", "error", "-W", "ignore:tensortape"))   # only: the message prefix
    # raised where the user's code called tensortape, on the training thread
    assert "RAISED tensortape: the recorded model ran outside a step" in raised.stdout
    assert "ran outside a step" not in raised.stderr
    assert "RAISED" not in ignored.stdout and "outside a step" not in ignored.stderr
    assert "RAISED" not in default.stdout and default.stderr.count(
        "TensortapeWarning: tensortape: the recorded model ran outside") == 1   # shown once
    assert "RAISED tensortape:" in prefix.stdout
    assert "RAISED" not in prefix_ignored.stdout and "outside a step" not in prefix_ignored.stderr


@pytest.mark.filterwarnings("error::recorder.TensortapeWarning")
def test_pytest_filterwarnings_can_name_the_class(tmp_path):
    import torch
    from tensortape.recorder import Recorder, TensortapeWarning
    model = torch.nn.Linear(4, 4)
    with Recorder(model, str(tmp_path / "r.zarr"), tensors_every=None, stats_every=1) as rec:
        with pytest.raises(TensortapeWarning, match="outside a step"):
            model(torch.randn(2, 4))
        with rec.step(0):
            model(torch.randn(2, 4)).sum().backward()
    assert open_run(str(tmp_path / "r.zarr")).steps().tolist() == [0]


def test_a_tensortape_warning_made_an_error_never_loses_the_step(tmp_path, monkeypatch):
    """The statistics of a step's tiny tensors fail: under a filter that makes
    tensortape's warnings errors, the warning is raised once, where the loop
    called tensortape, and every step still reaches the store, the failure counted."""
    import torch
    from tensortape.recorder import Recorder, TensortapeWarning
    from tensortape.recorder.capture import _engines

    def broken(self, xs, exp_bits):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(_engines.CpuEngine, "reduce_many", broken)
    monkeypatch.setenv("TENSORTAPE_ENGINE", "torch")      # the torch kernels, not numba's
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    store, raised = str(tmp_path / "r.zarr"), []
    with warnings.catch_warnings():
        warnings.simplefilter("error", TensortapeWarning)
        with Recorder(model, store, tensors_every=None, stats_every=1) as rec:
            for i in range(3):
                try:
                    scope = rec.step(i)
                except TensortapeWarning as e:        # told when the next step begins
                    raised.append(str(e))
                    scope = contextlib.nullcontext()   # ... which is open all the same
                try:
                    with scope:
                        model(torch.randn(2, 4)).sum().backward()   # never raises here
                except TensortapeWarning as e:        # told when the step ends
                    raised.append(str(e))
    assert len(raised) == 1 and "injected failure" in raised[0], raised
    run = open_run(store)
    assert run.steps().tolist() == [0, 1, 2] and run.status == "complete"
    reasons = run.attrs["drop_reasons"]
    failed = sum(n for r, n in reasons.items() if "injected failure" in r)
    assert failed == 3 * 8, reasons        # 4 outputs, (root) included, and their gradients



def test_a_layer_absent_at_a_step_reads_under_a_strict_filter(tmp_path):
    """Counts of a layer that did not run at a step read as -1, not as a cast of
    NaN (which numpy warns of: an error here)."""
    import torch
    from tensortape.recorder import Recorder

    class Skips(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x, use_b):
            x = self.a(x)
            return self.b(x) if use_b else x

    model, store = Skips(), str(tmp_path / "r.zarr")
    with Recorder(model, store, layers=["a", "b"], tensors_every=None, stats_every=1) as rec:
        for i in range(3):
            with rec.step(i):
                model(torch.randn(3, 4), use_b=i != 1).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        counts = open_run(store).stats().compute()["count"]
    assert counts.sel(layer="b").values.tolist() == [12, -1, 12]
    assert counts.sel(layer="a").values.tolist() == [12, 12, 12]


def test_a_killed_writers_temporary_file_never_stops_reading(tmp_path):
    """zarr warns of a file it does not know in a store (a killed writer's
    temporary file); under a strict filter ``open_run`` reads the run all the same."""
    import torch
    from tensortape.recorder import Recorder
    model, store = torch.nn.Linear(4, 4), str(tmp_path / "r.zarr")
    with Recorder(model, store, tensors_every=None, stats_every=1) as rec:
        with rec.step(0):
            model(torch.randn(3, 4)).sum().backward()
    with open(os.path.join(store, "zarr.0123456789abcdef0123456789abcdef.partial"), "w") as f:
        f.write("{")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = open_run(store)
        assert run.steps().tolist() == [0] and run.stats().compute()["count"].values.tolist() == [[12]]
