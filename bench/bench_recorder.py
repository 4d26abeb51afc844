"""Recorder overhead, side by side in one run (ratios, never absolute claims).

    python bench/bench_recorder.py [--only MODE ...] [--rounds N]   (MODE: many parts stats full kernel first)

Workloads, on the CPU:

- ``stats``, ``full``, ``kernel``: nn.TransformerEncoder, 4 layers, d=256, batch
  16 x 128 tokens, torch's default threads; every self-attention and Linear output
  and its gradient is captured (12 activations and 12 gradients a step, 2-8 MB each).
- ``many``: nn.Sequential of 200 Linear(16, 16), batch 4, on one thread,
  ``layers=["*"]``: 402 tiny captures a step, where the fixed cost per captured
  tensor is all there is.

Every contender trains its own identical copy of the model.  The contenders take
turns in blocks of steps, for several rounds (after one warm-up round), so
machine noise hits them all alike.  Each block ends with the contender's flush
(the recorder's writer catching up and committing; TensorBoard's flush), so a
background writer cannot hide its cost in the next contender's block.
Reported per contender, relative to the bare step: the median step (the flush
excluded) and the sustained step (a block's whole time, flush included, over its
steps: what a long run pays).

  full    tensortape full tensors every step  vs torch.save of the same tensors
          (twice: the default compression="auto", and compression=None)
  stats   tensortape statistics only (and in on_nonfinite="replay" mode, which keeps
          every recorded call's inputs and snapshots the step's tensors)
                                              vs TensorBoard add_histogram of the
          same tensors (hooks wired by hand)  vs wandb.watch(log="all") offline
          (parameters and their gradients only: wandb cannot see activations)
  many    tensortape statistics only, and full tensors (the default
          tensors_every=1)                    vs TensorBoard add_histogram; and the
          added time per captured tensor
  parts   on the ``many`` model: the added time per captured tensor of each part
          of the recorder, cumulatively (plain torch hooks doing nothing; tensortape's
          hooks into a null sink; + the capture record and clone; + the step-end
          packing, the engine stubbed; + the engine; + the writer thread, first
          interpreting the records only, then writing the store); the training
          thread's step with the writer on and off.  The parts are switched off
          through internals (no public switch exists): a bench-only measurement
  kernel  the statistics engine per tensor    vs one read of it (x.sum()): MB/s and
          the ratio to that floor
  first   the first steps of a fresh process (the kernels compile or load at their
          first use), recorded                vs bare, each in its own process: the
          attach, steps 0, 1 and the median of steps 2-5, wall and CPU seconds (a
          compile in a child process included once it has ended); ``--rounds N``
          pairs (default 1), each with empty caches under ``NUMBA_CACHE_DIR`` and
          ``TORCHINDUCTOR_CACHE_DIR`` where they are set
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

from tensortape.recorder import Recorder

LAYERS = ["layers.*.self_attn", "layers.*.linear*"]


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    m = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return m, torch.randn(16, 128, 256), LAYERS


def many_linears():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(200)]), torch.randn(4, 16), ["*"]


def hand_hooks(m, patterns, sink):
    """What users wire by hand for TensorBoard or torch.save: outputs and their grads."""
    handles = []
    for n, mod in m.named_modules():
        if any(fnmatch.fnmatchcase(n, p) for p in patterns):
            def fwd(module, a, out, n=n):
                t = out[0] if isinstance(out, tuple) else out
                sink("act/" + n, t)
                t.register_hook(lambda g: sink("grad/" + n, g))
            handles.append(mod.register_forward_hook(fwd))
    return handles


class Contender:
    """One model copy, its optimiser, and what it does around a training step."""

    def __init__(self, base, x, before=None, after=None, end_block=None):
        self.m = copy.deepcopy(base)
        self.x = x
        self.opt = torch.optim.SGD(self.m.parameters(), lr=1e-4)
        self.before, self.after, self.end_block = before, after, end_block
        self.steps: list[float] = []
        self.blocks: list[float] = []
        self.cpu: list[float] = []        # the process's CPU seconds a step, per block
        self.thread: list[float] = []     # the training thread's alone

    def step(self, i):
        with (self.before(i) if self.before else None) or contextlib.nullcontext():
            self.m(self.x).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.after:
            self.after(i)

    def block(self, start, n, keep):
        t0, c0, h0 = time.perf_counter(), _cpu(), time.thread_time()
        for i in range(start, start + n):
            t = time.perf_counter()
            self.step(i)
            if keep:
                self.steps.append(time.perf_counter() - t)
        if self.end_block:
            self.end_block()
        if keep:
            self.blocks.append((time.perf_counter() - t0) / n)
            self.cpu.append((_cpu() - c0) / n)
            self.thread.append((time.thread_time() - h0) / n)


def run(contenders, rounds, block):
    """Blocks in turn; per contender (median step, sustained step) in seconds."""
    step = 0
    for r in range(rounds + 1):            # round 0 warms up (compilation, caches)
        for c in contenders.values():
            c.block(step, block, keep=r > 0)
        step += block
    return {k: (statistics.median(c.steps), statistics.mean(c.blocks))
            for k, c in contenders.items()}


def recorder(c, store, layers, **kw):
    kw.setdefault("max_bytes", None)       # no disk budget: every full tensor is stored, as
    rec = Recorder(c.m, store, layers=layers, **kw).attach()   # torch.save stores them
    c.before, c.end_block = (lambda i: rec.step()), rec.flush
    return rec


def tensorboard(c, tmp, layers):
    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(os.path.join(tmp, "tb"))
    box = {"i": 0}
    hand_hooks(c.m, layers, lambda k, t: w.add_histogram(k, t.detach(), box["i"]))
    c.before, c.end_block = (lambda i: box.__setitem__("i", i)), w.flush
    return w


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench_full(tmp, rounds, block):
    base, x, layers = transformer()
    c = {"bare": Contender(base, x)}
    recs = {}
    for name, compression in (("tensortape full", "auto"), ("tensortape full, uncompressed", None)):
        tt = c[name] = Contender(base, x)
        store = os.path.join(tmp, f"{compression}.zarr")
        recs[store] = recorder(tt, store, layers, tensors_every=1, compression=compression)
    sv = c["torch.save"] = Contender(base, x)
    buf, save_dir = {}, os.path.join(tmp, "save")
    os.makedirs(save_dir)
    hand_hooks(sv.m, layers, lambda k, t: buf.__setitem__(k, t.detach().clone()))

    def save(i):
        torch.save(dict(buf), os.path.join(save_dir, f"step{i}.pt"))
        buf.clear()
    sv.after = save
    res = run(c, rounds, block)
    for rec in recs.values():
        rec.close()
    from tensortape.analysis import open_run
    store = next(iter(recs))
    sizes = (open_run(store).summary()["bytes_raw"], dir_bytes(store), dir_bytes(save_dir))
    return res, sizes


def bench_stats(tmp, rounds, block):
    base, x, layers = transformer()
    c = {"bare": Contender(base, x)}
    rec = recorder(c.setdefault("tensortape stats", Contender(base, x)),
                   os.path.join(tmp, "stats.zarr"), layers, tensors_every=None)
    replay = recorder(c.setdefault("tensortape stats, replay mode", Contender(base, x)),
                      os.path.join(tmp, "replay.zarr"), layers, tensors_every=None,
                      on_nonfinite="replay")
    w = tensorboard(c.setdefault("tensorboard add_histogram", Contender(base, x)), tmp, layers)
    wb_run = None
    try:
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
        import wandb
        wb_run = wandb.init(project="tt-bench", dir=tmp)
        wb = c["wandb.watch (params only)"] = Contender(base, x)
        wandb.watch(wb.m, log="all", log_freq=1)
        wb.after = lambda i: wandb.log({"step": i})
    except Exception as e:  # wandb missing or failing: say so, do not hide it
        print(f"wandb skipped: {e}")
    res = run(c, rounds, block)
    rec.close()
    replay.close()
    w.close()
    if wb_run is not None:
        wb_run.finish()
    return res, None


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside (the ``many`` workloads); its thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bench_many(tmp, rounds, block):
    with one_thread():
        base, x, layers = many_linears()
        c = {"bare": Contender(base, x)}
        recs = [recorder(c.setdefault("tensortape stats", Contender(base, x)),
                         os.path.join(tmp, "many-stats.zarr"), layers, tensors_every=None),
                recorder(c.setdefault("tensortape full (default)", Contender(base, x)),
                         os.path.join(tmp, "many-full.zarr"), layers)]
        w = tensorboard(c.setdefault("tensorboard add_histogram", Contender(base, x)), tmp, layers)
        res = run(c, rounds, block)
        for rec in recs:
            rec.close()
        w.close()
        from tensortape.analysis import open_run
        return res, 2 * len(open_run(os.path.join(tmp, "many-stats.zarr")).layers)


def bench_parts(tmp, rounds, block):
    """``parts``: each part's added time per captured tensor (``bench_parts.py``)."""
    from bench_parts import bench
    return bench(tmp, rounds, block)


