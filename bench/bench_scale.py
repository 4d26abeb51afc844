"""How a store scales with ranks, steps and layers (no model: synthetic step records).

    python bench/bench_scale.py [--ranks R] [--steps S] [--layers L] [--out DIR]
    python bench/against.py REV --pairs 1 -- bench/bench_scale.py ...   (side by side)

R processes each write one rank through the writer's store layer
(``recorder.store._store.RunStore``: ``append_stats``, ``append_tensor``, ``flush``,
``commit``, what the background writer calls), for S steps: statistics and
histograms of two kinds (activations, gradients) for L layers a step, full
tensors of 3 layers every 100th step (64 KiB each), and a commit every 50 steps
(the writer commits every 5 s).  Histogram rows are realistic: about 80 bins
in use a layer, their counts drifting from step to step.  Rank R//2 records a
NaN at step S//2, every rank at S//2 + 1.

Reported: the store's format, files and bytes per rank, the writer's time per
step (median rank), and the time to ``open_run``, to find ``first_nonfinite``
across every rank, and to load one layer's whole-run evolution (its ``std``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("activations", "gradients")


def _rows(rng, layers: int, nbins: int, base: np.ndarray, step: int) -> np.ndarray:
    hist = np.zeros((layers, nbins), np.int64)
    for i in range(layers):
        lo = base[i]
        counts = rng.poisson(1000 * np.exp(-((np.arange(80) - 40) / 15.0) ** 2) + 1)
        hist[i, lo: lo + 80] = counts
    return hist


def write_rank(loc: str, rank: int, steps: int, layers: int, nan_rank: int,
               out: mp.Queue) -> None:
    from tensortape.recorder import format as fmt
    from tensortape.recorder.claim._root import open_root
    from tensortape.recorder.store._store import RunStore
    try:
        from tensortape.recorder.histogram import NBINS
    except ImportError:                    # a tree before format.py's split (bench/against.py)
        NBINS = fmt.NBINS
    root = open_root(loc, "a", rank)
    store = RunStore(root, rank, "auto")
    state = fmt.RankState(rank=rank)
    names = [f"layers.{i}.mlp" for i in range(layers)]
    state.layers = list(names)
    rng = np.random.default_rng(rank)
    base = rng.integers(100, NBINS - 100, size=layers)
    stats = {s: rng.standard_normal(layers) for s in fmt.STATS}
    tensor = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    import torch
    host = torch.from_numpy(tensor)
    spent = 0.0
    for step in range(steps):
        hist = _rows(rng, layers, NBINS, base, step)
        t0 = time.perf_counter()
        for kind in KINDS:
            path = fmt.stats_group(rank, kind)
            state.stats_layers.setdefault(kind, list(names))
            store.append_stats(kind, step, names, names, stats, hist, state.committed.get(path, 0))
        if step % 100 == 0:
            for name in names[:3]:
                p = fmt.tensor_group(rank, "activations", name)
                n = store.append_tensor("activations", name, step, 0, host, state.committed.get(p, 0))
                state.bytes_raw += n
        state.last_step = step
        if (rank == nan_rank and step == steps // 2) or step == steps // 2 + 1:
            state.events.append(fmt.NonFiniteEvent(step, names[7], "activations", 3, 0, 0,
                                                   order=7))
            state.events_total += 1
        if step % 50 == 49 or step == steps - 1:
            state.committed.update(store.flush())
            store.commit(state, None)
        spent += time.perf_counter() - t0
    store.close()
    out.put((rank, spent / steps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--out", default=None, help="folder for the store (default: a temporary one)")
    args = ap.parse_args()
    from tensortape.recorder import format as fmt
    from tensortape.recorder.claim._root import open_root
    tmp = args.out or tempfile.mkdtemp(prefix="tt-scale-")
    loc = os.path.join(tmp, "run.zarr")
    shutil.rmtree(loc, ignore_errors=True)
    open_root(loc, "w", 0, attributes={"tensortape_format": fmt.FORMAT_VERSION,
                                       "status": "complete", "layers": [], "events": []})
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=write_rank,
                         args=(loc, r, args.steps, args.layers, args.ranks // 2, q))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    per_step = [q.get()[1] for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    files = sum(len(f) for _, _, f in os.walk(os.path.join(loc, "rank0")))
    stats_files = sum(len(f) for _, _, f in os.walk(os.path.join(loc, "rank0", "stats")))
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(loc, "rank0"))
                 for f in fs)
    stats_bytes = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, fs in os.walk(os.path.join(loc, "rank0", "stats")) for f in fs)
    from tensortape.analysis import open_run
    t = time.perf_counter()
    run = open_run(loc)
    t_open = time.perf_counter() - t
    t = time.perf_counter()
    first = run.first_nonfinite()
    t_first = time.perf_counter() - t
    t = time.perf_counter()
    evo = run.stats("activations", layers=["layers.0.mlp"], rank=0)["std"].compute()
    t_evo = time.perf_counter() - t
    print(f"format {fmt.FORMAT_VERSION}: {args.ranks} ranks x {args.steps} steps x {args.layers} "
          f"layers, 2 kinds; {wall:.0f} s to write")
    print(f"  per rank: {files} files ({stats_files} of statistics and histograms), "
          f"{nbytes / 1e6:.1f} MB ({stats_bytes / 1e6:.1f} MB of statistics and histograms)")
    print(f"  writer: {statistics.median(per_step) * 1e3:.2f} ms a step (median rank)")
    print(f"  open_run {t_open * 1e3:.0f} ms; first_nonfinite across {args.ranks} ranks "
          f"{t_first * 1e3:.0f} ms (step {first.step}, rank {getattr(first, 'rank', '?')}); "
          f"one layer's evolution over {evo.sizes['step']} steps {t_evo * 1e3:.0f} ms")
    if not args.out:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
