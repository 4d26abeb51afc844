"""What the defaults cost: ``Recorder(model, path)`` and nothing else, against the bare step.

    python bench/bench_defaults.py [--only tour gpt2 mlp many] [--rounds N] [--also K=V,K=V ...]

Workloads, on the CPU, each recorded with zero configuration (every module, activations and
gradients, the constructor's defaults):

- ``tour``: the README tour's ``nn.TransformerEncoder`` (2 layers, d=64, batch 8 x 16),
  torch's default threads.
- ``gpt2``: a tiny GPT-2 from a config (2 layers, width 64; no download) under the Hugging
  Face ``Trainer``, gradient accumulation 2 and activation checkpointing, recorded by
  ``TrainerCallback(path)``.
- ``mlp``: 100 x (``Linear(32, 32)``, ``Tanh``), batch 16, one thread: 201 modules, 402 tiny
  tensors a step, where the fixed cost per tensor shows.
- ``many``: 200 x ``Linear(16, 16)``, batch 4, one thread: 402 tiny tensors a step.

Beside each zero-configuration run of a plain loop (statistics every step, the ring), the
same with ``stats_every=10`` (NaN/Inf alone counted at the steps between), and with
``on_nonfinite="record"``, ``tensors_every=None`` and ``stats_every=10`` (statistics alone: no
ring, no snapshot of the step's tensors), so the ring's copies show; ``--also stats_every=50``
adds a row of those keywords beside the defaults (a candidate default, measured side by
side); and
for ``mlp`` and ``many`` the added time per captured tensor.

Every contender trains its own copy of the model, and the contenders take turns in blocks of
steps (after a warm-up round), so the machine's load hits them alike.  A plain loop's block
is about a second of bare steps (at least 20) and ends with the recorder's flush (the writer
catches up and commits: a commit a second, five times the default ``flush_interval``'s), so
the **sustained** figure (a block's whole time over its steps) includes the writer and its
commits; the **median** step excludes them.  For ``mlp`` and ``many`` the added CPU seconds of
the whole process (every thread, the writer's included; median over the blocks) are given per
tensor too, and the training thread's alone: figures the machine's load moves less than wall
time.  Beside them, ``plain hooks (no-op)``: a forward hook and a tensor hook on every output
that do nothing, the floor any per-tensor recording pays.  Under the Trainer each round is
one ``train()`` of ``--hf-steps`` optimizer steps: median of its steps, sustained from its
first step to the end of ``train()``, the recorder's ``close()`` included.  ``close()`` is also timed alone after the
plain loops' last block (100 steps or more recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_recorder as br  # noqa: E402

from tensortape import Recorder  # noqa: E402


def tour():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(8, 16, 64)


def mlp():
    torch.manual_seed(0)
    mods = []
    for _ in range(100):
        mods += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*mods), torch.randn(16, 32)


def many():
    base, x, _ = br.many_linears()
    return base, x


LOOPS = {"tour": (tour, False), "mlp": (mlp, True), "many": (many, True)}
BLOCK_SECONDS = 1.0           # a block: about this long of bare steps, then a flush (a commit)


def settings(text):
    """``--also``'s ``k=v,k=v`` as Recorder keywords (values read as Python literals, else
    strings)."""
    import ast
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def bench_loop(name, tmp, rounds, also=()):
    """A plain loop: bare, zero-configuration and statistics alone, in turn, in blocks of
    about ``BLOCK_SECONDS`` of bare steps (at least 20), each ending with a flush."""
    make, one = LOOPS[name]
    with br.one_thread() if one else contextlib.nullcontext():
        base, x = make()
        contenders = {"bare": br.Contender(base, x)}
        probe = contenders["bare"]
        probe.block(0, 5, keep=True)
        block = max(20, round(BLOCK_SECONDS / statistics.median(probe.steps)))
        probe.steps, probe.blocks, probe.cpu = [], [], []
        variants = {"zero-config": {},
                    "statistics every 10 steps": {"stats_every": 10},
                    "statistics alone": {"on_nonfinite": "record", "tensors_every": None,
                                         "stats_every": 10},
                    **{text: settings(text) for text in also}}
        if one:                                  # the floor: a no-op hook on every output and
            floor = contenders["plain hooks (no-op)"] = br.Contender(base, x)   # gradient
            br.hand_hooks(floor.m, ["*"], lambda k, t: None)
        recs = {}
        for label, kw in variants.items():
            c = contenders[label] = br.Contender(base, x)
            rec = recs[label] = Recorder(c.m, os.path.join(tmp, f"{name}-{len(recs)}"), **kw)
            c.before, c.end_block = (lambda i, rec=rec: rec.step()), rec.flush
        res = br.run(contenders, rounds, block)
        for k, c in contenders.items():          # CPU seconds a step: all threads, the training's
            res[k] = (*res[k], statistics.median(c.cpu), statistics.median(c.thread))
        steps = (rounds + 1) * block
        closes = {}
        for label, rec in recs.items():
            t = time.perf_counter()
            rec.close()
            closes[label] = time.perf_counter() - t
        n = recs["zero-config"]._buffer.captured
        return res, closes, steps, n, block


def bench_gpt2(tmp, rounds, steps=20):
    """The tiny GPT-2 under the Trainer: a ``train()`` of ``steps`` optimizer steps per
    contender per round, bare and with ``TrainerCallback(path)``."""
    import transformers
    from tensortape.recorder.integrations import TrainerCallback
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=2)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": t, "labels": t} for t in torch.randint(0, 512, (8 * steps, 32),
                                                                   generator=g)]

    class Clock(transformers.TrainerCallback):
        """Each optimizer step's time, and the time from the first step to the end of
        training (after every callback before it: the recorder's close)."""

        def __init__(self):
            self.steps, self.t0, self.t = [], None, None

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
            self.t0 = self.t0 or self.t

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self.t)

        def on_train_end(self, args, state, control, **kw):
            self.end = time.perf_counter()

    models = {k: copy.deepcopy(base) for k in ("bare", "zero-config")}
    out = {k: ([], []) for k in models}
    closes = []
    for r in range(rounds + 1):
        for k, model in models.items():
            args = transformers.TrainingArguments(
                output_dir=os.path.join(tmp, "hf-out"), per_device_train_batch_size=4,
                gradient_accumulation_steps=2, max_steps=steps, activation_checkpointing=True,
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                logging_strategy="no", learning_rate=1e-4)
            clock = Clock()
            callbacks = [] if k == "bare" else [TrainerCallback(os.path.join(tmp, f"hf-{r}.zarr"))]
            trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                           callbacks=[*callbacks, clock])
            if callbacks:
                end = callbacks[0].on_train_end

                def timed(*a, end=end, **kw):
                    t = time.perf_counter()
                    end(*a, **kw)
                    closes.append(time.perf_counter() - t)
                callbacks[0].on_train_end = timed
            trainer.train()
            if r:
                out[k][0].extend(clock.steps)
                out[k][1].append((clock.end - clock.t0) / steps)
    res = {k: (statistics.median(s), statistics.mean(b), None, None) for k, (s, b) in out.items()}
    return res, {"zero-config": statistics.median(closes[1:])}, steps, None, steps


