"""`tensortape record`: an unchanged training script, recorded in its own process."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from analysis import open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "plain_train.py")


def tensortape(*args):
    exe = shutil.which("tensortape")
    cmd = [exe, *args] if exe else [sys.executable, os.path.join(ROOT, "cli.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_record_an_unchanged_script(tmp_path):
    store = str(tmp_path / "run.zarr")
    p = tensortape("record", "-o", store, "--layers", "0", "--layers", "2", "--capture",
                   "activations", "--capture", "weight_grads", "--", "python", SCRIPT, "5")
    assert p.returncode == 3, p.stderr                  # the script's own exit status
    assert p.stdout.strip() == "trained 5"              # and its own output
    run = open_run(store)
    assert run.steps().tolist() == [0, 1, 2, 3, 4]      # one step per optimizer step
    assert run.layers == ["0", "2", "0:weight", "0:bias", "2:weight", "2:bias"]
    stats = run.stats().compute()
    assert stats["count"].sel(layer="0").values.tolist() == [64] * 5   # evaluation not recorded
    assert float(run.stats("weight_grads")["norm"].min()) > 0
    torch.manual_seed(0)                                # the script's first batch, replayed
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    np.testing.assert_array_equal(run.tensor("0", step=0).values, model[0](x).detach().numpy())


def test_a_run_that_cannot_be_recorded_stops_in_one_line_unless_keep_going(tmp_path):
    store = str(tmp_path / "run.zarr")
    p = tensortape("record", "-o", store, "--layers", "nope*", "--", "python", SCRIPT, "2")
    assert p.returncode == 2 and "trained" not in p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope*'" in lines[0] and "--keep-going" in lines[0], p.stderr
    p = tensortape("record", "-o", store, "--layers", "nope*", "--keep-going", "--", "python",
                   SCRIPT, "2")
    assert p.returncode == 3 and p.stdout.strip() == "trained 2"
    assert "not recording" in p.stderr and "'nope*'" in p.stderr


def test_record_modes_on_an_existing_run(tmp_path):
    store = str(tmp_path / "run.zarr")
    assert tensortape("record", "-o", store, "--", "python", SCRIPT, "2").returncode == 3
    p = tensortape("record", "-o", store, "--", "python", SCRIPT, "3")     # mode w-: refused
    assert p.returncode == 2 and "trained" not in p.stdout
    assert p.stderr.count("\n") == 1 and "already exists" in p.stderr and "mode='w'" in p.stderr
    p = tensortape("record", "-o", store, "--mode", "w", "--", "python", SCRIPT, "3")
    assert p.returncode == 3 and open_run(store).steps().tolist() == [0, 1, 2]
    p = tensortape("record", "-o", store, "--mode", "a", "--", "python", SCRIPT, "2")
    assert p.returncode == 3 and open_run(store).steps().tolist() == [0, 1, 2]  # steps re-recorded
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    p = tensortape("record", "-o", str(tmp_path / "mine"), "--mode", "w", "--", "python", SCRIPT, "2")
    assert p.returncode == 2 and "will not delete" in p.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("command,needle", [
    (["python", "nonexistent_train.py"], "no script 'nonexistent_train.py'"),
    (["python", "-m", "no_such_module_xyz"], "no module 'no_such_module_xyz'"),
])
def test_a_missing_script_is_one_line(tmp_path, command, needle):
    p = tensortape("record", "-o", str(tmp_path / "run.zarr"), "--", *command)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert not os.path.exists(tmp_path / "run.zarr")


def test_watch_follows_a_live_run_until_it_closes(tmp_path):
    """A run recorded in a child process while `tensortape watch` follows it."""
    store = str(tmp_path / "live.zarr")
    child = subprocess.Popen([sys.executable, "-c", LIVE, store], cwd=ROOT)
    try:
        p = tensortape("watch", store, "--interval", "0.2", "--layer", "fc*")
    finally:
        child.wait(60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any(line.startswith("status recording") and "steps/s" in line for line in lines)
    alerts = [line for line in lines if line.startswith("ALERT")]
    assert [a.split()[1] for a in alerts] == ["fc1", "fc2"]   # each once
    assert all("step 12" in a and "4 NaN" in alerts[0] for a in alerts)
    assert lines[-1] == f"run complete: {store}"
    assert any(line.startswith("fc2 ") for line in lines)       # the final table


LIVE = """
import sys, time, torch
from torch import nn
from recorder import Recorder
torch.manual_seed(0)
model = nn.Sequential()
model.add_module("fc1", nn.Linear(4, 4)); model.add_module("fc2", nn.Linear(4, 2))
with Recorder(model, sys.argv[1], layers="fc*", flush_interval=0.1, tensors_every=None) as rec:
    for i in range(20):
        with rec.step(i):
            x = torch.randn(3, 4)
            if i == 12:
                x[0, 0] = float("nan")
            model(x).sum().backward()
        time.sleep(0.1)
"""
