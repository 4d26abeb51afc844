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
    p = tensortape("record", "--stats-every", "1", "-o", store, "--layers", "0", "--tensors-every", "2",
                   "--",
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
            "rec = Recorder(m, sys.argv[1], flush_interval=60, stats_every=1).attach()\n"
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
            "with Recorder(m, sys.argv[1], flush_interval=60, stats_every=1) as rec:\n"
            "    for i in range(5):\n"
            "        with rec.step(i):\n"
            "            m(torch.randn(2, 4)).sum().backward()\n"
            "            if i == 2: os.kill(os.getpid(), signal.SIGINT)\n")
    p = python("-c", code, store)
    assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr
    run = open_run(store)
    assert run.status == "interrupted" and run.steps().tolist() == [0, 1, 2]
    assert run.steps("gradients").tolist() == [0, 1, 2]


# --- SIGTERM: a scheduler's preemption ---------------------------------------------------
# Each child prints "done i" (flushed) once step i is handed over, and a line the test waits
# for before it sends SIGTERM; nothing waits on the clock.
TRAINER = """
import os, signal, sys, threading, time
import torch
from tensortape import Recorder

how, store = sys.argv[1], sys.argv[2]
stop, handler = [], None
if how == "own handler":                     # the user's own: stop after this step
    def handler(signum, frame):
        print("handler ran", flush=True)
        stop.append(signum)
    signal.signal(signal.SIGTERM, handler)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
if how == "inside a flush":                  # its writes wait at a gate the test's SIGTERM
    import asyncio, zarr.storage             # opens: the signal comes inside rec.flush()
    gate, original = threading.Event(), zarr.storage.LocalStore.set
    gate.set()

    async def gated(self, key, value, *args, **kwargs):
        if not gate.is_set():
            print("writing", flush=True)
            while not gate.is_set():
                await asyncio.sleep(0.01)
        await original(self, key, value, *args, **kwargs)
    zarr.storage.LocalStore.set = gated

    def open_gate():                         # once the handler has taken the hooks away
        while any(m._forward_hooks for m in model.modules()):
            time.sleep(0.01)
        gate.set()
with Recorder(model, store, flush_interval=60, max_bytes=None, stats_every=1) as rec:
    for i in range(10**6):
        with rec.step(i):
            model(torch.randn(3, 4)).sum().backward()
            if how == "in a step" and i == 4:
                print("waiting", flush=True)
                while True:
                    time.sleep(0.01)
        print("done", i, flush=True)
        if stop:
            break
        if i == 3 and how == "inside a flush":
            gate.clear()
            threading.Thread(target=open_gate, daemon=True).start()
            rec.flush()
        if i == 3 and how == "own handler":
            print("waiting", flush=True)
            while not stop:
                time.sleep(0.01)
print("restored", signal.getsignal(signal.SIGTERM) is handler, flush=True)
"""

SCRIPT = """
import signal, sys, time
import torch
if sys.argv[1] == "own handler":
    def handler(signum, frame):
        print("handler ran", flush=True)
        sys.exit(143)
    signal.signal(signal.SIGTERM, handler)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(10**6):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    print("done", i, flush=True)
    if i == 3:
        print("waiting", flush=True)
        while True:
            time.sleep(0.01)
"""


def terminated(tmp_path, command, wait_for):
    """Run ``command``, SIGTERM it once it printed ``wait_for``; its exit status, the
    lines it printed, its stderr."""
    err = tmp_path / "stderr"
    with open(err, "w") as errors:
        p = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=ROOT)
        try:
            lines = []
            for line in p.stdout:
                lines.append(line.strip())
                if lines[-1] == wait_for:
                    break
            assert lines and lines[-1] == wait_for, (lines, err.read_text()[-3000:])
            os.kill(p.pid, signal.SIGTERM)
            rest, _ = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return p.returncode, lines + rest.splitlines(), err.read_text()


def done(lines):
    return [int(line.split()[1]) for line in lines if line.startswith("done ")]


def closed_by_sigterm(store, steps, status="interrupted"):
    run = open_run(store)
    assert run.status == status
    assert run.steps().tolist() == steps
    assert run.steps("gradients").tolist() == steps
    assert not os.path.exists(os.path.join(store, "tensortape.lock"))   # the claim is released


