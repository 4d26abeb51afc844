"""`tensortape record`: an unchanged training script, recorded in its own process.

The installed command runs in a process of its own where the process is what is tested
(its exit status and output, ``python -m``'s path, a live run watched); refusals and
messages are checked with click running it in this process (``in_process``)."""
import os
import runpy
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "plain_train.py")


ACCUM = os.path.join(ROOT, "tests", "scripts", "accum_train.py")


def tensortape(*args, cwd=ROOT):
    exe = shutil.which("tensortape")
    cmd = [exe, *args] if exe else [sys.executable, os.path.join(ROOT, "cli.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)


def in_process(*args):
    """``tensortape`` run by click in this process (no interpreter and torch to start):
    its exit status and its separate stdout and stderr, as ``tensortape()`` gives them."""
    from click.testing import CliRunner
    from tensortape import cli
    r = CliRunner().invoke(cli.cli, list(args), prog_name="tensortape")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def test_record_an_unchanged_script(tmp_path):
    store = str(tmp_path / "run.zarr")
    p = tensortape("record", "--stats-every", "1", "-o", store, "--layers", "0", "--layers", "2", "--capture",
                   "activations", "--capture", "weight_grads", "--tensors-every", "1", "--",
                   "python", SCRIPT, "5")
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
    p = in_process("record", "--stats-every", "1", "-o", store, "--layers", "nope*", "--", "python", SCRIPT, "2")
    assert p.returncode == 2 and "trained" not in p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope*'" in lines[0] and "--keep-going" in lines[0], p.stderr
    p = in_process("record", "--stats-every", "1", "-o", store, "--layers", "nope*", "--keep-going", "--", "python",
                   SCRIPT, "2")
    assert p.returncode == 3 and p.stdout.strip() == "trained 2"
    assert "not recording" in p.stderr and "'nope*'" in p.stderr


def test_record_modes_on_an_existing_run(tmp_path):
    """In this process (the installed command's own process is test_record_an_unchanged_script's)."""
    store = str(tmp_path / "run.zarr")
    assert in_process("record", "--stats-every", "1", "-o", store, "--", "python", SCRIPT, "2").returncode == 3
    p = in_process("record", "--stats-every", "1", "-o", store, "--", "python", SCRIPT, "3")     # mode w-: refused
    assert p.returncode == 2 and "trained" not in p.stdout
    assert p.stderr.count("\n") == 1 and "already exists" in p.stderr
    assert "--mode w " in p.stderr and "mode=" not in p.stderr    # the CLI's words
    p = in_process("record", "--stats-every", "1", "-o", store, "--mode", "w", "--", "python", SCRIPT, "3")
    assert p.returncode == 3 and open_run(store).steps().tolist() == [0, 1, 2]
    p = in_process("record", "--stats-every", "1", "-o", store, "--mode", "a", "--", "python", SCRIPT, "2")
    assert p.returncode == 3 and open_run(store).steps().tolist() == [0, 1, 2, 3, 4]  # continued
    p = in_process("record", "--stats-every", "1", "-o", str(tmp_path / "none.zarr"), "--mode", "a", "--", "python",
                   SCRIPT, "2")
    assert p.returncode == 2 and "trained" not in p.stdout
    assert "--mode a cannot append" in p.stderr and "mode=" not in p.stderr, p.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    p = in_process("record", "--stats-every", "1", "-o", str(tmp_path / "mine"), "--mode", "w", "--", "python", SCRIPT, "2")
    assert p.returncode == 2 and "will not delete" in p.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("command,needle", [
    (["python", "nonexistent_train.py"], "no script 'nonexistent_train.py'"),
    (["python", "-m", "no_such_module_xyz"], "no module 'no_such_module_xyz'"),
])
def test_a_missing_script_is_one_line(tmp_path, command, needle):
    store = tmp_path / "new" / "deeper" / "run.zarr"
    p = in_process("record", "--stats-every", "1", "-o", str(store), "--", *command)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert os.listdir(tmp_path) == []             # the store's probe left nothing behind


TRAIN = """
import torch
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("trained")
sys.exit(4)
"""
MARKED = "import pathlib, sys\npathlib.Path(sys.argv[1]).touch()   # the script started\n" + TRAIN


@pytest.mark.parametrize("where", ["under a file", "/proc"])
def test_a_store_that_cannot_be_written_stops_before_the_script_starts(tmp_path, where):
    """The tests run as root, whom a read-only folder does not stop: a path under a
    regular file, or in /proc, cannot be written by anyone."""
    if where == "/proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    (tmp_path / "afile").write_text("mine")
    store = str(tmp_path / "afile" / "run.zarr") if where == "under a file" \
        else f"/proc/tensortape-{os.getpid()}/run.zarr"
    script, marker = tmp_path / "train.py", tmp_path / "started"
    script.write_text(MARKED)
    p = in_process("record", "--stats-every", "1", "-o", store, "--", "python", str(script), str(marker))
    assert p.returncode == 2 and p.stdout == "" and not marker.exists(), p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the run" in lines[0], p.stderr
    assert "not started" in lines[0] and "--keep-going" in lines[0]
    p = in_process("record", "--stats-every", "1", "-o", store, "--keep-going", "--", "python", str(script), str(marker))
    assert p.returncode == 4 and p.stdout.strip() == "trained" and marker.exists()
    lines = p.stderr.strip().splitlines()                  # trained unrecorded, after one line
    assert len(lines) == 1 and "not recording" in lines[0] and "cannot write" in lines[0], p.stderr
    assert (tmp_path / "afile").read_text() == "mine" and not os.path.exists(store)


def test_a_module_is_found_as_python_m_finds_it(tmp_path):
    """``python -m`` puts the current folder first on sys.path, and so does record."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "trainmod.py").write_text(
        "import sys\nprint(sys.path[0], sys.argv, __name__)\n" + TRAIN)
    store = str(tmp_path / "run.zarr")
    plain = subprocess.run([sys.executable, "-m", "mypkg.trainmod", "x"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert plain.returncode == 4, plain.stderr
    p = tensortape("record", "--stats-every", "1", "-o", store, "--", "python", "-m", "mypkg.trainmod", "x",
                   cwd=tmp_path)
    assert p.returncode == 4, p.stderr
    assert p.stdout == plain.stdout                 # sys.path[0], argv and __name__ as python's
    assert open_run(store).steps().tolist() == [0, 1]


def test_the_first_forward_is_recorded_like_any_other(tmp_path):
    """The model is found at its first forward, and that forward is recorded whole: with
    2 micro-batches a step, step 0 holds both, labelled 0 and 1, the root's inputs
    included, with the values plain torch hooks see."""
    store = str(tmp_path / "run.zarr")
    p = in_process("record", "--stats-every", "1", "-o", store, "--capture", "inputs", "--capture", "activations",
                   "--layers", "*", "--tensors-every", "1", "--", "python", ACCUM, "3")
    assert p.returncode == 0 and p.stdout.strip() == "trained", p.stderr
    script = runpy.run_path(ACCUM, run_name="oracle")
    model, seen, calls = script["build"](), {}, []

    def hooks(name):
        def pre(module, args):
            if name == "(root)":
                calls.append(None)
            step, micro = divmod(len(calls) - 1, script["MICRO"])
            seen[name, "inputs", step, micro] = args[0].detach().clone()

        def post(module, args, out):
            step, micro = divmod(len(calls) - 1, script["MICRO"])
            seen[name, "activations", step, micro] = out.detach().clone()
        return pre, post
    for name, module in model.named_modules():
        pre, post = hooks(name or "(root)")
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    script["train"](model, 3)
    run = open_run(store)
    assert sorted(run.tensor_layers("inputs")) == ["(root)", "0", "1", "2"]
    for (name, kind, step, micro), want in seen.items():
        assert run.tensor(name, kind, micro=micro).step.values.tolist() == [0, 1, 2]
        got = run.tensor(name, kind, step=step, micro=micro).values
        np.testing.assert_array_equal(got, want.numpy(), err_msg=f"{name} {kind} {step} {micro}")
    for kind in ("inputs", "activations"):                 # statistics: both micro-batches
        count = run.stats(kind)["count"].sel(layer="(root)").values.tolist()
        assert count[0] == count[1] == count[2] > 0


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
from tensortape.recorder import Recorder
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


RESUMABLE = """
import sys
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def train(model, job, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(job)             # each job its own batches
    for _ in range(steps):
        model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    train(build(), int(sys.argv[1]), int(sys.argv[2]))
"""


def seen_by_hooks(script, job, steps):
    """The script's job under plain forward hooks: {(layer, step of the job): output}."""
    ns = runpy.run_path(script, run_name="oracle")
    model, seen, at = ns["build"](), {}, []
    model.register_forward_pre_hook(lambda m, args: at.append(len(at)))
    for name in ("0", "2"):
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__((name, at[-1]),
                                                             out.detach().numpy().copy()))
    ns["train"](model, job, steps)
    return seen


def test_mode_a_continues_the_run_after_its_last_step(tmp_path):
    """A resumed job (--mode a) goes on from the step after the store's last; --start-step
    N records from N (a job resumed from an earlier checkpoint records those steps again).
    Each step's statistics are those plain hooks saw in the job that recorded it last."""
    from click.testing import CliRunner
    from tensortape import cli
    script, store = tmp_path / "train.py", str(tmp_path / "run.zarr")
    script.write_text(RESUMABLE)

    def record(job, steps, *flags):
        r = CliRunner().invoke(cli.cli, ["record", "--stats-every", "1", "-o", store, "--layers", "0", "--layers",
                                         "2", "--capture", "activations", "--tensors-every", "0",
                                         *flags, "--", "python", str(script), str(job),
                                         str(steps)], prog_name="tensortape")
        assert r.exit_code == 0, r.output
        return seen_by_hooks(str(script), job, steps)

    want = {}                                                 # (layer, step) -> output
    for job, steps, first, flags in [(1, 3, 0, ()), (2, 2, 3, ("--mode", "a")),
                                     (3, 2, 1, ("--mode", "a", "--start-step", "1"))]:
        seen = record(job, steps, *flags)
        want.update({(layer, first + s): v for (layer, s), v in seen.items()})
        run = open_run(store)
        assert run.steps().tolist() == sorted({s for _, s in want}), (job, run.steps())
        stats = run.stats().compute()
        for (layer, step), v in want.items():
            got = stats.sel(layer=layer, step=step)
            assert int(got["count"]) == v.size
            assert float(got["min"]) == v.min() and float(got["max"]) == v.max()
            assert float(got["mean"]) == pytest.approx(v.astype(np.float64).mean(), rel=1e-12)
    assert open_run(store).status == "complete"
    assert run.steps().tolist() == [0, 1, 2, 3, 4]
