"""Recording on a GPU, side by side in one process (ratios, and the sustained rate).

Workload (issue 11): a Hugging Face GPT-2 small built from a config (12 layers,
d=768, no download), batch 8 x 1024 tokens, bf16 autocast, fused AdamW.

    python bench/bench_gpu.py [--compile] [--check] [--rounds 3] [--block 10]
    python bench/bench_gpu.py --device cpu --tiny --rounds 1 --block 2   # a smoke run

Contenders, each on its own copy of the model, take turns in blocks of steps
(after a warm-up round); every block ends with a flush (the recorder's writer
catching up and committing; TensorBoard's writer flushing; torch.save is
synchronous), so the mean of a block is the *sustained* step time:

  bare                 the training step alone
  statistics           tensortape statistics of the output and gradient of every
                       Conv1D (c_attn, attn.c_proj, c_fc, mlp.c_proj): 96 tensors
  tensorboard          add_histogram of the same tensors (hooks by hand; 1 step a block)
  full tensors         tensortape full tensors (and statistics) of the output and
                       gradient of the 8 c_proj modules of layers 0, 3, 7 and 11
  torch.save           the same 8 tensors, saved each step

Printed for each: the median step and the sustained mean, against bare.  Then
the statistics kernel on each tensor of one step against the floor of one read
pass (``x.sum()``).  ``--check`` first runs the correctness checks that need a
GPU: no host sync inside forward or backward (``set_sync_debug_mode("error")``),
and the Triton engine equal to the torch kernels on the step's tensors.
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

from tensortape.recorder import Recorder

STATS_LAYERS = ["transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]
FULL_BLOCKS = (0, 3, 7, 11)


def full_layers(n_layer: int) -> list[str]:
    return [f"transformer.h.{i}.{m}.c_proj" for i in FULL_BLOCKS if i < n_layer
            for m in ("attn", "mlp")]


def build(args):
    import transformers
    cfg = transformers.GPT2Config(n_layer=2 if args.tiny else 12, n_embd=64 if args.tiny else 768,
                                  n_head=2 if args.tiny else 12, n_positions=args.seq)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(args.device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device)
    return model, ids


class Contender:
    def __init__(self, name, base, ids, args, every=1):
        self.name, self.ids, self.args, self.every = name, ids, args, every
        self.m = copy.deepcopy(base)
        fused = args.device == "cuda"
        self.opt = torch.optim.AdamW(self.m.parameters(), lr=1e-5, fused=fused)
        self.run = torch.compile(self.m) if args.compile else self.m
        self.before = self.after = self.end_block = None
        self.steps, self.blocks = [], []

    def step(self, i):
        sync = self.args.device == "cuda"
        t = time.perf_counter()
        with (self.before(i) if self.before else contextlib.nullcontext()), \
                torch.autocast(self.args.device, dtype=torch.bfloat16):
            self.run(input_ids=self.ids, labels=self.ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.after:
            self.after(i)
        if sync:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def block(self, start, n, keep):
        n = max(1, n // self.every)
        t = time.perf_counter()
        times = [self.step(start + i) for i in range(n)]
        if self.end_block:
            self.end_block()
        if self.args.device == "cuda":
            torch.cuda.synchronize()
        if keep:
            self.steps += times
            self.blocks.append((time.perf_counter() - t) / n)


def hand_hooks(m, patterns, sink):
    for n, mod in m.named_modules():
        if any(fnmatch.fnmatchcase(n, p) for p in patterns):
            def fwd(module, a, out, n=n):
                sink("act/" + n, out)
                if out.requires_grad:
                    out.register_hook(lambda g: sink("grad/" + n, g))
            mod.register_forward_hook(fwd)


def checks(base, ids, args, tmp):
    """What only a GPU can show: no host sync in forward/backward; Triton == torch."""
    from tensortape.recorder._engines import Engines
    from tensortape.recorder._triton import TritonEngine
    m = copy.deepcopy(base)
    rec = Recorder(m, os.path.join(tmp, "check.zarr"), layers=STATS_LAYERS, tensors_every=None,
                   ring=2, on_nonfinite="dump").attach()
    with rec.step(0):
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                m(input_ids=ids, labels=ids).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    rec.close()
    print("check: no host sync inside forward and backward with recording: ok")
    seen = []
    hand_hooks(m, STATS_LAYERS, lambda k, t: seen.append(t.detach()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(input_ids=ids, labels=ids).loss.backward()
    torch_engine = Engines().for_tensor(torch.zeros(1))          # CPU engine: the reference numbers
    triton_engine = TritonEngine("cuda", True)
    bad = 0
    for t in seen:
        a = triton_engine.reduce(t).cpu().numpy()
        b = torch_engine.reduce(t.cpu()).numpy()
        same = (a[6:] == b[6:]).all() and (a[0] == b[0]) and abs(a[2] - b[2]) <= 1e-9 * max(
            abs(b[3]) ** 0.5 * b[0] ** 0.5, 1e-30)
        bad += not same
    print(f"check: Triton engine equals the CPU engine on {len(seen)} tensors: "
          f"{'ok' if not bad else f'{bad} differ'}")


def kernel_table(base, ids, args):
    from tensortape.recorder._engines import Engines
    seen = []
    m = copy.deepcopy(base)
    hand_hooks(m, STATS_LAYERS, lambda k, t: seen.append(t.detach()))
    with torch.autocast(args.device, dtype=torch.bfloat16):
        m(input_ids=ids, labels=ids).loss.backward()
    ratios = []
    for t in seen[:: max(1, len(seen) // 8)]:
        eng = Engines().for_tensor(t)

        def timed(fn, reps=20):
            fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            s = time.perf_counter()
            for _ in range(reps):
                fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - s) / reps
        k, floor = timed(lambda: eng.reduce(t)), timed(lambda: t.sum())
        ratios.append(k / floor)
        print(f"  {tuple(t.shape)} {str(t.dtype):15s} {t.numel() * t.element_size() / 1e6:7.1f} MB  "
              f"summary {k * 1e3:7.3f} ms  x.sum() {floor * 1e3:7.3f} ms  ratio {k / floor:6.1f}  "
              f"({type(eng).__name__})")
    print(f"  median ratio to the one-read-pass floor: {statistics.median(ratios):.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=10)
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
    tmp = tempfile.mkdtemp(prefix="tt-gpu-")
    base, ids = build(args)
    try:
        if args.check and args.device == "cuda":
            checks(base, ids, args, tmp)
        c = {"bare": Contender("bare", base, ids, args)}
        recs = []
        st = c["statistics"] = Contender("statistics", base, ids, args)
        rec = Recorder(st.run, os.path.join(tmp, "stats.zarr"), layers=STATS_LAYERS,
                       tensors_every=None).attach()
        recs.append(rec)
        st.before, st.end_block = (lambda i, rec=rec: rec.step()), rec.flush

        from torch.utils.tensorboard import SummaryWriter
        w = SummaryWriter(os.path.join(tmp, "tb"))
        tb = c["tensorboard"] = Contender("tensorboard", base, ids, args, every=args.block)
        box = {"i": 0}
        hand_hooks(tb.m, STATS_LAYERS, lambda k, t: w.add_histogram(k, t.detach().float(), box["i"]))
        tb.before = lambda i: box.__setitem__("i", i) or contextlib.nullcontext()
        tb.end_block = w.flush

        full = c["full tensors"] = Contender("full tensors", base, ids, args)
        rec = Recorder(full.run, os.path.join(tmp, "full.zarr"), layers=full_layers(base.config.n_layer),
                       tensors_every=1).attach()
        recs.append(rec)
        full.before, full.end_block = (lambda i, rec=rec: rec.step()), rec.flush

        sv = c["torch.save"] = Contender("torch.save", base, ids, args)
        buf, save_dir = {}, os.path.join(tmp, "save")
        os.makedirs(save_dir)
        hand_hooks(sv.m, full_layers(base.config.n_layer), lambda k, t: buf.__setitem__(k, t.detach().to("cpu")))
        sv.after = lambda i: (torch.save(dict(buf), os.path.join(save_dir, f"{i}.pt")), buf.clear())

        step = 0
        for r in range(args.rounds + 1):
            for ct in c.values():
                ct.block(step, args.block, keep=r > 0)
            step += args.block
        bare_med, bare_mean = statistics.median(c["bare"].steps), statistics.mean(c["bare"].blocks)
        print(f"device={args.device} compile={args.compile} batch={args.batch}x{args.seq}; "
              f"{args.rounds} rounds of {args.block}-step blocks, each ending with a flush")
        print(f"  {'contender':14s} {'median':>10s} {'vs bare':>8s} {'sustained':>10s} {'vs bare':>8s}")
        for name, ct in c.items():
            med, mean = statistics.median(ct.steps), statistics.mean(ct.blocks)
            print(f"  {name:14s} {med * 1e3:8.1f}ms {med / bare_med:7.2f}x {mean * 1e3:8.1f}ms "
                  f"{mean / bare_mean:7.2f}x")
        f, s = statistics.mean(c["full tensors"].blocks), statistics.mean(c["torch.save"].blocks)
        print(f"  full tensors / torch.save, sustained: {f / s:.2f}")
        for r in recs:
            r.close()
        w.close()
        print("statistics kernel per tensor, against one read pass:")
        kernel_table(base, ids, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
