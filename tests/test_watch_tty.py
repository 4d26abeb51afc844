"""`tensortape watch` on a terminal: the first non-finite step of each (layer, kind)
stays on screen, above the live table, until the run ends (a real pseudo-terminal)."""

import os
import pty
import select
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN_FROM = 4                  # the training below feeds NaN into fc1 from this step on

TRAIN = textwrap.dedent(f"""
    import sys, time, torch
    from torch import nn
    from tensortape.recorder import Recorder
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 8))
    model.add_module("fc2", nn.Linear(8, 2))
    with Recorder(model, sys.argv[1], tensors_every=None, capture=("activations",),
                  flush_interval=0.2) as rec:
        for i in range(40):
            with rec.step(i):
                x = torch.randn(3, 4)
                if i >= {NAN_FROM}:
                    x[0, 0] = float("nan")
                model(x).sum().backward()
            time.sleep(0.1)
""")


def _watch_on_a_terminal(store, timeout=240):
    """Run ``tensortape watch`` with its stdout on a pseudo-terminal while the
    training records ``store``; everything it wrote to the terminal."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS="160", LINES="60", TERM="xterm")
    trainer = subprocess.Popen([sys.executable, "-c", TRAIN, store], env=env,
                               stderr=subprocess.DEVNULL)
    leader, follower = pty.openpty()
    watcher = subprocess.Popen([sys.executable, "-m", "tensortape", "watch", store, "--interval", "0.3"],
                               stdout=follower, stderr=follower, stdin=follower, env=env, cwd=ROOT)
    os.close(follower)
    out, end = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:            # the terminal closed: watch has ended
                    break
                if not chunk:
                    break
                out += chunk
            elif watcher.poll() is not None:
                break
        assert watcher.wait(timeout=max(1, end - time.monotonic())) == 0, out[-2000:]
        assert trainer.wait(timeout=300) == 0
    finally:
        for p in (watcher, trainer):
            if p.poll() is None:
                p.kill()
        os.close(leader)
    return out.decode("utf-8", "replace")


def test_watch_on_a_terminal_keeps_the_first_alert_on_screen_to_the_end(tmp_path):
    screen = _watch_on_a_terminal(str(tmp_path / "run.zarr"))
    clear = "\x1b[2J"
    frames = screen.split(clear)
    assert len(frames) > 3, screen[-2000:]               # the screen was redrawn, live
    alert = f"ALERT fc1 (activations) went non-finite at step {NAN_FROM} "
    first_seen = next(i for i, f in enumerate(frames) if alert in f)
    assert first_seen < len(frames) - 1, "the alert must be seen live, before the last frame"
    last = frames[-1].replace("\r", "")
    assert alert in last                                  # still on screen at the end
    assert f"ALERT fc2 (activations) went non-finite at step {NAN_FROM} " in last
    lines = last.splitlines()
    row = next(i for i, x in enumerate(lines) if x.startswith("layer"))
    assert max(i for i, x in enumerate(lines) if x.startswith("ALERT")) < row   # above the table
    assert "run complete" in last