def bench_kernel(tmp, rounds, block):
    """Per-tensor time of the statistics engine against one read of the tensor."""
    from tensortape.recorder.capture._engines import Engines
    base, x, layers = transformer()
    seen = []
    m = copy.deepcopy(base)
    hand_hooks(m, layers, lambda k, t: seen.append((k, t.detach().clone())))
    m(x).pow(2).mean().backward()
    engine = Engines().for_tensor(x)
    if hasattr(engine, "ready"):            # numba: its kernels compiled (in the background)
        engine.ready(x.dtype, wait=True)

    def timed(fn, t, reps=10):
        fn(t)
        s = time.perf_counter()
        for _ in range(reps):
            fn(t)
        return (time.perf_counter() - s) / reps
    rows = []
    for name, t in seen[:: max(1, len(seen) // 6)]:
        floor = timed(lambda t: t.sum(), t)
        ours = timed(engine.reduce, t)
        rows.append((name, t.numel() * t.element_size(), floor, ours))
    return rows, engine


def _cpu() -> float:
    """CPU seconds of this process and of its ended children (a compile apart)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def first_steps(recorded: bool, tmp: str) -> dict:
    """Steps 0-5 of the TransformerEncoder in this process (a fresh one): wall
    seconds, and CPU seconds (this process's and its children's: a shared
    machine's load stretches the first, not the second); the attach too."""
    m, x, layers = transformer()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    t0, c0 = time.perf_counter(), _cpu()
    rec = Recorder(m, os.path.join(tmp, "first"), layers=layers, tensors_every=None,
                   mode="w").attach() if recorded else None
    out = {"attach": (time.perf_counter() - t0, _cpu() - c0), "wall": [], "cpu": []}
    for i in range(6):
        t0, c0, h0 = time.perf_counter(), _cpu(), time.thread_time()
        with (rec.step(i) if rec else contextlib.nullcontext()):
            m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out["wall"].append(time.perf_counter() - t0)
        out["cpu"].append(_cpu() - c0)
    if rec:
        rec.close()
    return out


def bench_first(tmp: str, rounds: int) -> list[dict]:
    """``rounds`` pairs of fresh processes, bare then recorded.  Where
    ``NUMBA_CACHE_DIR`` or ``TORCHINDUCTOR_CACHE_DIR`` is set, each process gets an
    empty folder of its own under it, so every round starts with empty caches."""
    import json
    import subprocess
    import sys
    out = []
    for r in range(rounds):
        env = dict(os.environ)
        for var in ("NUMBA_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            if var in os.environ:
                env[var] = tempfile.mkdtemp(prefix=f"round{r}-", dir=os.environ[var])
        res = {}
        for name, flag in (("bare", "0"), ("tensortape stats", "1")):
            p = subprocess.run([sys.executable, __file__, "--first-child", flag, tmp],
                               capture_output=True, text=True, check=True, env=env)
            res[name] = json.loads(p.stdout.strip().splitlines()[-1])
        res["load"] = os.getloadavg()[0]
        out.append(res)
    return out


def print_first(rounds: list[dict]) -> None:
    empty = [v for v in ("NUMBA_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR") if v in os.environ]
    print(f"\n[first] {len(rounds)} rounds of a fresh process each, bare then recorded ("
          + (f"empty {' and '.join(empty)} each" if empty else "the caches as they are")
          + "): attach, step 0, step 1, median of steps 2-5; wall (CPU seconds, children's "
            "included)")
    for i, res in enumerate(rounds):
        print(f"  round {i + 1}, load average {res['load']:.1f}")
        for k in ("bare", "tensortape stats"):
            r = res[k]
            cells = [r["attach"], *zip(r["wall"][:2], r["cpu"][:2]),
                     (statistics.median(r["wall"][2:]), statistics.median(r["cpu"][2:]))]
            print(f"    {k:18s}" + "".join(f" {w * 1e3:7.0f} ms ({c * 1e3:6.0f})" for w, c in cells))
    more = [(res["tensortape stats"]["wall"][0] - res["bare"]["wall"][0],
             res["tensortape stats"]["cpu"][0] - res["bare"]["cpu"][0]) for res in rounds]
    print("  step 0, recorded minus bare: " + ", ".join(f"{w:+.2f} s ({c:+.2f})" for w, c in more)
          + f"; median {statistics.median(w for w, _ in more):+.2f} s "
            f"({statistics.median(c for _, c in more):+.2f})")


def _times(theirs: float, ours: float) -> str:
    """``theirs / ours`` of two added times; none when ours is within the noise (<= 0)."""
    return f"{theirs / ours:.1f}x" if ours > 0 else "no ratio (tensortape's added time <= 0: noise)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", choices=["full", "stats", "many", "parts", "kernel", "first"],
                    default=None)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of blocks (default per mode)")
    ap.add_argument("--first-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first_child:
        import json
        print(json.dumps(first_steps(args.first_child[0] == "1", args.first_child[1])))
        return
    tmp = tempfile.mkdtemp(prefix="tt-bench-")
    print(f"threads={torch.get_num_threads()}")
    modes = (("many", bench_many, 6, 10), ("parts", bench_parts, 12, 10), ("stats", bench_stats, 6, 5),
             ("full", bench_full, 3, 20), ("kernel", bench_kernel, 0, 0), ("first", None, 0, 0))
    try:
        for mode, fn, rounds, block in modes:
            if args.only and mode not in args.only:
                continue
            if mode == "first":
                print_first(bench_first(tmp, args.rounds or 1))
                continue
            res, extra = fn(tmp, args.rounds or rounds, block)
            if mode == "kernel":
                print(f"\n[kernel] {extra} against one read of each tensor (x.sum())")
                for name, nbytes, floor, ours in res:
                    print(f"  {name:34s} {nbytes / 1e6:6.1f} MB  x.sum() {nbytes / floor / 1e6:7.0f} MB/s"
                          f"  engine {nbytes / ours / 1e6:7.0f} MB/s  {ours / floor:5.1f}x the floor")
                continue
            bare_med, bare_sus = res.pop("bare")
            print(f"\n[{mode}] {args.rounds or rounds} rounds of {block}-step blocks; bare step: "
                  f"median {bare_med * 1e3:.1f} ms, sustained {bare_sus * 1e3:.1f} ms")
            if mode == "parts":
                from bench_parts import report
                report(res, (bare_med, bare_sus), extra)
                continue
            for k, (med, sus) in res.items():
                print(f"  {k:30s} median {med / bare_med:6.2f}x bare (+{(med - bare_med) * 1e3:7.1f} ms)"
                      f"   sustained {sus / bare_sus:6.2f}x (+{(sus - bare_sus) * 1e3:7.1f} ms)")
            if mode == "full":
                for k in ("tensortape full", "tensortape full, uncompressed"):
                    print(f"  {k} / torch.save: median {res[k][0] / res['torch.save'][0]:.2f}, "
                          f"sustained {res[k][1] / res['torch.save'][1]:.2f}")
                raw, disk, saved = extra
                print(f"  tensortape: {raw / 1e6:.0f} MB of tensors -> {disk / 1e6:.0f} MB on disk "
                      f"(compression {raw / disk:.2f}, statistics included); torch.save: {saved / 1e6:.0f} MB")
            elif mode == "stats":
                add_tt = res["tensortape stats"][1] - bare_sus
                add_tb = res["tensorboard add_histogram"][1] - bare_sus
                print(f"  added time (sustained), TensorBoard / tensortape: {_times(add_tb, add_tt)}")
            else:
                for k in ("tensortape stats", "tensortape full (default)"):
                    med, sus = res[k]
                    print(f"  {k}: +{(med - bare_med) / extra * 1e6:.0f} us (median), "
                          f"+{(sus - bare_sus) / extra * 1e6:.0f} us (sustained) per captured tensor "
                          f"({extra} a step)")
                add_tt = res["tensortape stats"][1] - bare_sus
                add_tb = res["tensorboard add_histogram"][1] - bare_sus
                print(f"  added time (sustained), TensorBoard / tensortape stats: "
                      f"{_times(add_tb, add_tt)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
