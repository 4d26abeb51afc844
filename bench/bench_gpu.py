"""Recording on a GPU, side by side in one process (ratios, and the sustained rate).

Workload: a Hugging Face GPT-2 small built from a config (12 layers, d=768, no
download, no key/value cache), batch 8 x 1024 tokens, bf16 autocast, fused AdamW.

    python bench/bench_gpu.py [--compile] [--check] [--rounds 3] [--block 10] [--json OUT.json]
    python bench/bench_gpu.py --device cpu --tiny --rounds 1 --block 2   # a smoke run

The device session's prepared run (checks, the kernel's variants, eager figures, then
compiled; about three and a half minutes on one H200, TensorBoard left out: 26 s a
step there):

    python bench/bench_gpu.py --check --rounds 2 --block 10 \
        --only kernels,bare,statistics,noring --json gpu.json && \
        python bench/bench_gpu.py --compile --only bare,statistics --rounds 2 --block 10 \
        --json gpu-compiled.json

Contenders, each on its own copy of the model, take turns in blocks of steps
(after a warm-up round); every block ends with a flush (the recorder's writer
catching up and committing; TensorBoard's writer flushing; torch.save is
synchronous), so the mean of a block is the *sustained* step time:

  bare                 the training step alone
  statistics           tensortape statistics of the output and gradient of every
                       Conv1D (c_attn, attn.c_proj, c_fc, mlp.c_proj): 96 tensors,
                       and the default ring (``noring``: ``stats, ring=0``; on a GPU
                       also ``stats, atomics``: the kernel's ``HIST = 0`` variant)
  tensorboard          add_histogram of the same tensors (hooks by hand; 1 step a block)
  full tensors         tensortape full tensors (and statistics) of the output and
                       gradient of the 8 c_proj modules of layers 0, 3, 7 and 11
  torch.save           the same 8 tensors, saved each step

Printed for each: the median step and the sustained mean, against bare.  First
(``kernels``, on a GPU) the statistics kernel's ``VARIANTS`` on tensors of one step
against the floor of one read pass (``x.sum()``), each checked equal to the atomics
one; the fastest is the one the contenders use.  ``--check`` first runs the correctness checks that need a
GPU: no host sync inside forward or backward (``set_sync_debug_mode("error")``);
the Triton engine equal to the CPU engine on the step's tensors in bfloat16,
float16, float32 and float8, and with NaN first; the statistics, histograms and
full tensors of a recorded bf16 step against plain hooks and numpy
(``tests/oracle.py``); ``torch.compile`` (default and ``reduce-overhead``)
recording a small GPT-2 with its graph breaks counted; and the first recorded
step on cold caches against a warm bare step.  Each check's outcome, and every
figure, also goes to ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

from tensortape.recorder import Recorder

STATS_LAYERS = ["transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]
FULL_BLOCKS = (0, 3, 7, 11)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT: dict = {}


def report(key, value, path=None):
    """Keep a result, print it, and write the whole report where ``--json`` says."""
    REPORT[key] = value
    print(f"{key}: {value}", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1, default=str)


def guarded(name, fn, path):
    """Run one check; a failure is reported, never the end of the run."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:
        report(f"{name} FAILED", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", path)
    report(f"{name} seconds", round(time.perf_counter() - t, 1), path)


def full_layers(n_layer: int) -> list[str]:
    return [f"transformer.h.{i}.{m}.c_proj" for i in FULL_BLOCKS if i < n_layer
            for m in ("attn", "mlp")]


def build(args):
    import transformers
    cfg = transformers.GPT2Config(n_layer=2 if args.tiny else 12, n_embd=64 if args.tiny else 768,
                                  n_head=2 if args.tiny else 12, n_positions=args.seq,
                                  loss_type="ForCausalLM",  # (None: a warning, a graph break)
                                  use_cache=False)          # training: no key/value cache
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


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


def differences(a, b) -> tuple[list[str], float]:
    """Two summary vectors' statistics: the exact ones (counts, extremes, histogram)
    that differ, and the largest relative difference of the moments (the sums are
    added in another order, around another shift)."""
    from tensortape.recorder.capture._summary import finalize
    x, y = finalize([a]), finalize([b])
    bad = [k for k in ("count", "min", "max", "abs_max", "zero_frac", "nan", "posinf", "neginf")
           if not np.array_equal(x.stats[k], y.stats[k], equal_nan=True)]
    if not np.array_equal(x.hist, y.hist):
        bad.append("histogram")
    rel = max(float(abs(x.stats[k][0] - y.stats[k][0]) / max(abs(y.stats[k][0]), 1e-300))
              for k in ("mean", "std", "norm"))
    return bad, rel


def check_sync(base, ids, args, tmp):
    m = copy.deepcopy(base)
    rec = Recorder(m, os.path.join(tmp, "check.zarr"), layers=STATS_LAYERS, tensors_every=None,
                   ring=2, on_nonfinite="dump").attach()
    with rec.step(0):
        torch.cuda.set_sync_debug_mode("error")
        try:     # (transformers checks for packed sequences, a sync, where no cache is made)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                m(input_ids=ids, labels=ids, use_cache=True).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    rec.close()
    report("check: no host sync inside forward and backward with recording", "ok", args.json)


def check_triton(base, ids, args):
    """The Triton engine against the CPU engine on one step's tensors, in each dtype,
    and with their first elements NaN (the sums' shift must skip them)."""
    from tensortape.recorder.capture._engines import Engines
    from tensortape.recorder.capture._triton import TritonEngine
    m = copy.deepcopy(base)
    seen = []
    hand_hooks(m, STATS_LAYERS, lambda k, t: seen.append(t.detach()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(input_ids=ids, labels=ids).loss.backward()
    reference = Engines().for_tensor(torch.zeros(1))          # CPU engine: the reference numbers
    triton_engine = TritonEngine("cuda", True)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
    out = {}
    for dt in dtypes:
        for nan_first in (False, True):
            bad, worst = [], 0.0
            for t in seen[::12]:
                x = t.to(dt) if dt.itemsize > 1 else t.float().clamp(-400, 400).to(dt)
                if nan_first:
                    x = x.clone()
                    x.view(-1)[:3000] = float("nan")
                diff, rel = differences(triton_engine.reduce(x).cpu().numpy(),
                                        reference.reduce(x.cpu()).numpy())
                bad += diff
                worst = max(worst, rel)
            out[f"{dt}{' NaN first' if nan_first else ''}"] = {
                "tensors": len(seen[::12]), "exact fields that differ": bad or "none",
                "moments' largest relative difference": worst}
    report("check: Triton engine equals the CPU engine", out, args.json)


def check_exact(base, ids, args, tmp):
    """A recorded bf16 step read back against plain hooks and numpy: full tensors bit
    for bit, counts, extremes and histograms exactly, moments to float64 rounding."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import oracle
    from tensortape import open_run
    from tensortape.recorder.histogram import bin_edges
    m = copy.deepcopy(base)
    layers = full_layers(base.config.n_layer)
    seen = {}
    hand_hooks(m, layers, lambda k, t: seen.__setitem__(k, t.detach().clone()))
    path = os.path.join(tmp, "exact.zarr")
    with Recorder(m, path, layers=layers, tensors_every=1, max_bytes=None) as rec:
        with rec.step(0), torch.autocast(args.device, dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids).loss.backward()
    run = open_run(path)
    worst, bad = 0.0, []
    for key, t in seen.items():
        kind, layer = ("activations" if key.startswith("act/") else "gradients"), key.split("/", 1)[1]
        want = t.float().cpu().numpy()
        got = run.tensor(layer, kind, step=0).values
        if not np.array_equal(got, want, equal_nan=True):
            bad.append(f"{key}: tensor")
        truth = oracle.statistics([t.cpu()])
        st = run.stats(kind).sel(layer=layer, step=0)
        for k in ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac"):
            if float(st[k]) != float(truth[k]):
                bad.append(f"{key}: {k} {float(st[k])!r} != {float(truth[k])!r}")
        for k in ("mean", "std", "norm"):
            err = abs(float(st[k]) - truth[k]) / max(abs(truth[k]), 1e-30)
            worst = max(worst, err)
        h = run.histogram(layer, kind, step=0).values.reshape(-1)
        v = t.detach().to(torch.float64).reshape(-1).cpu().numpy()
        if not np.array_equal(h, oracle.histogram(v, bin_edges())):
            bad.append(f"{key}: histogram")
    report("check: a recorded bf16 step against plain hooks", {
        "captures": len(seen), "differ": bad or "none",
        "mean/std/norm largest relative error": worst}, args.json)


def check_compile(args, tmp):
    """A small GPT-2 compiled (default and reduce-overhead) records every step, and
    its graph breaks are counted (0 wanted)."""
    import torch._dynamo
    from tensortape import open_run
    small = argparse.Namespace(**{**vars(args), "tiny": True, "batch": 4, "seq": 128})
    base, ids = build(small)
    out = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        m = copy.deepcopy(base)
        cm = torch.compile(m, mode=None if mode == "default" else mode)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
        path = os.path.join(tmp, f"compiled-{mode}.zarr")
        with Recorder(cm, path, layers=STATS_LAYERS, tensors_every=None) as rec:
            for i in range(4):
                with rec.step(i), torch.autocast(args.device, dtype=torch.bfloat16):
                    cm(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        run = open_run(path)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        out[mode] = {"steps recorded": run.steps().tolist(), "layers": len(run.layers),
                     "graph breaks": breaks,
                     "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                     "reasons": list(torch._dynamo.utils.counters["graph_break"])[:5]}
    report("check: compiled recording", out, args.json)


def check_first_step(base, ids, args, tmp):
    """The first recorded step (its kernels compiled then, on the caches this process
    was given: empty ones for a cold figure) against a warm bare step."""
    m = copy.deepcopy(base)
    times = []
    for _ in range(3):
        sync(args)
        t = time.perf_counter()
        with torch.autocast(args.device, dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids).loss.backward()
        sync(args)
        times.append(time.perf_counter() - t)
    bare = min(times[1:])
    mm = copy.deepcopy(base)
    rec = Recorder(mm, os.path.join(tmp, "first.zarr"), layers=STATS_LAYERS, tensors_every=None)
    sync(args)
    t = time.perf_counter()
    rec.attach()
    with rec.step(0), torch.autocast(args.device, dtype=torch.bfloat16):
        mm(input_ids=ids, labels=ids).loss.backward()
    sync(args)
    first = time.perf_counter() - t
    rec.close()
    report("first recorded step (attach included) over a warm bare step, s",
           round(first - bare, 3), args.json)


VARIANTS = {          # how the Triton kernel counts codes: (HIST, LOCAL, BLOCK, WARPS)
    "atomics": (0, 4096, 1024, 4), "atomics b4k w8": (0, 4096, 4096, 8),
    "window 1024 b4k w8": (2, 1024, 4096, 8), "window 512 b4k w8": (2, 512, 4096, 8),
    "window 512 b2k w4": (2, 512, 2048, 4), "window 256 b4k w8": (2, 256, 4096, 8),
    "window 256 b2k w4": (2, 256, 2048, 4), "no histogram b4k w8": (3, 4096, 4096, 8)}
DIAGNOSTIC = {"no histogram b4k w8"}      # timed, not a candidate (it counts nothing)


def use(variant):
    from tensortape.recorder.capture._triton import TritonEngine
    TritonEngine.HIST, TritonEngine.LOCAL, TritonEngine.BLOCK, TritonEngine.WARPS = VARIANTS[variant]


def kernel_table(base, ids, args):
    """Each tensor of one step: the statistics kernel (each of ``VARIANTS`` on a GPU)
    against one read pass; the fastest variant's name (equal vectors checked)."""
    from tensortape.recorder.capture._engines import Engines
    seen = []
    m = copy.deepcopy(base)
    hand_hooks(m, STATS_LAYERS, lambda k, t: seen.append(t.detach()))
    with torch.autocast(args.device, dtype=torch.bfloat16):
        m(input_ids=ids, labels=ids).loss.backward()

    def timed(fn, reps=20):
        fn()
        sync(args)
        s = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(args)
        return (time.perf_counter() - s) / reps
    variants = list(VARIANTS) if args.device == "cuda" else ["atomics"]
    ratios, times = {v: [] for v in variants}, {v: 0.0 for v in variants}
    for t in seen[:: max(1, len(seen) // 8)]:
        floor = timed(lambda: t.sum())
        want = None
        for v in variants:
            use(v)
            eng = Engines().for_tensor(t)
            got = eng.reduce(t)
            if want is None:
                want = got
            elif v not in DIAGNOSTIC and not (torch.equal(got[4:], want[4:])
                                              and torch.equal(got[:2], want[:2])):
                raise AssertionError(f"variant {v!r} differs from 'atomics' on {tuple(t.shape)}")
            k = timed(lambda: eng.reduce(t))
            ratios[v].append(k / floor)
            times[v] += k
            print(f"  {tuple(t.shape)} {str(t.dtype):15s} {t.numel() * t.element_size() / 1e6:7.1f} MB  "
                  f"{v:22s} {k * 1e3:7.3f} ms  x.sum() {floor * 1e3:7.3f} ms  ratio {k / floor:6.1f}  "
                  f"({type(eng).__name__})")
    table = {v: round(statistics.median(r), 1) for v, r in ratios.items()}
    report("statistics kernel / one read pass, median over the step's tensors, by variant",
           table, args.json)
    best = min((v for v in variants if v not in DIAGNOSTIC), key=times.__getitem__)
    use("atomics")
    report("fastest kernel variant (same vectors as 'atomics')", best, args.json)
    return best


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
    ap.add_argument("--json", default=None, help="write every check and figure here")
    ap.add_argument("--variant", default="window 256 b4k w8", choices=list(VARIANTS),
                    help="the kernel variant of the statistics contender where kernels "
                         "are not timed (else the fastest)")
    ap.add_argument("--only", default=None,
                    help="what to time, of kernels,bare,statistics,noring,tensorboard,full "
                         "(e.g. kernels,bare,statistics for a compiled run)")
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
    tmp = tempfile.mkdtemp(prefix="tt-gpu-")
    base, ids = build(args)
    try:
        if args.check:              # on the CPU (a smoke run), those that need no GPU
            guarded("first step", lambda: check_first_step(base, ids, args, tmp), args.json)
            if args.device == "cuda":
                guarded("sync", lambda: check_sync(base, ids, args, tmp), args.json)
                guarded("triton", lambda: check_triton(base, ids, args), args.json)
            guarded("exact", lambda: check_exact(base, ids, args, tmp), args.json)
            guarded("compile", lambda: check_compile(args, tmp), args.json)
        only = set(args.only.split(",")) if args.only else None
        best = args.variant
        if args.device == "cuda" and (not only or "kernels" in only):
            print("statistics kernel per tensor, against one read pass:")
            best = kernel_table(base, ids, args)
        c, recs, w = {"bare": Contender("bare", base, ids, args)}, [], None

        def stats(name, variant, **options):
            st = c[name] = Contender(name, base, ids, args)
            rec = Recorder(st.run, os.path.join(tmp, f"{len(c)}.zarr"), layers=STATS_LAYERS,
                           tensors_every=None, **options).attach()
            recs.append(rec)

            def before(i, rec=rec):
                use(variant)
                return rec.step()
            st.before, st.end_block = before, rec.flush
        if not only or "statistics" in only:
            stats("statistics", best)
        if not only or "noring" in only:
            stats("stats, ring=0", best, ring=0)
        if args.device == "cuda" and best != "atomics" and (not only or "statistics" in only):
            stats("stats, atomics", "atomics")
        if not only or "tensorboard" in only:
            from torch.utils.tensorboard import SummaryWriter
            w = SummaryWriter(os.path.join(tmp, "tb"))
            tb = c["tensorboard"] = Contender("tensorboard", base, ids, args, every=args.block)
            box = {"i": 0}
            hand_hooks(tb.m, STATS_LAYERS,
                       lambda k, t: w.add_histogram(k, t.detach().float(), box["i"]))
            tb.before = lambda i: box.__setitem__("i", i) or contextlib.nullcontext()
            tb.end_block = w.flush
        if not only or "full" in only:
            full = c["full tensors"] = Contender("full tensors", base, ids, args)
            rec = Recorder(full.run, os.path.join(tmp, "full.zarr"),
                           layers=full_layers(base.config.n_layer), tensors_every=1,
                           max_bytes=None).attach()
            recs.append(rec)
            full.before = lambda i, rec=rec: (use(best), rec.step())[1]
            full.end_block = rec.flush
            sv = c["torch.save"] = Contender("torch.save", base, ids, args)
            buf, save_dir = {}, os.path.join(tmp, "save")
            os.makedirs(save_dir)
            hand_hooks(sv.m, full_layers(base.config.n_layer),
                       lambda k, t: buf.__setitem__(k, t.detach().to("cpu")))
            sv.after = lambda i: (torch.save(dict(buf), os.path.join(save_dir, f"{i}.pt")),
                                  buf.clear())

        step = 0
        for r in range(args.rounds + 1):
            for ct in c.values():
                ct.block(step, args.block, keep=r > 0)
            step += args.block
        bare_med, bare_mean = statistics.median(c["bare"].steps), statistics.mean(c["bare"].blocks)
        print(f"device={args.device} compile={args.compile} batch={args.batch}x{args.seq}; "
              f"{args.rounds} rounds of {args.block}-step blocks, each ending with a flush")
        print(f"  {'contender':14s} {'median':>10s} {'vs bare':>8s} {'sustained':>10s} {'vs bare':>8s}")
        table = {}
        for name, ct in c.items():
            med, mean = statistics.median(ct.steps), statistics.mean(ct.blocks)
            table[name] = {"median ms": med * 1e3, "median x bare": med / bare_med,
                           "sustained ms": mean * 1e3, "sustained x bare": mean / bare_mean}
            print(f"  {name:14s} {med * 1e3:8.1f}ms {med / bare_med:7.2f}x {mean * 1e3:8.1f}ms "
                  f"{mean / bare_mean:7.2f}x")
        report(f"steps (compile={args.compile}, {torch.cuda.get_device_name() if args.device == 'cuda' else args.device})",
               table, args.json)
        if "full tensors" in c:
            f, s_ = statistics.mean(c["full tensors"].blocks), statistics.mean(c["torch.save"].blocks)
            b_ = statistics.mean(c["bare"].blocks)
            report("full tensors added time / torch.save added time, sustained",
                   round((f - b_) / max(s_ - b_, 1e-9), 2), args.json)
        if "tensorboard" in c and "statistics" in c:
            t_, s_ = statistics.mean(c["tensorboard"].blocks), statistics.mean(c["statistics"].blocks)
            b_ = statistics.mean(c["bare"].blocks)
            report("tensorboard added time / tensortape statistics added time",
                   round((t_ - b_) / (s_ - b_), 1) if s_ - b_ > 0.02 * b_ else
                   "n/a: tensortape's added time is within 2% of the bare step", args.json)
        for r in recs:
            r.close()
        if w is not None:
            w.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
