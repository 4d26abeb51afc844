"""`tensortape watch` on a terminal: the first non-finite step of each (layer, kind)
stays on screen, above the live table, until the run ends (a real pseudo-terminal)."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN_FROM = 4                  # the training below feeds NaN into fc1 from this step on

TRAIN = textwrap.dedent(f"""
    import os, sys, time, torch
    from torch import nn
    from tensortape.recorder import Recorder
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 8))
    model.add_module("fc2", nn.Linear(8, 2))
    with Recorder(model, sys.argv[1], tensors_every=None, capture=("activations",),
                  flush_interval=0.2, stats_every=1) as rec:
        for i in range(40):
            if i == {NAN_FROM}:                 # the NaN comes once watch has shown a step
                rec.flush()
                for _ in range(3000):
                    if os.path.exists(sys.argv[1] + ".go"):
                        break
                    time.sleep(0.1)
            with rec.step(i):
                x = torch.randn(3, 4)
                if i >= {NAN_FROM}:
                    x[0, 0] = float("nan")
                model(x).sum().backward()
            time.sleep(0.1)
""")


def _watch_on_a_terminal(store, timeout=240, train=TRAIN, columns=160, lines=60,
                         interrupt=None):
    """Run ``tensortape watch`` with its stdout on a pseudo-terminal while the
    training ``train`` records ``store``; everything it wrote to the terminal.
    ``interrupt(out)``: whether to press Ctrl-C now (SIGINT to watch), given what
    it wrote so far."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS=str(columns), LINES=str(lines), TERM="xterm")
    trainer = subprocess.Popen([sys.executable, "-c", train, store], env=env,
                               stderr=subprocess.DEVNULL)
    leader, follower = pty.openpty()
    watcher = subprocess.Popen([sys.executable, "-m", "tensortape", "watch", store, "--interval", "0.3"],
                               stdout=follower, stderr=follower, stdin=follower, env=env, cwd=ROOT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pressed = False
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
                if b"   step " in out and not os.path.exists(store + ".go"):
                    open(store + ".go", "w").close()       # watch shows a step: train on
                if interrupt is not None and not pressed and interrupt(out.decode("utf-8", "replace")):
                    watcher.send_signal(signal.SIGINT)
                    pressed = True
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


MANY = 64                     # layers; every one goes NaN from step NAN_FROM on: 2,000+ events
LONG_NAMES = textwrap.dedent(f"""
    import sys, time, torch
    from torch import nn
    from tensortape.recorder import Recorder
    torch.manual_seed(0)

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(nn.ModuleDict({{"mlp": nn.ModuleDict(
                {{"down_projection_of_the_block": nn.Linear(4, 4)}})}}) for _ in range({MANY}))
            self.model.router = nn.Linear(4, 4)        # runs at even steps only

        def forward(self, x, step):
            if step % 2 == 0:
                self.model.router(x)
            for layer in self.model.layers:
                x = layer["mlp"]["down_projection_of_the_block"](x)
            return x

    model = Blocks()
    with Recorder(model, sys.argv[1], tensors_every=None, capture=("activations",),
                  layers="model.*", flush_interval=0.2, stats_every=1) as rec:
        for i in range(40):
            with rec.step(i):
                x = torch.randn(3, 4)
                if i >= {NAN_FROM}:
                    x[0, 0] = float("nan")
                model(x, i)
            time.sleep(0.05)
""")


def test_watch_fits_a_small_terminal_and_says_where_the_nans_truly_end(tmp_path):
    """64 layers go NaN on a 45-line, 100-column terminal: the status line and the first
    alert stay on screen; names keep their head and tail; a layer that did not run
    says so; the last NaN step is the true one though the store keeps 1,000 events."""
    screen = _watch_on_a_terminal(str(tmp_path / "run.zarr"), train=LONG_NAMES, columns=100,
                                  lines=45)
    last = screen.split("\x1b[2J")[-1].replace("\r", "").replace("\x1b[1;1H", "")
    lines = last.splitlines()
    assert lines[-1].startswith("run complete"), last
    frame = lines[:-1]
    assert sum(-(-max(len(x), 1) // 100) for x in frame) <= 44, last      # + the cursor's line
    assert frame[0].startswith("status complete   step 39"), last
    first = "model.router"                  # it runs first at even steps: step 4 is one
    assert frame[1].startswith(f"ALERT {first} (activations) went non-finite at step {NAN_FROM} ")
    assert frame[-1].startswith("non-finite so far: ") and frame[-1].endswith("the last at step 39")
    names = [f"model.layers.{i}.mlp.down_projection_of_the_block" for i in range(MANY)]
    names.append("model.router")
    head = next(i for i, x in enumerate(frame) if x.startswith("layer"))
    rows = [x for x in frame[head + 1:-1] if not x.startswith("... ")]
    assert len(rows) > 10
    seen = []
    for row in rows:                 # "…12…down_projecti…of_the_block": one name, its number
        shown = row.split()[0]
        pattern = re.compile(".*".join(map(re.escape, shown.split("…"))) + "$")
        numbers = lambda text: re.findall(r"(?:^|[.…])(\d+)(?=[.…]|$)", text)   # whole words
        (name,) = [n for n in names if pattern.match(n) and numbers(n) == numbers(shown)]
        seen.append(name)
    assert len(set(seen)) == len(seen)
    router = next(x for x in rows if x.startswith("model.router"))
    assert "did not run" in router and "-1" not in router.split(), router


def test_ctrl_c_stops_watching_quietly(tmp_path):
    screen = _watch_on_a_terminal(str(tmp_path / "run.zarr"),
                                  interrupt=lambda out: "status recording   step " in out)
    assert "Aborted" not in screen and "Traceback" not in screen, screen[-2000:]
    assert "stopped watching" in screen
