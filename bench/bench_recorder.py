"""Recorder overhead, side by side in one run (ratios, never absolute claims).

Workload: nn.TransformerEncoder, 4 layers, d=256, batch 16 x 128 tokens, on
the CPU; every Linear / attention output and its gradient is captured.

    python bench/bench_recorder.py [--steps 12] [--only full|stats]

Modes, each the median step time over the same steps, reported relative to
the bare step:
  full   tensortape full tensors every step   vs torch.save of the same tensors
  stats  tensortape statistics only           vs TensorBoard add_histogram of the
         same tensors (hooks wired by hand)   vs wandb.watch(log="all") offline
         (parameters and their gradients only: wandb cannot see activations)
"""

from __future__ import annotations

import argparse
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


def timed(step_fn, steps, warmup=3):
    for i in range(warmup):
        step_fn(-1 - i)
    ts = []
    for i in range(steps):
        t = time.perf_counter()
        step_fn(i)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def train_step(m, x, opt):
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def hand_hooks(m, sink):
    """What users wire by hand for TensorBoard or torch.save: outputs and their grads."""
    mods = dict(m.named_modules())
    handles = []
    import fnmatch
    for n, mod in mods.items():
        if any(fnmatch.fnmatchcase(n, p) for p in LAYERS):
            def fwd(module, a, out, n=n):
                t = out[0] if isinstance(out, tuple) else out
                sink("act/" + n, t)
                t.register_hook(lambda g: sink("grad/" + n, g))
            handles.append(mod.register_forward_hook(fwd))
    return handles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", choices=["full", "stats"], default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tt-bench-")
    m, x = model_and_data()
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    res = {}
    res["bare"] = timed(lambda i: train_step(m, x, opt), args.steps)

    def with_recorder(name, **kw):
        store = os.path.join(tmp, name + ".zarr")
        with Recorder(m, store, layers=LAYERS, **kw) as rec:
            def step(i):
                with rec.step():
                    m(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            t = timed(step, args.steps)
        return t, store

    if args.only in (None, "full"):
        res["tensortape full"], store = with_recorder("full", tensors_every=1)
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs)
        from analysis import open_run
        raw = open_run(store).summary()["bytes_raw"]
        res["_bytes"] = (raw, disk)
        buf = {}
        handles = hand_hooks(m, lambda k, t: buf.__setitem__(k, t.detach().clone()))
        save_dir = os.path.join(tmp, "save")
        os.makedirs(save_dir)

        def save_step(i):
            train_step(m, x, opt)
            torch.save(dict(buf), os.path.join(save_dir, f"step{i}.pt"))
            buf.clear()
        res["torch.save"] = timed(save_step, args.steps)
        for h in handles:
            h.remove()
        shutil.rmtree(save_dir)

    if args.only in (None, "stats"):
        res["tensortape stats"], _ = with_recorder("stats", tensors_every=None)
        from torch.utils.tensorboard import SummaryWriter
        w = SummaryWriter(os.path.join(tmp, "tb"))
        box = {"i": 0}
        handles = hand_hooks(m, lambda k, t: w.add_histogram(k, t.detach(), box["i"]))

        def tb_step(i):
            box["i"] = i
            train_step(m, x, opt)
        res["tensorboard add_histogram"] = timed(tb_step, args.steps)
        w.close()
        for h in handles:
            h.remove()
        try:
            os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
            import wandb
            run = wandb.init(project="tt-bench", dir=tmp)
            wandb.watch(m, log="all", log_freq=1)

            def wb_step(i):
                train_step(m, x, opt)
                wandb.log({"step": i})
            res["wandb.watch (params only)"] = timed(wb_step, args.steps)
            wandb.unwatch(m)
            run.finish()
        except Exception as e:  # wandb missing or failing: say so, do not hide it
            print(f"wandb skipped: {e}")

    bare = res.pop("bare")
    print(f"bare step (median of {args.steps}): {bare * 1e3:.1f} ms  [threads={torch.get_num_threads()}]")
    bytes_ = res.pop("_bytes", None)
    for k, v in res.items():
        print(f"{k:30s} {v / bare:6.2f}x bare   (+{(v - bare) * 1e3:7.1f} ms/step)")
    if "tensortape full" in res and "torch.save" in res:
        print(f"tensortape full / torch.save: {res['tensortape full'] / res['torch.save']:.2f}")
    if "tensortape stats" in res and "tensorboard add_histogram" in res:
        add_tt = res["tensortape stats"] - bare
        add_tb = res["tensorboard add_histogram"] - bare
        print(f"added time, TensorBoard / tensortape stats: {add_tb / max(add_tt, 1e-9):.1f}x")
    if bytes_:
        print(f"full tensors: {bytes_[0] / 1e6:.0f} MB raw -> {bytes_[1] / 1e6:.0f} MB on disk "
              f"(ratio {bytes_[0] / bytes_[1]:.2f}, stats and histograms included on disk)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
