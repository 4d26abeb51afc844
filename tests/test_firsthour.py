"""A user's first hour at the command line (issue 32): flags that conflict or do
nothing, messages in the words the user typed, compare of runs that are not
alike, migrate's protection, JSON's NaN, the gradient order, the HDF5 export
read without tensortape, and `info` after a kill.  Oracles: plain numpy and the
models' own shapes and names."""

import json
import os
import signal
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
from tensortape.analysis import compare_runs, open_run
from tensortape.recorder import Recorder
from tensortape.recorder.errors import ConfigError, StoreExistsError
from tensortape.sample_runs.task import Sorter, record as record_demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def invoke(*args):
    return CliRunner().invoke(cli.cli, [str(a) for a in args], prog_name="tensortape")


class MLP(nn.Module):
    def __init__(self, out=10):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.head = nn.Linear(16, out)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))


def _record_mlp(path, out=10, batch=(64, 12), steps=3, nan_at=None):
    torch.manual_seed(0)
    model = MLP(out)
    with Recorder(model, str(path), tensors_every=1, stats_every=1) as rec:
        for i in range(steps):
            with rec.step(i):
                x = torch.randn(*batch, 6)
                if nan_at is not None and i >= nan_at:
                    x[0] = float("nan")            # a whole row: fc1's first row all NaN
                model(x).sum().backward()
    return str(path), model


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return record_demo(str(tmp_path_factory.mktemp("demo") / "demo.zarr"), steps=3,
                       log=lambda s: None)


# --- 3. flags that conflict or do nothing ---------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["stats", "{run}", "--step", "1", "--steps", "0:2"], "--step and --steps conflict"),
    (["plot", "{run}", "--layer", "head", "--type", "evolution", "--step", "1"],
     "--step applies to --type histogram only"),
    (["plot", "{run}", "--layer", "head", "--type", "histogram", "--stat", "mean"],
     "--stat applies to --type evolution only"),
    (["plot", "{run}", "--layer", "head", "--type", "distribution", "--density"],
     "--density applies to --type histogram only"),
    (["plot", "{run}", "--layer", "head", "--steps", "0:2"],
     "--steps applies to --type evolution|distribution only"),
])
def test_flags_that_conflict_or_do_nothing_are_one_line_and_exit_2(tmp_path, args, words):
    run, _ = _record_mlp(tmp_path / "run.zarr")
    out = tmp_path / "x.png"
    r = invoke(*[a.format(run=run) for a in args], *(["-o", out] if args[0] == "plot" else []))
    assert r.exit_code == 2 and words in r.output and len(r.output.strip().splitlines()) == 1, \
        r.output
    assert not out.exists()
    ok = invoke("plot", run, "--layer", "head", "--type", "evolution", "--stat", "mean",
                "-o", out)                                   # the flag where it applies
    assert ok.exit_code == 0 and out.exists(), ok.output


@pytest.mark.parametrize("policy", ["dump", "raise", "replay", "record"])
def test_a_ring_that_no_dump_would_store_is_refused_by_its_values(tmp_path, policy):
    """ring=N keeps copies of every tensor for a non-finite dump: under a policy that
    never dumps it is refused in one line naming both arguments and the fixes, in
    Python's words or the command line's, whichever values are given or defaulted."""
    path = tmp_path / "r.zarr"
    if policy != "record":
        Recorder(MLP(), path, ring=3, on_nonfinite=policy).close()      # a ring to dump
        return
    for kw in (dict(ring=3, on_nonfinite="record"),):
        with pytest.raises(ConfigError) as e:
            Recorder(MLP(), path, **kw)
        msg = str(e.value)
        assert "\n" not in msg and "--" not in msg
        for words in ("ring=3", "on_nonfinite='record'", "on_nonfinite='dump'", "ring=0"):
            assert words in msg, msg
    Recorder(MLP(), path, on_nonfinite="record").close()      # no ring: nothing to refuse
    r = invoke("record", "-o", path, "--ring", "3", "--on-nonfinite", "record", "--",
               sys.executable, "-c", "1")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    for words in ("--ring 3", "--on-nonfinite record", "--on-nonfinite dump", "--ring 0"):
        assert words in r.output, r.output
    assert "ring=" not in r.output and not path.exists()
    pl = pytest.importorskip("lightning.pytorch")
    from tensortape.recorder.integrations import LightningCallback
    with pytest.raises(ConfigError, match="on_nonfinite='record' never"):
        LightningCallback(str(path), ring=3, on_nonfinite="record")                 # at construction, not mid-fit
    assert pl and not path.exists()


