"""Recording a compiled model, side by side in one run (ratios only).

Workload: the recorder benchmark's (``bench_recorder.py``): nn.TransformerEncoder,
4 layers, d=256, batch 16 x 128, on the CPU; the output and gradient of every
self-attention and Linear module summarised every step (statistics only).

    python bench/bench_compile.py [--backend inductor|eager]

Contenders, each on its own copy of the model, taking turns in 3-step blocks
for 6 rounds after a warm-up round (compilation happens there):
  compiled bare | compiled, tensortape statistics | eager bare | eager, tensortape statistics
Printed: the median step of each against compiled bare, and the graph breaks
Dynamo counted for each compiled contender.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch._dynamo

from bench_recorder import LAYERS, Contender, model_and_data, run
from recorder import Recorder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tt-compile-")
    base, x = model_and_data()
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
            ct.before = lambda i, rec=rec: rec.step()
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
    ref = res["compiled bare"]
    print(f"threads={torch.get_num_threads()} backend={args.backend}; {args.rounds} rounds of "
          f"3-step blocks; compiled bare step (median): {ref * 1e3:.1f} ms")
    for k, v in res.items():
        extra = f"   graph breaks: {breaks[k]}" if k in breaks else ""
        print(f"  {k:30s} {v / ref:5.2f}x compiled bare{extra}")
    print(f"  compiled recording / eager recording: {res['compiled + tensortape stats'] / res['eager + tensortape stats']:.2f}")


if __name__ == "__main__":
    main()
