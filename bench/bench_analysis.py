"""Analysis at scale: a large recorded store, read back lazily.

    python bench/bench_analysis.py [--steps 10000] [--layers 200] [--store DIR] [--keep]

The store is a real recording (the Recorder's own code path, nothing written by
hand): a chain of ``--layers`` small Linear+tanh layers whose last layer is
wide (256 x 1024 floats = 1 MiB a step).  Statistics and histograms of every
layer's activations at every step; full tensors of every layer every 10th
step; a NaN injected at 70% of the steps in layer 120.

Timed (median of 5, each from a fresh ``open_run``):
  open_run, first_nonfinite, plot_evolution of 50 layers over all steps
  (rendered to PNG), and a full-tensor scan (a histogram over all steps of the
  wide layer, with dask) against reading the same files raw.  Peak memory of
  the scan is measured in fresh subprocesses over 1/4, 1/2 and all of the
  steps: it must stay flat.
Side by side: TensorBoard loading the same per-layer ``std`` scalars from its
event files (EventAccumulator, the loader TensorBoard itself uses), and then
the 50-layer evolution, against tensortape doing the same.

    python bench/bench_analysis.py --compare --steps 80 --layers 32 [--tensors-every 1]
                                   [--first-answer | --compare-runs]

Two runs instead (``Linear(64, 64)`` layers on 48 rows; the second's input 1%
larger from 75% of the steps on): ``compare_runs``, ``first_divergence`` (of the
two, and of a run against itself: every full tensor read) and the served page's
map (``compare_map``), each from a fresh ``open_run``, side by side with reading
the same arrays once with zarr (every full tensor and the statistics of both);
the served page's first answer (a new server's ``compare_map``: the statistics
alone, the full tensors compared after it in the server's thread); then
``tensortape compare`` as a new process (its imports included).
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

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensortape.recorder import Recorder  # noqa: E402

WIDE, BATCH, NAN_LAYER = 1024, 256, 120


class Chain(nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n - 1))
        self.wide = nn.Linear(8, WIDE)
        self.poison = None

    def forward(self, x, step):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == NAN_LAYER and step == self.poison:
                x = x.clone()
                x[0, 0] = float("nan")
        return self.wide(x + torch.randn_like(x))   # fresh data: the chain alone converges


def record(path, steps, n_layers):
    model = Chain(n_layers)
    model.poison = int(steps * 0.7)
    t = time.perf_counter()
    with torch.no_grad(), Recorder(model, path, layers=["layers.*", "wide"], capture="activations",
                                   tensors_every=10) as rec:
        for i in range(steps):
            with rec.step(i):
                model(torch.randn(BATCH, 8), i)
    return time.perf_counter() - t


def median_time(fn, repeat=5):
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


SCAN = """
import sys, time, tracemalloc, numpy as np, dask.array as da
from tensortape.analysis import open_run
path, frac = sys.argv[1], float(sys.argv[2])
x = open_run(path).tensor("wide").data
x = x[: max(1, int(x.shape[0] * frac))]
tracemalloc.start()          # numpy and the codecs report their buffers to tracemalloc
t = time.perf_counter()
counts, _ = da.histogram(x, bins=64, range=(-4, 4))
counts = counts.compute()
dt = time.perf_counter() - t
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
block = x.blocks[0].compute()
t = time.perf_counter()
for _ in range(x.numblocks[0]):
    np.histogram(block, bins=64, range=(-4, 4))
floor = time.perf_counter() - t
print(dt, x.nbytes, int(counts.sum()), peak, floor)
"""


def scan(path, frac):
    out = subprocess.run([sys.executable, "-c", SCAN, path, str(frac)], capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dt, nbytes, count, peak, floor = out.stdout.split()
    return float(dt), int(nbytes), int(count), int(peak), float(floor)


def raw_read(folder):
    t = time.perf_counter()
    n = 0
    for d, _, fs in os.walk(folder):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                n += len(fh.read())
    return time.perf_counter() - t, n


def tensorboard_side(path, run, layers50, steps):
    """Write the same std scalars to TensorBoard event files, then load them as TB does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    std = run.stats("activations")["std"].values        # (step, layer), all in memory
    names = list(run.stats("activations").layer.values)
    logdir = os.path.join(path + "-tb")
    shutil.rmtree(logdir, ignore_errors=True)
    t = time.perf_counter()
    w = SummaryWriter(logdir)
    for i, s in enumerate(steps):
        for j, name in enumerate(names):
            w.add_scalar(f"std/{name}", float(std[i, j]), int(s))
    w.close()
    write_s = time.perf_counter() - t

    def tb_load():
        acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
        acc.Reload()
        return {n: np.array([e.value for e in acc.Scalars(f"std/{n}")]) for n in layers50}

    def tt_load():
        from tensortape.analysis import open_run
        r = open_run(path)
        return r.stats("activations", layers50)["std"].values

    t = time.perf_counter()
    tb_values = tb_load()              # one load: TensorBoard takes minutes at this size
    tb = time.perf_counter() - t
    tt = median_time(tt_load, repeat=3)
    same = np.allclose(np.stack([tb_values[n] for n in layers50], 1), tt_load(), equal_nan=True)
    return write_s, tb, tt, same, dir_bytes(logdir)