# --- 4. arguments named as the user wrote them --------------------------------------
def test_an_existing_run_names_the_flag_under_the_cli_and_the_argument_in_python(tmp_path):
    run, _ = _record_mlp(tmp_path / "run.zarr")
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    r = invoke("record", "-o", run, "--", sys.executable, script)
    assert r.exit_code == 2 and "pass --mode w to overwrite" in r.output
    assert "mode=" not in r.output
    with pytest.raises(StoreExistsError, match=r"pass mode='w' to overwrite") as e:
        Recorder(MLP(), run, tensors_every=1).attach()
    assert "--mode" not in str(e.value)


# --- 2. compare runs that are not alike -----------------------------------------------
def test_compare_an_mlp_with_the_demo_transformer_compares_only_the_alike_head(tmp_path, demo):
    mlp, model = _record_mlp(tmp_path / "mlp.zarr", out=10)     # head: (64, 12, 10) as the demo's
    demo_shape = tuple(open_run(demo).tensor("head", step=0).shape)
    assert demo_shape == (64, 12, 10)
    with pytest.warns(Warning) as w:
        ds = compare_runs(mlp, demo)
    text = " ".join(str(x.message) for x in w)
    assert f"model classes differ ({type(model).__name__} vs {Sorter.__name__})" in text
    assert "fc1" in text and "only in" in text
    assert list(ds.layer.values) == ["head"]                     # fc1, (root), embed...: not
    a = open_run(mlp).tensor("head", step=0).values.astype(np.float64)
    b = open_run(demo).tensor("head", step=0).values.astype(np.float64)
    rel = np.linalg.norm(b - a) / np.linalg.norm(a)
    assert float(ds["rel_l2"].sel(step=0, layer="head")) == pytest.approx(rel, rel=1e-9)
    r = invoke("compare", mlp, demo)
    assert r.exit_code == 1 and "warning:" in r.output and "not alike" in r.output
    assert invoke("compare", mlp, demo, "--strict").exit_code == 2


def test_compare_of_a_shared_name_of_another_shape_refuses(tmp_path, demo):
    mlp, _ = _record_mlp(tmp_path / "mlp.zarr", out=3, batch=(4,))
    r = invoke("compare", mlp, demo)
    want = f"head: {4 * 3} and {64 * 12 * 10} elements"          # the models' own shapes
    assert r.exit_code == 2 and want in r.output and "rel_l2" not in r.output, r.output
    s = invoke("compare", mlp, demo, "--strict")
    assert s.exit_code == 2 and "refused (strict)" in s.output and want in s.output


def test_compare_of_unrelated_models_says_so_in_one_short_line(tmp_path, demo):
    mlp, model = _record_mlp(tmp_path / "mlp.zarr", out=3, batch=(4,))
    r = invoke("compare", mlp, demo)
    line = r.output.strip()
    assert r.exit_code == 2 and len(line.splitlines()) == 1 and len(line) < 450, line
    assert f"not comparable: model classes differ ({type(model).__name__} vs {Sorter.__name__})" \
        in line and "share no recorded layer" in line
    mine = {n for n, _ in model.named_modules() if n} | {"(root)"}
    only = [n for n in open_run(demo).layers if n not in mine]     # the demo's own names
    assert f"{len(only)} only in demo.zarr: {only[0]}, {only[1]} and {len(only) - 2} more" in line
    assert all(line.count(n) <= 1 for n in only + ["fc1"])         # each name once at most


