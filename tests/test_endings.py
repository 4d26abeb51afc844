"""Every way a run ends is recorded: an exception or Ctrl-C inside a plain loop, a
Hugging Face Trainer, Lightning or `tensortape record` leaves every step it trained
written, status ``interrupted``, and no hooks.

The runs commit only when closed (``flush_interval=60``), so a store that holds the
steps proves that the run was closed, not that a periodic commit happened first.
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tensortape.analysis import open_run
from conftest import has_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRASH = os.path.join(ROOT, "tests", "scripts", "crash.py")
K = 4                       # the step whose data fails
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))

FRAMEWORKS = ["plain", "hf", "lightning"]


def trained(log) -> int:
    """Optimizer steps that completed, as the script logged them."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return sum(1 for _ in f)


def check(store, log):
    run = open_run(store)
    n = trained(log)
    assert n >= K - 1, n                                   # it trained up to the failure
    assert run.status == "interrupted"
    assert run.steps().tolist() == list(range(n))          # every trained step, no other
    assert run.steps(tensors=True).tolist() == list(range(0, n, 2))


def needs(framework):
    if framework == "hf":
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")
    if framework == "lightning":
        pytest.importorskip("lightning")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_exception_in_training_keeps_its_steps(tmp_path, framework):
    needs(framework)
    import crash
    store, log, models = str(tmp_path / "run.zarr"), str(tmp_path / "log"), []
    with pytest.raises(RuntimeError, match=f"broken sample at step {K}"):
        crash.main(framework, "raise", K, store, log, models)
    check(store, log)
    assert not has_hooks(models[0])


def python(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_ctrl_c_in_training_keeps_its_steps(tmp_path, framework):
    needs(framework)
    store, log = str(tmp_path / "run.zarr"), str(tmp_path / "log")
    p = python(CRASH, framework, "sigint", str(K), store, log)
    assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr + p.stdout, p.stderr[-2000:]
    check(store, log)


def tensortape(*args):
    exe = shutil.which("tensortape")
    cmd = [exe, *args] if exe else [sys.executable, os.path.join(ROOT, "cli.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("how,status", [("raise", 1), ("sigint", 130)])
def test_record_keeps_the_steps_of_a_script_that_fails(tmp_path, how, status):
    store, log = str(tmp_path / "run.zarr"), str(tmp_path / "log")
    p = tensortape("record", "-o", store, "--layers", "0", "--tensors-every", "2", "--",
                   "python", CRASH, "none", how, str(K), "-", log)
    assert p.returncode == status, p.stderr[-2000:]
    if how == "sigint":                 # Ctrl-C: one line, no traceback
        assert "Traceback" not in p.stderr and "interrupted" in p.stderr, p.stderr
    else:                               # the script's own error, as Python shows it
        assert "broken sample" in p.stderr
    check(store, log)


def test_a_run_left_open_is_closed_at_exit(tmp_path):
    """A script that forgets close() (or dies of an exception outside the with
    block): the interpreter's exit closes the run, with every step written."""
    store = str(tmp_path / "run.zarr")
    code = ("import torch, sys; from recorder import Recorder\n"
            "m = torch.nn.Linear(4, 4)\n"
            "rec = Recorder(m, sys.argv[1], flush_interval=60).attach()\n"
            "for i in range(3):\n"
            "    rec.step(i); m(torch.randn(2, 4)).sum().backward()\n"
            "raise SystemExit(0)\n")
    p = python("-c", code, store)
    assert p.returncode == 0 and "cannot be written" not in p.stderr, p.stderr
    run = open_run(store)
    assert run.status == "interrupted" and run.steps().tolist() == [0, 1, 2]


def test_sigint_mid_step_keeps_what_the_step_captured(tmp_path):
    """Ctrl-C inside a step of a plain loop: the step ends and is recorded."""
    store = str(tmp_path / "run.zarr")
    code = ("import os, signal, torch, sys; from recorder import Recorder\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "m = torch.nn.Linear(4, 4)\n"
            "with Recorder(m, sys.argv[1], flush_interval=60) as rec:\n"
            "    for i in range(5):\n"
            "        with rec.step(i):\n"
            "            m(torch.randn(2, 4)).sum().backward()\n"
            "            if i == 2: os.kill(os.getpid(), signal.SIGINT)\n")
    p = python("-c", code, store)
    assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr
    run = open_run(store)
    assert run.status == "interrupted" and run.steps().tolist() == [0, 1, 2]
    assert run.steps("gradients").tolist() == [0, 1, 2]
