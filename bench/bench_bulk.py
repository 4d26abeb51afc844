"""Full tensors at the disk's speed: tensortape against the plain ways of writing
(and reading) the same bytes, side by side in one run (ratios, never absolute
claims).

    python bench/bench_bulk.py [--layers 4] [--shape 4 256 512] [--block 8] [--rounds 2]
                               [--read] [--small] [--json PATH] [--dir DIR]

**Write.**  A model of ``--layers`` layers, each adding a constant to its input
(one pass over ``--shape`` float32: the activations of a residual stream), run
under ``no_grad``; every contender takes every layer's output at every step:

  plain write    the bytes written to one file from the hook, fsync'd: the disk's limit
  torch.save     a dict of the step's tensors (cloned in the hook) per step
  safetensors    the same dict, ``safetensors.torch.save_file`` per step
  memmap         a numpy memmap per layer, the step's slice written from the hook
  tensortape     full tensors every step, ``compression=None`` and the default ("auto")

Contenders take turns in blocks of ``--block`` steps, for ``--rounds`` rounds
after one warm-up round.  A block ends with the contender's flush and an fsync
of every file it wrote, so each pays for its bytes reaching the disk.  Per
contender: the training thread's added time a step against the bare step (the
median step, and sustained: the block's whole time), the tensor data's MB/s
over the sustained added time, that as a share of the plain write, and the
bytes on disk.

**Read** (``--read``): one layer's rows (``d`` = the last axis), dropped from
the page cache before each reader (``posix_fadvise(DONTNEED)``, after the
fsync): a plain sequential read of its memmap file; tensortape's
``run.rows(..., batch_size=4096)`` shuffled and in order; batches of 4096
random rows from the memmap; and a Hugging Face ``datasets`` Arrow copy of the
same rows, in order and shuffled (``pip install datasets``; skipped without).

**Device to host** (``--d2h``, on a CUDA device; torch alone): the numbers the
GPU plan needs.  GB/s of a device-to-host copy of 4, 64 and 512 MB into
pageable memory (``.cpu()``), into a pinned buffer allocated for it, and into
one from a pool (allocated once); the cost of pinning a buffer; and a step of
matmuls (bf16, 8192^2) alone against the same step with its activations copied
to pinned buffers on a side stream (the training stream never waits for them):
the added time a step, and the copies' GB/s while it runs.

**Small** (``--small``): 200 layers of (4, 16): the added time per tensor of
tensortape's full tensors (``compression=None``) and of torch.save.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
from torch import nn

MB = 1e6


class Emit(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x + self.k


def model(layers: int) -> nn.Module:
    return nn.Sequential(*(Emit(0.01 * i) for i in range(layers)))


def fsync_tree(path: str, drop: bool = False) -> None:
    """fsync every file under ``path`` (and drop it from the page cache)."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class Contender:
    """A model copy and what it does around a step: ``hook(name, t)`` on every
    layer's output, ``after(i)`` at the step's end, ``end()`` at a block's."""

    def __init__(self, layers, where, hook=None, after=None, end=None, before=None):
        self.m = model(layers)
        self.where = where
        self.before, self.after, self.end = before, after, end
        if hook is not None:
            for n, mod in self.m.named_children():
                mod.register_forward_hook(functools.partial(_take, hook, n))
        self.steps: list[float] = []
        self.blocks: list[float] = []

    def block(self, xs, start, n, keep):
        t0 = time.perf_counter()
        for i in range(start, start + n):
            t = time.perf_counter()
            with torch.no_grad(), (self.before and self.before(i)) or contextlib.nullcontext():
                self.m(xs[i % len(xs)])
            if self.after is not None:
                self.after(i)
            if keep:
                self.steps.append(time.perf_counter() - t)
        if self.end is not None:
            self.end()
        if self.where is not None:
            fsync_tree(self.where)
        if keep:
            self.blocks.append((time.perf_counter() - t0) / n)


