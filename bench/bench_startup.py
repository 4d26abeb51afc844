"""Start-up time of the command line, side by side with another commit.

    python bench/bench_startup.py [--against REV] [--repeat N]

Times ``tensortape --help`` and ``tensortape info RUN`` (a 20-step demo run),
each a fresh Python process running ``cli.py`` of the tree under test.  With
``--against REV``, the same commands run from a git worktree of REV,
interleaved with this tree's, so machine noise hits both alike.  Reported:
the median wall time of each, and whether torch was imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = ("import runpy, sys; sys.argv = ['tensortape'] + sys.argv[1:]\n"
         "try:\n    runpy.run_path('cli.py', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "sys.stderr.write('TORCH=%s\\n' % ('torch' in sys.modules))")


def timed(tree: str, args: list[str]) -> tuple[float, bool]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHECK, *args], cwd=tree, capture_output=True,
                       text=True)
    return time.perf_counter() - t, "TORCH=True" in p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default=None, help="a git revision to compare with")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tt-startup-")
    trees = {"this tree": HERE}
    try:
        if args.against:
            wt = os.path.join(tmp, "against")
            subprocess.run(["git", "worktree", "add", "--detach", wt, args.against], cwd=HERE,
                           check=True, capture_output=True)
            trees[args.against] = wt
        run = os.path.join(tmp, "demo.zarr")
        subprocess.run([sys.executable, "cli.py", "demo", run, "--steps", "20"], cwd=HERE,
                       check=True, capture_output=True)
        commands = {"tensortape --help": ["--help"], "tensortape info RUN": ["info", run]}
        times = {(t, c): [] for t in trees for c in commands}
        torch_seen = {}
        for _ in range(args.repeat + 1):                  # the first round warms the caches
            for c, cargs in commands.items():
                for t, tree in trees.items():
                    dt, seen = timed(tree, cargs)
                    times[(t, c)].append(dt)
                    torch_seen[(t, c)] = seen
        print(f"median of {args.repeat} runs each (after one warm-up), interleaved")
        for (t, c), ts in times.items():
            print(f"  {c:22s} {t:12s} {statistics.median(ts[1:]) * 1e3:7.0f} ms   "
                  f"imports torch: {'yes' if torch_seen[(t, c)] else 'no'}")
    finally:
        if args.against:
            subprocess.run(["git", "worktree", "remove", "--force", trees[args.against]],
                           cwd=HERE, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