@pytest.mark.parametrize("how,wait_for", [("in a step", "waiting"),
                                          ("inside a flush", "writing")])
def test_sigterm_closes_the_run_and_ends_the_process_by_sigterm(tmp_path, how, wait_for):
    """Without a handler of the user's: every step handed over, and the open step, are
    committed, the run is 'interrupted', and the process still ends by SIGTERM. Inside
    a flush, the signal interrupts tensortape's own code (the handler takes no lock)."""
    store = str(tmp_path / "run.zarr")
    status, lines, err = terminated(tmp_path, [sys.executable, "-c", TRAINER, how, store],
                                    wait_for)
    assert status == -signal.SIGTERM, err[-3000:]
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err[-3000:]
    trained = done(lines) + ([4] if how == "in a step" else [])   # the open step too
    assert trained == list(range(len(trained))) and len(trained) >= 4
    closed_by_sigterm(store, trained)


def test_a_users_own_sigterm_handler_decides(tmp_path):
    """The user's handler (installed before the Recorder) runs instead: it asks the loop
    to stop after this step, so training and the recording go on to a normal end, and
    the handler is the user's again after close."""
    store = str(tmp_path / "run.zarr")
    status, lines, err = terminated(tmp_path, [sys.executable, "-c", TRAINER, "own handler",
                                               store], "waiting")
    assert status == 0, err[-3000:]
    assert "handler ran" in lines and lines[-1] == "restored True"
    assert done(lines) == [0, 1, 2, 3, 4]                 # one more step after the signal
    closed_by_sigterm(store, [0, 1, 2, 3, 4], status="complete")


@pytest.mark.parametrize("how,status", [("default", -signal.SIGTERM), ("own handler", 143)])
def test_record_closes_the_run_at_sigterm(tmp_path, how, status):
    """`tensortape record` under SIGTERM: the run is closed 'interrupted' with every step
    the script trained, and the exit is a SIGTERMed python's (or the script's handler's)."""
    store = str(tmp_path / "run.zarr")
    exe = shutil.which("tensortape")
    cmd = [exe] if exe else [sys.executable, os.path.join(ROOT, "cli.py")]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    got, lines, err = terminated(tmp_path, [*cmd, "record", "--stats-every", "1", "-o", store, "--tensors-every", "0",
                                            "--", "python", str(script), how], "waiting")
    assert got == status, err[-3000:]
    assert ("handler ran" in lines) == (how == "own handler")
    assert done(lines) == [0, 1, 2, 3]
    closed_by_sigterm(store, [0, 1, 2, 3])


def test_the_sigterm_handler_is_tensortapes_only_while_it_may_be(tmp_path):
    """Installed by a Recorder attached on the main thread (not from another thread, not
    over SIG_IGN), put back at close, and a handler the user installs after attach is
    left in place."""
    import threading
    import torch
    from tensortape import Recorder
    model = torch.nn.Linear(2, 2)

    def mine(signum, frame):
        pass

    def later(signum, frame):
        pass
    before = signal.signal(signal.SIGTERM, mine)
    try:
        rec = Recorder(model, tmp_path / "thread.zarr", max_bytes=None, stats_every=1)
        worker = threading.Thread(target=rec.attach)
        worker.start()
        worker.join()
        assert signal.getsignal(signal.SIGTERM) is mine     # not from another thread
        rec.close()
        with Recorder(model, tmp_path / "main.zarr", max_bytes=None, stats_every=1):
            assert signal.getsignal(signal.SIGTERM) not in (mine, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) is mine     # put back
        with Recorder(model, tmp_path / "later.zarr", max_bytes=None, stats_every=1):
            signal.signal(signal.SIGTERM, later)
        assert signal.getsignal(signal.SIGTERM) is later    # the user's, left in place
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with Recorder(model, tmp_path / "ignored.zarr", max_bytes=None, stats_every=1):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [open_run(tmp_path / f"{n}.zarr").status for n in ("thread", "main", "later")] \
        == ["complete"] * 3
