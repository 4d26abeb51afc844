"""Run a worker script as the ranks of one gloo job on loopback (``run_ranks``)."""
import os
import socket
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a worker's first lines: joins the gloo group of the test's ranks
PREAMBLE = textwrap.dedent("""
    import os, sys, json, time
    import numpy as np, torch, torch.distributed as dist
    from torch import nn
    from tensortape.recorder import Recorder
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
""")

# Every rank builds its Recorder (mode: the third argument) and writes "built{rank}", waits for
# the file named by the fourth, then records three steps; what it met is its "result{rank}".
BUILT_THEN_GO = PREAMBLE + """
mode, go = sys.argv[3], sys.argv[4]
model = nn.Linear(2, 2)
try:
    rec = Recorder(model, store, mode=mode, max_bytes=None, stats_every=1)
    open(f"{out}/built{rank}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    with rec:
        for i in range(3):
            with rec.step(i):
                model(torch.ones(1, 2)).sum().backward()
    result = "ok"
except Exception as e:
    result = f"{type(e).__name__}: {e}"
open(f"{out}/result{rank}", "w").write(result)
dist.destroy_process_group()
"""


def start_ranks(worker: str, *args: str, world: int = 2, env: dict | None = None) -> list:
    """The ranks' processes, started (``args`` follow the script on their command line)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE=str(world), PYTHONPATH=ROOT, **(env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", worker, *map(str, args)],
                                      env=e, cwd=ROOT))
    return procs


def wait_ranks(procs, timeout: float = 300) -> list[int]:
    """Each rank's exit status (none may hang past ``timeout``)."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ranks(worker: str, *args: str, world: int = 2, env: dict | None = None,
              timeout: float = 300) -> list[int]:
    return wait_ranks(start_ranks(worker, *args, world=world, env=env), timeout)