def record_pair(folder, steps, n_layers, every):
    """Two runs of one chain, the second's input 1% larger from 75% of the steps on."""
    paths = [os.path.join(folder, n) for n in ("a.zarr", "b.zarr")]
    for path, scale_from in zip(paths, (None, int(steps * 0.75))):
        if os.path.exists(path):
            continue
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(n_layers)))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad(), Recorder(model, path, capture="activations",
                                       tensors_every=every) as rec:
            for i in range(steps):
                x = torch.randn(48, 64, generator=gen)
                with rec.step(i):
                    model(x * 1.01 if scale_from is not None and i >= scale_from else x)
    return paths


def read_once(paths):
    """Every full tensor and the statistics of each run, read whole with zarr."""
    import zarr
    n = 0
    for path in paths:
        root = zarr.open_group(path, mode="r")
        arrays = [root["rank0/stats/activations/stats"]]
        tensors = root["rank0/tensors/activations"]
        arrays += [tensors[k]["data"] for k, _ in tensors.groups()]
        n += sum(np.asarray(a[:]).nbytes for a in arrays)
    return n


def cpu_time(fn):
    """The process's CPU seconds (every thread) that ``fn`` takes: on a loaded machine,
    closer to its wall time alone than its wall time there."""
    t = time.process_time()
    fn()
    return time.process_time() - t


