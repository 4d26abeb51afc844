"""Run one benchmark script on this tree and on another commit, alternating.

    python bench/against.py REV [--pairs N] -- bench/bench_recorder.py --only stats

Each benchmark already reports ratios measured side by side in its own
process (against the bare step and a peer); running it alternately on both
trees, pair after pair, puts the two commits side by side in one run.  The
benchmark script is this tree's on both (it uses the public API only), so the
same workloads run on both commits' code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rev")
    ap.add_argument("--pairs", type=int, default=2)
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give the benchmark after --, e.g. -- bench/bench_recorder.py --only stats")
    cut = argv.index("--")
    args, script = ap.parse_args(argv[:cut]), argv[cut + 1:]
    tmp = tempfile.mkdtemp(prefix="tt-against-")
    wt = os.path.join(tmp, "tree")
    subprocess.run(["git", "worktree", "add", "--detach", wt, args.rev], cwd=HERE, check=True,
                   capture_output=True)
    roots = {}                 # a folder holding ``tensortape`` -> each tree: first on the path,
    for label, tree in (("this", HERE), ("other", wt)):   # before an editable install's finder
        roots[tree] = os.path.join(tmp, label)
        os.makedirs(roots[tree])
        os.symlink(tree, os.path.join(roots[tree], "tensortape"))
    try:
        for i in range(args.pairs):
            for name, tree in (("this tree", HERE), (args.rev, wt)):
                print(f"===== pair {i + 1}: {name}", flush=True)
                env = dict(os.environ, PYTHONPATH=roots[tree])
                subprocess.run([sys.executable, os.path.join(HERE, script[0]), *script[1:]], cwd=tree,
                               env=env, check=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", wt], cwd=HERE, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