def _take(hook, name, module, args, out):
    hook(name, out)             # and return None: the output stays the module's


def run(contenders: dict, xs, rounds: int, block: int) -> dict:
    step = 0
    for r in range(rounds + 1):                 # round 0 warms up
        for c in contenders.values():
            c.block(xs, step, block, keep=r > 0)
        step += block
    return {k: (statistics.median(c.steps), statistics.mean(c.blocks))
            for k, c in contenders.items()}


def plain(layers, tmp):
    path = os.path.join(tmp, "plain.raw")
    f = open(path, "wb", buffering=0)
    return Contender(layers, path, hook=lambda n, t: f.write(t.numpy().data),
                     end=lambda: os.fsync(f.fileno())), f


def per_step(layers, tmp, name, save):
    where = os.path.join(tmp, name)
    os.makedirs(where)
    buf = {}

    def after(i):
        save(dict(buf), os.path.join(where, f"step{i}"))
        buf.clear()
    return Contender(layers, where, hook=lambda n, t: buf.__setitem__(n, t.clone()), after=after)


def memmaps(layers, tmp, shape, steps):
    where = os.path.join(tmp, "memmap")
    os.makedirs(where)
    maps = {str(i): np.lib.format.open_memmap(os.path.join(where, f"{i}.npy"), "w+", np.float32,
                                              (steps, *shape)) for i in range(layers)}
    at = {"i": 0}

    def end():
        for m in maps.values():
            m.flush()
    return Contender(layers, where, hook=lambda n, t: maps[n].__setitem__(at["i"], t.numpy()),
                     end=end, before=lambda i: at.__setitem__("i", i)), maps


def tensortape(layers, tmp, compression, name="tt"):
    where = os.path.join(tmp, f"{name}-{compression}.zarr")
    c = Contender(layers, where)
    from tensortape import Recorder
    rec = Recorder(c.m, where, layers=[str(i) for i in range(layers)], capture="activations", tensors_every=1,
                   compression=compression, max_bytes=None).attach()
    c.before = lambda i: rec.step(i)
    c.end = rec.flush
    return c, rec


def bench_write(args, tmp):
    shape = tuple(args.shape)
    steps = (args.rounds + 1) * args.block
    xs = [torch.randn(shape) for _ in range(3)]
    step_bytes = args.layers * int(np.prod(shape)) * 4
    c = {"bare": Contender(args.layers, None)}
    c["plain write + fsync"], f = plain(args.layers, tmp)
    c["torch.save"] = per_step(args.layers, tmp, "torch.save",
                               lambda d, p: torch.save(d, p + ".pt"))
    try:
        from safetensors.torch import save_file
        c["safetensors"] = per_step(args.layers, tmp, "safetensors",
                                    lambda d, p: save_file(d, p + ".safetensors"))
    except ImportError:
        print("safetensors is not installed: skipped")
    c["numpy memmap"], maps = memmaps(args.layers, tmp, shape, steps)
    recs = {}
    for name, comp in (("tensortape compression=None", None), ("tensortape default", "auto")):
        c[name], recs[name] = tensortape(args.layers, tmp, comp)
    res = run(c, xs, args.rounds, args.block)
    for rec in recs.values():
        rec.close()
    f.close()
    bare_med, bare_sus = res["bare"]
    out = {}
    for k, (med, sus) in res.items():
        if k == "bare":
            continue
        added = max(sus - bare_sus, 1e-9)
        out[k] = {"added_ms_median": (med - bare_med) * 1e3, "added_ms_sustained": added * 1e3,
                  "MB_per_s": step_bytes / added / MB,
                  "disk_MB": disk_bytes(c[k].where) / MB}
    limit = out["plain write + fsync"]["MB_per_s"]
    save = out["torch.save"]["added_ms_sustained"]
    for v in out.values():
        v["of_plain_write"] = v["MB_per_s"] / limit
        v["of_torch_save_time"] = v["added_ms_sustained"] / save
    print(f"\nwrite: {args.layers} layers x {shape} float32 = {step_bytes / MB:.1f} MB a step, "
          f"{args.rounds} rounds of {args.block} steps; bare step {bare_med * 1e3:.1f} ms")
    print(f"{'contender':30s} {'added/step med':>14s} {'sustained':>10s} {'MB/s':>8s} "
          f"{'of plain':>8s} {'x save':>7s} {'disk MB':>8s}")
    for k, v in out.items():
        print(f"{k:30s} {v['added_ms_median']:11.1f} ms {v['added_ms_sustained']:7.1f} ms "
              f"{v['MB_per_s']:8.1f} {v['of_plain_write']:7.0%} {v['of_torch_save_time']:6.2f}x "
              f"{v['disk_MB']:8.1f}")
    return out, {"store": c["tensortape compression=None"].where,
                 "memmap": os.path.join(tmp, "memmap", "0.npy"), "steps": steps}


