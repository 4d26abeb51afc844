"""Recording a compiled model, side by side in one run (ratios only).

Workload: the recorder benchmark's (``bench_recorder.py``): nn.TransformerEncoder,
4 layers, d=256, batch 16 x 128, on the CPU; the output and gradient of every
self-attention and Linear module summarised every step (statistics only).

    python bench/bench_compile.py [--backend inductor|eager]

Contenders, each on its own copy of the model, taking turns in 3-step blocks
for 6 rounds after a warm-up round (compilation happens there):
  compiled bare | compiled, tensortape statistics | eager bare | eager, tensortape statistics
Printed: the median and sustained step of each against compiled bare, and the graph breaks
Dynamo counted for each compiled contender.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch._dynamo

from bench_recorder import LAYERS, Contender, run, transformer
from tensortape.recorder import Recorder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tt-compile-")
    base, x, _ = transformer()
    c = {name: Contender(base, x) for name in ("compiled bare", "compiled + tensortape stats",
                                               "eager bare", "eager + tensortape stats")}
    recs = []
    for name, ct in c.items():
        if name.startswith("compiled"):
            compiled = torch.compile(ct.m, backend=args.backend)
            ct.m = compiled
        if "tensortape" in name:
            rec = Recorder(ct.m, os.path.join(tmp, f"{len(recs)}.zarr"), layers=LAYERS,
                           tensors_every=None).attach()
            recs.append(rec)
            ct.before, ct.end_block = (lambda i, rec=rec: rec.step()), rec.flush
    breaks = {}
    for name in ("compiled bare", "compiled + tensortape stats"):   # graph breaks, counted alone
        torch._dynamo.utils.counters.clear()
        c[name].step(0)
        breaks[name] = sum(torch._dynamo.utils.counters["graph_break"].values())
    try:
        res = run(c, args.rounds, 3)
    finally:
        for rec in recs:
            rec.close()
        shutil.rmtree(tmp, ignore_errors=True)
    (ref, ref_sus) = res["compiled bare"]           # (median step, sustained step)
    print(f"threads={torch.get_num_threads()} backend={args.backend}; {args.rounds} rounds of "
          f"3-step blocks; compiled bare step: median {ref * 1e3:.1f} ms, sustained "
          f"{ref_sus * 1e3:.1f} ms")
    for k, (med, sus) in res.items():
        extra = f"   graph breaks: {breaks[k]}" if k in breaks else ""
        print(f"  {k:30s} median {med / ref:5.2f}x   sustained {sus / ref_sus:5.2f}x compiled bare"
              f"{extra}")
    rec_c, rec_e = res["compiled + tensortape stats"], res["eager + tensortape stats"]
    print(f"  compiled recording / eager recording: median {rec_c[0] / rec_e[0]:.2f}, "
          f"sustained {rec_c[1] / rec_e[1]:.2f}")

if __name__ == "__main__":
    main()