def report(name, res, closes, steps, n, block, rounds):
    bare_med, bare_sus, bare_cpu, bare_thread = res.pop("bare")
    print(f"\n[{name}] {rounds} rounds of {block}-step blocks (load average "
          f"{os.getloadavg()[0]:.1f}); bare step: "
          f"median {bare_med * 1e3:.2f} ms, sustained {bare_sus * 1e3:.2f} ms")
    for k, (med, sus, cpu, thread) in res.items():
        line = (f"  {k:26s} median {med / bare_med:5.2f}x bare   sustained {sus / bare_sus:5.2f}x")
        if n and name in ("mlp", "many"):
            line += (f"   per captured tensor (of {n} a step): +{(med - bare_med) / n * 1e6:.1f} us"
                     f" median, +{(sus - bare_sus) / n * 1e6:.1f} us sustained, +"
                     f"{(cpu - bare_cpu) / n * 1e6:.1f} us of CPU (all threads; the training "
                     f"thread +{(thread - bare_thread) / n * 1e6:.1f})")
        if k in closes:
            line += f"   close() {closes[k]:.3f} s after {steps} steps"
        print(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", choices=["tour", "gpt2", "mlp", "many"], default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hf-steps", type=int, default=20, help="optimizer steps a train() (gpt2)")
    ap.add_argument("--also", nargs="+", default=[], metavar="K=V,K=V",
                    help="more rows of a plain loop: Recorder keywords beside the defaults, "
                         "e.g. stats_every=50 (a candidate default, measured side by side)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tt-defaults-")
    print(f"threads={torch.get_num_threads()} load average {os.getloadavg()[0]:.1f}")
    try:
        for name in ("tour", "gpt2", "mlp", "many"):
            if args.only and name not in args.only:
                continue
            if name == "gpt2":
                out = bench_gpt2(tmp, args.rounds, args.hf_steps)
            else:
                out = bench_loop(name, tmp, args.rounds, args.also)
            report(name, *out, args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
