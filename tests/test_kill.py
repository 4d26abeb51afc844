"""A kill sweep: SIGKILL at many moments, attach and close included; every committed step
reads back exactly, and the status is never unknown."""
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np

from tensortape.analysis import open_run
from tensortape.recorder import StoreNotFoundError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process imports torch once and forks a recording child for each line it reads (the
# store's path and a delay), prints the child's pid, SIGKILLs it after the delay unless it
# is negative (the zygote kills its own unreaped child: the pid cannot have been reused),
# and prints "closed" or "killed" when it ends: the sweep's kills cost no interpreter start.
ZYGOTE = textwrap.dedent("""
    import os, signal, sys, time, torch
    from tensortape.recorder import Recorder
    print("ready", flush=True)
    for line in sys.stdin:
        store, delay = line.split()
        pid = os.fork()
        if pid == 0:
            lin = torch.nn.Linear(64, 48)
            with torch.no_grad():
                lin.weight.copy_(torch.arange(48 * 64.).reshape(48, 64) / 1000)
                lin.bias.fill_(0.5)
            with Recorder(lin, store, layers="", capture=("activations", "weights"),
                          flush_interval=0.02, stats_every=1) as rec:
                for i in range(40):
                    with rec.step(i):
                        lin(torch.full((8, 64), float(i)))
            os._exit(0)
        print(pid, flush=True)
        if float(delay) >= 0:
            time.sleep(float(delay))
            os.kill(pid, signal.SIGKILL)      # ours until waited for, even if it has ended
        _, status = os.waitpid(pid, 0)
        print("killed" if os.WIFSIGNALED(status) else "closed", flush=True)
""")


def _expected(i):
    w = np.arange(48 * 64.0, dtype=np.float32).reshape(48, 64) / 1000
    return np.full((8, 64), float(i), np.float32) @ w.T + np.float32(0.5)


def test_kill_sweep(tmp_path):
    env = dict(os.environ, TENSORTAPE_COMPILE="0")
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert zygote.stdout.readline().strip() == "ready"

        def start(store, delay=-1.0):
            zygote.stdin.write(f"{store} {delay!r}\n")
            zygote.stdin.flush()
            return int(zygote.stdout.readline())

        t = time.monotonic()
        start(str(tmp_path / "whole.zarr"))          # how long attach..close takes here
        assert zygote.stdout.readline().strip() == "closed"
        span = time.monotonic() - t
        rng = random.Random(1234)
        outcomes = {"no store yet": 0, "recording": 0, "complete": 0}
        for k in range(12):
            store = str(tmp_path / f"k{k}.zarr")
            start(store, rng.uniform(0.0, 1.4 * span))   # before attach, inside it, ..., after close
            assert zygote.stdout.readline().strip() in ("killed", "closed")
            try:
                run = open_run(store)
            except StoreNotFoundError:
                outcomes["no store yet"] += 1
                continue
            assert run.status in ("recording", "complete"), run.status
            outcomes[run.status] += 1
            steps = run.steps(tensors=True).tolist() if run.kinds else []
            assert steps == list(range(len(steps)))
            for i in steps:
                np.testing.assert_allclose(run.tensor("(root)", step=i).values, _expected(i),
                                           rtol=1e-6)
        print(outcomes)
        assert sum(outcomes.values()) == 12 and outcomes["recording"] >= 3
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=300)
        zygote.stdout.close()


def test_a_run_killed_while_writing_its_root_is_no_run_yet_and_can_start_again(tmp_path):
    """SIGKILL between the folder and the root's zarr.json leaves the folder with
    zarr's temporary file at most (the sweep met it): no run yet, and a new run
    may start there."""
    from tensortape.recorder import Recorder
    from tensortape.recorder.errors import StoreNotFoundError
    store = tmp_path / "k.zarr"
    store.mkdir()
    (store / ("zarr." + "0123456789abcdef" * 2 + ".partial")).write_bytes(b'{"zarr_fo')
    try:
        open_run(str(store))
        raise AssertionError("an empty folder opened as a run")
    except StoreNotFoundError as e:
        assert "no run at" in str(e)
    import torch
    lin = torch.nn.Linear(2, 2)
    with Recorder(lin, str(store), tensors_every=1, stats_every=1) as rec:
        with rec.step():
            lin(torch.ones(1, 2)).sum().backward()
    assert open_run(str(store)).steps().tolist() == [0]