# --- 5. migrate -----------------------------------------------------------------------
def test_migrate_protects_its_output_and_refuses_a_current_store(tmp_path, monkeypatch):
    run, _ = _record_mlp(tmp_path / "run.zarr")
    r = invoke("migrate", run, tmp_path / "new.zarr")
    assert r.exit_code == 2 and "already in format 3" in r.output
    assert not (tmp_path / "new.zarr").exists()
    h5 = str(tmp_path / "run.h5")
    open_run(run).to_hdf5(h5)
    assert invoke("migrate", h5, tmp_path / "back.zarr").exit_code == 0
    want = open_run(run).stats("gradients").compute()
    assert open_run(str(tmp_path / "back.zarr")).stats("gradients").compute().equals(want)
    again = invoke("migrate", h5, tmp_path / "back.zarr")
    assert again.exit_code == 2 and "pass --mode w" in again.output
    assert invoke("migrate", h5, tmp_path / "back.zarr", "--mode", "w").exit_code == 0
    # a copy that fails half way leaves nothing: no folder it made, nothing in one it found
    import tensortape.analysis._migrate as m
    real, calls = m._table, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) > 2:
            raise AttributeError("simulated failure")
        return real(*a, **k)
    monkeypatch.setattr(m, "_table", failing)
    assert invoke("migrate", h5, tmp_path / "half.zarr").exit_code == 2
    assert not (tmp_path / "half.zarr").exists()
    (tmp_path / "empty").mkdir()
    calls.clear()
    assert invoke("migrate", h5, tmp_path / "empty").exit_code == 2
    assert os.listdir(tmp_path / "empty") == []


# --- 6. details -----------------------------------------------------------------------
def test_json_writes_nan_and_inf_as_strings(tmp_path):
    run, _ = _record_mlp(tmp_path / "run.zarr", batch=(1,), nan_at=1)   # every value NaN
    r = invoke("stats", run, "--layer", "fc1", "--format", "json")
    assert r.exit_code == 0
    rows = {row["step"]: row for row in json.loads(r.output)}
    st = open_run(run).stats(layers=["fc1"]).compute()
    for step, row in rows.items():
        for k in ("mean", "max", "norm"):
            v = float(st[k].sel(step=step, layer="fc1"))
            want = "nan" if np.isnan(v) else ("inf" if v == np.inf else v)
            assert row[k] == want
    assert rows[1]["mean"] == "nan" and rows[0]["mean"] != "nan"
    assert isinstance(rows[1]["nan"], int)


def test_gradient_statistics_in_execution_order(tmp_path):
    run, model = _record_mlp(tmp_path / "run.zarr", batch=(4,))
    forward = [n or "(root)" for n, _ in model.named_modules()]       # fc1, head, root
    order = ["fc1", "head", "(root)"]
    assert sorted(order) == sorted(forward)
    r = open_run(run)
    assert r.layers == order
    assert list(r.stats("gradients").layer.values) == order
    assert list(r.stats("activations").layer.values) == order


def test_a_kind_passed_as_the_layer_says_how_to_pass_it(tmp_path):
    run, _ = _record_mlp(tmp_path / "run.zarr", batch=(4,))
    with pytest.raises(LookupError, match=r"is a kind: pass the layer first and kind='gradients'"):
        open_run(run).histogram("gradients")
    with pytest.raises(ValueError, match=r"'head' is a layer, not a kind"):
        open_run(run).histogram("fc1", "head")