def timed_read(name, where, fn, nbytes, results):
    fsync_tree(where, drop=True)
    t = time.perf_counter()
    got = fn()
    dt = time.perf_counter() - t
    results[name] = {"MB_per_s": nbytes / dt / MB, "seconds": dt, "rows": got}


def bench_read(args, written, tmp):
    store, mm_path = written["store"], written["memmap"]
    d = args.shape[-1]
    mm = np.load(mm_path, mmap_mode="r")
    n_rows, nbytes = mm.size // d, mm.nbytes
    del mm                          # a mapped page stays in the page cache: none is kept
    res: dict = {}

    def sequential():
        buf = bytearray(8 << 20)
        n = 0
        with open(mm_path, "rb", buffering=0) as f:
            while (k := f.readinto(buf)):
                n += k
        return n // (4 * d)

    from tensortape import open_run
    open_run(store).rows("0")       # the reader's modules imported outside the timings

    def tt(shuffle):
        def go():
            r = open_run(store).rows("0", shuffle=shuffle, batch_size=4096, seed=0)
            return sum(len(b["x"]) for b in r)
        return go

    def memmap_random():
        m = np.load(mm_path, mmap_mode="r").reshape(-1, d)
        order = np.random.default_rng(0).permutation(len(m))
        return sum(len(m[np.sort(order[i:i + 4096])]) for i in range(0, len(m), 4096))

    timed_read("plain sequential read", mm_path, sequential, nbytes, res)
    timed_read("tensortape rows, shuffled", store, tt(True), nbytes, res)
    timed_read("tensortape rows, in order", store, tt(False), nbytes, res)
    timed_read("numpy memmap, random rows", mm_path, memmap_random, nbytes, res)
    try:
        import datasets
        where = os.path.join(tmp, "arrow")
        features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32"), length=d)})
        rows = np.load(mm_path).reshape(-1, d)
        datasets.Dataset.from_dict({"x": rows}, features=features).save_to_disk(where)
        del rows
        fsync_tree(where)

        def arrow(shuffle):
            def go():
                ds = datasets.load_from_disk(where).with_format("numpy")
                if shuffle:
                    ds = ds.shuffle(seed=0)
                return sum(len(b["x"]) for b in ds.iter(batch_size=4096))
            return go
        timed_read("HF datasets Arrow, in order", where, arrow(False), nbytes, res)
        timed_read("HF datasets Arrow, shuffled", where, arrow(True), nbytes, res)
    except ImportError:
        print("datasets is not installed: its rows skipped (pip install datasets)")
    base = res["plain sequential read"]["MB_per_s"]
    print(f"\nread: one layer, {n_rows} rows of {d} float32 ({nbytes / MB:.0f} MB), "
          f"each reader from disk (dropped from the page cache first)")
    for k, v in res.items():
        v["of_sequential"] = v["MB_per_s"] / base
        assert v["rows"] == n_rows, (k, v["rows"], n_rows)
        print(f"{k:32s} {v['MB_per_s']:8.1f} MB/s {v['of_sequential']:6.0%}  ({v['seconds']:.2f} s)")
    return res


