"""Recorder overhead, side by side in one run (ratios, never absolute claims).

Workload: nn.TransformerEncoder, 4 layers, d=256, batch 16 x 128 tokens, on
the CPU; every self-attention and Linear output and its gradient is captured
(12 activations and 12 gradients a step).

    python bench/bench_recorder.py [--only full|stats]

Every contender trains its own identical copy of the model.  The contenders
take turns in blocks of steps, for several rounds (after one warm-up round),
so machine noise hits them all alike.  Reported: the median step time of each
contender relative to the bare step.

Full mode: blocks of 20 steps (about 5 s, the recorder's commit interval), 3
rounds.  A block's time includes a flush (the writer thread catching up and
committing), so a background writer cannot hide its cost in the next
contender's block, and commits come about as often as in real use.
Statistics mode: blocks of 3 steps, 6 rounds; its writer's work is small and
is not flushed per block.

  full   tensortape full tensors every step   vs torch.save of the same tensors
         (twice: the default compression="auto", and compression=None)
  stats  tensortape statistics only           vs TensorBoard add_histogram of the
         same tensors (hooks wired by hand)   vs wandb.watch(log="all") offline
         (parameters and their gradients only: wandb cannot see activations)
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

from recorder import Recorder

LAYERS = ["layers.*.self_attn", "layers.*.linear*"]


def model_and_data():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    m = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return m, torch.randn(16, 128, 256)


def hand_hooks(m, sink):
    """What users wire by hand for TensorBoard or torch.save: outputs and their grads."""
    handles = []
    for n, mod in m.named_modules():
        if any(fnmatch.fnmatchcase(n, p) for p in LAYERS):
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
        self.times: list[float] = []

    def step(self, i):
        with (self.before(i) if self.before else None) or contextlib.nullcontext():
            self.m(self.x).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.after:
            self.after(i)

    def block(self, start, n):
        t = time.perf_counter()
        for i in range(start, start + n):
            self.step(i)
        if self.end_block:
            self.end_block()
        return (time.perf_counter() - t) / n


def run(contenders, rounds, block):
    step = 0
    for r in range(rounds + 1):            # round 0 warms up (compilation, caches)
        for c in contenders.values():
            t = c.block(step, block)
            if r:
                c.times.append(t)
        step += block
    return {k: statistics.median(c.times) for k, c in contenders.items()}


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench_full(base, x, tmp, rounds, block):
    c = {"bare": Contender(base, x)}
    recs = {}
    for name, compression in (("tensortape full", "auto"), ("tensortape full, uncompressed", None)):
        tt = c[name] = Contender(base, x)
        store = os.path.join(tmp, f"{compression}.zarr")
        rec = recs[store] = Recorder(tt.m, store, layers=LAYERS, tensors_every=1,
                                     compression=compression).attach()
        tt.before, tt.end_block = (lambda i, rec=rec: rec.step()), rec.flush
    sv = c["torch.save"] = Contender(base, x)
    buf, save_dir = {}, os.path.join(tmp, "save")
    os.makedirs(save_dir)
    hand_hooks(sv.m, lambda k, t: buf.__setitem__(k, t.detach().clone()))

    def save(i):
        torch.save(dict(buf), os.path.join(save_dir, f"step{i}.pt"))
        buf.clear()
    sv.after = save
    res = run(c, rounds, block)
    for rec in recs.values():
        rec.close()
    from analysis import open_run
    store = next(iter(recs))
    res["_bytes"] = (open_run(store).summary()["bytes_raw"], dir_bytes(store), dir_bytes(save_dir))
    return res


def bench_stats(base, x, tmp, rounds, block):
    c = {"bare": Contender(base, x)}
    tt = c["tensortape stats"] = Contender(base, x)
    rec = Recorder(tt.m, os.path.join(tmp, "stats.zarr"), layers=LAYERS, tensors_every=None).attach()
    tt.before = lambda i: rec.step()     # its writer's work per step is small: no flush per block

    from torch.utils.tensorboard import SummaryWriter
    w = SummaryWriter(os.path.join(tmp, "tb"))
    tb = c["tensorboard add_histogram"] = Contender(base, x, end_block=w.flush)
    box = {"i": 0}
    hand_hooks(tb.m, lambda k, t: w.add_histogram(k, t.detach(), box["i"]))
    tb.before = lambda i: box.__setitem__("i", i)
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
    w.close()
    if wb_run is not None:
        wb_run.finish()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["full", "stats"], default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tt-bench-")
    base, x = model_and_data()
    print(f"threads={torch.get_num_threads()}")
    try:
        for mode, fn, rounds, block in (("full", bench_full, 3, 20), ("stats", bench_stats, 6, 3)):
            if args.only not in (None, mode):
                continue
            res = fn(base, x, tmp, rounds, block)
            bare = res.pop("bare")
            sizes = res.pop("_bytes", None)
            print(f"\n[{mode}] {rounds} rounds of {block}-step blocks; bare step (median): {bare * 1e3:.1f} ms")
            for k, v in res.items():
                print(f"  {k:28s} {v / bare:6.2f}x bare   (+{(v - bare) * 1e3:7.1f} ms/step)")
            if mode == "full":
                for k in ("tensortape full", "tensortape full, uncompressed"):
                    print(f"  {k} / torch.save: {res[k] / res['torch.save']:.2f}")
                raw, disk, saved = sizes
                print(f"  tensortape: {raw / 1e6:.0f} MB of tensors -> {disk / 1e6:.0f} MB on disk "
                      f"(compression {raw / disk:.2f}, statistics included); torch.save: {saved / 1e6:.0f} MB")
            else:
                add_tt = res["tensortape stats"] - bare
                add_tb = res["tensorboard add_histogram"] - bare
                print(f"  added time, TensorBoard / tensortape: {add_tb / max(add_tt, 1e-9):.1f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