def compare_bench(folder, steps, n_layers, every, first_only=False, runs_only=False):
    from tensortape.analysis import compare_runs, first_divergence, open_run
    from tensortape.analysis.browser._api import compare_map
    a, b = record_pair(folder, steps, n_layers, every)
    print(f"two runs of {steps} steps x {n_layers} layers (+ the root), full tensors every "
          f"{every} steps: {dir_bytes(a) / 1e6:.0f} and {dir_bytes(b) / 1e6:.0f} MB on disk; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if runs_only:                # one call a process, after a warm-up call of one layer
        compare_runs(a, b, layers="0")
        t = time.perf_counter()
        cpu = cpu_time(lambda: compare_runs(a, b))
        print(f"{'compare_runs (one call)':38s} {(time.perf_counter() - t) * 1e3:8.0f} ms, "
              f"CPU {cpu * 1e3:6.0f} ms")
        return
    if first_only:               # one answer: the process ends with its comparison's thread
        print(f"{'the page first answers (a new server)':38s} "
              f"{first_answer(a, b, wait=False) * 1e3:8.0f} ms")
        return
    import zarr  # noqa: F401  (imports are not what is timed)
    compare_runs(a, b, layers="0")
    nbytes = read_once((a, b))
    t_read = median_time(lambda: read_once((a, b)), repeat=3)
    print(f"read the same arrays once with zarr     {t_read * 1e3:8.0f} ms  ({nbytes / 1e6:.0f} MB)")
    timed = {
        "compare_runs": lambda: compare_runs(a, b),
        "first_divergence": lambda: first_divergence(a, b),
        "first_divergence, a run against itself": lambda: first_divergence(a, a),
        "the page's map (compare_map)": lambda: compare_map(open_run(a), open_run(b)),
    }
    cpu_read = cpu_time(lambda: read_once((a, b)))
    print(f"{'':38s} CPU {cpu_read * 1e3:8.0f} ms")
    for name, fn in timed.items():
        t = median_time(fn, repeat=3)
        cpu = cpu_time(fn)
        print(f"{name:38s} {t * 1e3:8.0f} ms  = {t / t_read:5.1f}x reading once; CPU {cpu * 1e3:6.0f} "
              f"ms = {cpu / cpu_read:5.1f}x")
    page_first(a, b)
    wall, cpu = command_time(["compare", a, b])
    print(f"{'tensortape compare (a new process)':38s} {wall * 1e3:8.0f} ms  = {wall / t_read:5.1f}x "
          f"reading once; CPU {cpu * 1e3:6.0f} ms (imports included)")
    print(f"first divergence: {first_divergence(a, b)}")


def page_first(a, b) -> None:
    took = [first_answer(a, b) for _ in range(3)]
    print(f"{'the page first answers (a new server)':38s} {statistics.median(took) * 1e3:8.0f} ms "
          f"median of {', '.join(f'{t * 1e3:.0f}' for t in took)} ms (then the full tensors, "
          f"in its thread)")


def first_answer(a, b, wait: bool = True) -> float:
    """Seconds to a new server's first two-run answer (``compare_map`` with a new
    cache); then (``wait``) its comparison of the full tensors, in the server's
    thread, is waited for, so that it competes with nothing timed after."""
    from tensortape.analysis import open_run
    from tensortape.analysis.browser._api import compare_map
    cache = {}
    ra, rb = open_run(a), open_run(b)
    t = time.perf_counter()
    compare_map(ra, rb, cache=cache)
    took = time.perf_counter() - t
    for c in cache.values() if wait else ():
        while c.full is None and c.error is None:
            time.sleep(0.05)
    return took


def command_time(args):
    """Wall and CPU seconds (the child's, every thread) of one ``tensortape`` command."""
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tensortape.cli", *args], stdout=subprocess.DEVNULL,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--store", default=None, help="where to record (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the store (and reuse it next time)")
    ap.add_argument("--compare", action="store_true", help="two runs compared (see above)")
    ap.add_argument("--tensors-every", type=int, default=1, help="with --compare")
    ap.add_argument("--first-answer", action="store_true",
                    help="with --compare: time only the page's first answer")
    ap.add_argument("--compare-runs", action="store_true",
                    help="with --compare: time only compare_runs (one call, after a warm-up)")
    args = ap.parse_args()
    tmp = None
    path = args.store
    if args.compare:
        folder = path or tempfile.mkdtemp(prefix="tt-bench-compare-")
        try:
            compare_bench(folder, args.steps, args.layers, args.tensors_every,
                          args.first_answer, args.compare_runs)
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
        return
    if path is None:
        tmp = tempfile.mkdtemp(prefix="tt-bench-analysis-")
        path = os.path.join(tmp, "big.zarr")
    try:
        if not os.path.exists(path):
            secs = record(path, args.steps, args.layers)
            print(f"recorded {args.steps} steps x {args.layers} layers in {secs:.0f} s "
                  f"({dir_bytes(path) / 1e9:.2f} GB on disk)")
        from tensortape.analysis import open_run
        run = open_run(path)
        steps = run.steps("activations")
        layers50 = run.layers[:50]
        print(f"store: {len(run.layers)} layers, {len(steps)} steps of statistics, "
              f"{len(run.steps('activations', tensors=True))} steps of full tensors, "
              f"{dir_bytes(path) / 1e9:.2f} GB")

        t_open = median_time(lambda: open_run(path))
        first = open_run(path).first_nonfinite()
        t_first = median_time(lambda: open_run(path).first_nonfinite())

        def evolution():
            import io
            fig = open_run(path).plot_evolution(layers50, stat="std")
            fig.savefig(io.BytesIO(), format="png", dpi=100)
        t_plot = median_time(evolution, repeat=3)
        print(f"open_run                      {t_open * 1e3:8.1f} ms   (target < 1000 ms)")
        print(f"first_nonfinite               {t_first * 1e3:8.1f} ms   (target < 1000 ms) -> "
              f"step {first.step}, {first.layer!r}")
        print(f"plot_evolution 50 layers, PNG {t_plot * 1e3:8.1f} ms   (target < 2000 ms)")

        rows = [scan(path, f) for f in (0.25, 0.5, 1.0)]
        data_dir = os.path.join(path, "rank0", "tensors", "activations", "wide", "data")
        t_raw, n_raw = raw_read(data_dir)
        dt, nbytes, _, _, floor = rows[-1]
        print(f"full-tensor scan, histogram of 'wide' over all steps: {dt * 1e3:.0f} ms for "
              f"{nbytes / 1e6:.0f} MB ({nbytes / dt / 1e6:.0f} MB/s)")
        print(f"  floor: reading its {n_raw / 1e6:.0f} MB of files raw {t_raw * 1e3:.0f} ms + "
              f"np.histogram of the same bytes in memory {floor * 1e3:.0f} ms -> scan / floor = "
              f"{dt / (t_raw + floor):.2f}")
        print("  peak memory of the scan (tracemalloc): " + ", ".join(
            f"{frac:.0%} of steps ({r[1] / 1e6:.0f} MB): {r[3] / 1e6:.0f} MB"
            for frac, r in zip((0.25, 0.5, 1.0), rows)))

        write_s, tb, tt, same, tb_bytes = tensorboard_side(path, run, layers50, steps)
        print(f"TensorBoard: {len(steps) * len(run.layers)} std scalars written in {write_s:.0f} s "
              f"({tb_bytes / 1e6:.0f} MB of event files)")
        print(f"evolution of 50 layers, load from disk: TensorBoard {tb * 1e3:.0f} ms, tensortape "
              f"{tt * 1e3:.0f} ms -> {tb / tt:.1f}x faster (same values: {same})")
    finally:
        if tmp and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(path + "-tb", ignore_errors=True)


if __name__ == "__main__":
    main()