def bench_small(args, tmp):
    layers, shape = 200, (4, 16)
    xs = [torch.randn(shape) for _ in range(3)]
    c = {"bare": Contender(layers, None)}
    c["torch.save"] = per_step(layers, tmp, "small-save", lambda d, p: torch.save(d, p + ".pt"))
    c["tensortape compression=None"], rec = tensortape(layers, tmp, None, "small")
    res = run(c, xs, args.rounds, 4 * args.block)
    rec.close()
    bare = res["bare"]
    out = {k: {"added_us_per_tensor_median": (m - bare[0]) / layers * 1e6,
               "added_us_per_tensor_sustained": (s - bare[1]) / layers * 1e6}
           for k, (m, s) in res.items() if k != "bare"}
    print(f"\nsmall: {layers} layers x {shape} float32; bare step {bare[0] * 1e3:.2f} ms")
    for k, v in out.items():
        print(f"{k:30s} {v['added_us_per_tensor_median']:8.1f} us a tensor (median), "
              f"{v['added_us_per_tensor_sustained']:8.1f} us sustained")
    return out


def bench_d2h(args):
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(dev)}

    def rate(fn, nbytes, reps=5):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return nbytes * reps / (time.perf_counter() - t) / 1e9

    for mb in (4, 64, 512):
        n = mb << 20
        x = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_()
        pool = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
        t = time.perf_counter()
        fresh = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
        pin_s = time.perf_counter() - t
        del fresh
        out[f"{mb} MB"] = {
            "pageable GB/s": rate(lambda: x.cpu(), n),
            "pinned, allocated each time GB/s": rate(
                lambda: torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True).copy_(
                    x, non_blocking=True), n),
            "pinned pool GB/s": rate(lambda: pool.copy_(x, non_blocking=True), n),
            "pin a buffer ms/GB": pin_s * 1e3 / (n / 1e9)}
    w = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    h0 = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    layers = 8
    pool = [torch.empty_like(h0, device="cpu").pin_memory() for _ in range(layers)]
    side = torch.cuda.Stream()

    def step(copy):
        h = h0
        for i in range(layers):
            h = torch.tanh(h @ w)
            if copy:
                done = torch.cuda.Event()
                done.record()
                with torch.cuda.stream(side):
                    side.wait_event(done)
                    pool[i].copy_(h, non_blocking=True)
                    h.record_stream(side)
        return h

    def timed(copy, reps=10):
        step(copy)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            step(copy)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps
    bare, copied = timed(False), timed(True)
    nbytes = layers * h0.numel() * 2
    out["step"] = {"layers": layers, "MB copied a step": nbytes / MB, "bare ms": bare * 1e3,
                   "with side-stream copies ms": copied * 1e3,
                   "added": copied / bare - 1, "copies GB/s during the step": nbytes / copied / 1e9}
    print(json.dumps(out, indent=1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shape", type=int, nargs="+", default=[4, 256, 512])
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--read", action="store_true")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--d2h", action="store_true", help="only the device-to-host copies (CUDA)")
    ap.add_argument("--json")
    ap.add_argument("--dir", help="where to write (default: a temporary folder; the disk measured)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-bulk-", dir=args.dir)
    report = {"load_before": os.getloadavg(), "cpus": os.cpu_count(), "args": vars(args)}
    if args.d2h:
        report["d2h"] = bench_d2h(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return
    try:
        report["write"], written = bench_write(args, tmp)
        if args.read:
            report["read"] = bench_read(args, written, tmp)
        if args.small:
            report["small"] = bench_small(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["load_after"] = os.getloadavg()
    print(f"\nload average before {report['load_before'][0]:.2f}, after "
          f"{report['load_after'][0]:.2f} ({report['cpus']} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