def test_info_and_nan_wording(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    path = str(tmp_path / "one.zarr")
    with Recorder(model, path, tensors_every=5) as rec:     # full tensors at step 0 only
        for i in range(3):
            with rec.step(i):
                model(torch.randn(2, 6)).sum().backward()
    r = invoke("info", path)
    assert "full tensors at 1 step\n" in r.output and "1 steps" not in r.output
    assert "name:0" in r.output                               # the ":0" of a name explained
    n = invoke("nan", path)
    assert n.exit_code == 0 and n.output.startswith("clean: ")
    nan_run, _ = _record_mlp(tmp_path / "nan.zarr", batch=(4,), nan_at=2, steps=4)
    n = invoke("nan", nan_run, "--around", "1")
    assert "in the steps before step 2, and at it; each step whole" in n.output


KILLED = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    from tensortape.recorder import Recorder
    model = nn.Linear(3, 3)
    rec = Recorder(model, sys.argv[1], flush_interval=0.2).attach()
    for i in range(10 ** 6):
        with rec.step(i):
            model(torch.randn(2, 3)).sum().backward()
        if i == 3:
            print("ready", flush=True)
        time.sleep(0.05)
""")


def test_info_after_a_kill_says_recording_or_died_with_the_last_commit(tmp_path):
    path = str(tmp_path / "killed.zarr")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", KILLED, path], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 300                    # a commit, however busy the machine
        while time.monotonic() < deadline:
            live = invoke("info", path)
            if "last commit" in live.output:
                break
            time.sleep(0.1)
        assert "status   recording (last commit " in live.output, live.output
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.communicate()                                      # and its pipe closed
    after = time.time()
    r = invoke("info", path)
    assert "recording, or died (no live job holds the run; last commit " in r.output, r.output
    when = json.loads(invoke("info", path, "--format", "json").output)["last_commit"]
    from datetime import datetime
    assert abs(datetime.fromisoformat(when).timestamp() - after) < 60


# --- 7. the HDF5 export, read without tensortape ---------------------------------------
def test_the_hdf5_export_describes_itself(tmp_path):
    xr = pytest.importorskip("xarray")
    pytest.importorskip("h5netcdf")
    import h5py
    run, model = _record_mlp(tmp_path / "run.zarr", batch=(5,))
    h5 = str(tmp_path / "run.h5")
    r = open_run(run)
    r.to_hdf5(h5)
    root = xr.open_dataset(h5, engine="h5netcdf")
    assert list(root.layer.values) == r.layers and root.attrs["Conventions"] == "CF-1.8"
    g = xr.open_dataset(h5, engine="h5netcdf", group="rank0/stats/activations")
    assert set(g.stats.dims) == {"step", "layer", "stat"} and g.hist.dims == ("step", "layer", "bin")
    assert list(g.stat.values)[:3] == ["count", "mean", "std"]
    assert sorted(g.layer.values) == sorted(r.layers) and list(g.step.values) == [0, 1, 2]
    # numbers a plain reader gets, against numpy on the model's own output
    torch.manual_seed(0)
    again = MLP()
    x = torch.randn(5, 6)
    want = again.fc1(x).detach().numpy().astype(np.float64)
    fc1 = g.stats.sel(step=0, layer="fc1")
    assert float(fc1.sel(stat="count")) == want.size
    assert float(fc1.sel(stat="mean")) == pytest.approx(want.mean(), rel=1e-5)
    assert float(fc1.sel(stat="abs_max")) == pytest.approx(np.abs(want).max(), rel=1e-6)
    assert g.stats.attrs["long_name"].startswith("per-step statistics")
    t = xr.open_dataset(h5, engine="h5netcdf", group="rank0/tensors/activations/fc1")
    assert t.data.dims == ("row", "dim_0", "dim_1") and list(t.step.values) == [0, 1, 2]
    np.testing.assert_array_equal(t.data.sel(row=0).values, want.astype(np.float32))
    with h5py.File(h5) as f:
        assert [d.label for d in f["rank0/stats/activations/stats"].dims] == ["step", "layer", "stat"]
    # and tensortape reads it back with the same API
    back = open_run(h5)
    assert back.stats().compute().equals(r.stats().compute())
    assert back.histogram("fc1").nan.dtype == np.int64


# --- 3. small words: the flag named, the unit stated, the kind shown ------------------
@pytest.mark.parametrize("span", ["5:2", "100:200"])
def test_an_empty_step_range_names_the_steps_flag(tmp_path, span):
    run, _ = _record_mlp(tmp_path / "run.zarr")
    r = invoke("stats", run, "--steps", span)
    line = r.output.strip().splitlines()[-1]           # the console script prints it alone
    assert r.exit_code == 2 and "--steps" in line and span in line, r.output


def test_budget_warnings_state_the_unit_and_spell_none_as_the_cli_does(tmp_path):
    script = os.path.join(ROOT, "tests", "scripts", "plain_train.py")
    store = str(tmp_path / "run.zarr")
    row = 16 * 4                                   # one sample of Linear(8, 16)'s output
    p = subprocess.run([sys.executable, "-m", "tensortape", "record", "-o", store, "--layers", "0",
                        "--capture", "activations", "--tensors-every", "1", "--max-bytes",
                        f"{row * 4}B", "--", "python", script, "4"], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 3, p.stderr
    assert f"--max-bytes {row * 4} ({row * 4} bytes) of full tensors reached" in p.stderr, p.stderr
    assert "--max-bytes none: no budget" in p.stderr and "None" not in p.stderr, p.stderr


def test_the_stats_and_watch_tables_name_their_kind(tmp_path):
    run, _ = _record_mlp(tmp_path / "run.zarr")
    for kind in ("activations", "gradients"):
        for cmd in (["stats", run, "--kind", kind], ["watch", run, "--kind", kind]):
            r = invoke(*cmd)
            header = next(x for x in r.output.splitlines() if "layer" in x.split()[:2])
            assert r.exit_code == 0 and f"layer ({kind})" in header, r.output
