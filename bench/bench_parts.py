"""``bench_recorder.py --only parts``: what each part of the recorder costs a
captured tensor, on the ``many`` model (200 x Linear(16,16), statistics only).

The contenders switch the recorder's parts on one after the other (plain torch
hooks doing nothing; tensortape's hooks into a null sink; + the capture record
and clone; + the step-end packing with an engine that computes nothing; + the
engine, the writer given nothing; + the writer interpreting the records; + its
rows and commits: the whole recorder).  The parts are switched off through
internals, as no public switch exists: a benchmark's switch, not a feature.
Reported per captured tensor: each contender's added median and sustained time
and the whole process's added CPU seconds, and each part's own (the difference
from the contender before it); the largest part; and the training thread's step
with the writer on and off.
"""

from __future__ import annotations

import os
import statistics
import warnings

import torch

import bench_recorder as br
from tensortape.recorder.capture._engine import Engine
from tensortape.recorder.capture._summary import VECTOR


class _StubEngine(Engine):
    """An engine that computes nothing (``parts``: the packing without the engine)."""

    def __init__(self):
        super().__init__("cpu", False)

    def reduce_many(self, xs, exp_bits):
        return torch.zeros((len(xs), VECTOR), dtype=torch.float64)

    def reduce(self, x):
        return torch.zeros(VECTOR, dtype=torch.float64)

    def count_nonfinite(self, x):
        return torch.zeros(3, dtype=torch.float64)


PARTS = ("torch hooks, doing nothing", "tt hooks, null sink", "+ capture record, clone",
         "+ step-end packing", "+ engine (writer off)", "+ writer: interpret only",
         "+ writer: rows and commits")


def _parts_contender(name, c, store, layers):
    """Wire one ``parts`` contender: each switches off what its name does not add."""
    if name == PARTS[0]:
        br.hand_hooks(c.m, layers, lambda k, t: None)
        return None
    rec = br.recorder(c, store, layers, tensors_every=None)
    level = PARTS.index(name)
    buf, w = rec._buffer, rec._writer
    if level == 1:
        buf.add = lambda *a, **k: None                   # the hooks' sink does nothing
    if level == 2:                                       # captures taken, never packed
        buf.summarizer.pack = lambda caps: ([], [], None)
    if level == 3:                                       # packing, with an engine doing nothing
        buf.summarizer.engines.for_tensor = lambda x: _StubEngine()
    if level <= 4:
        w.put = lambda record: None                      # the writer gets nothing
    if level == 5:
        w.rows._write = lambda u, tensors: None          # records interpreted, no rows written
    return rec


def bench(tmp, rounds, block):
    """Each part's added time per captured tensor on the ``many`` model."""
    with br.one_thread():
        base, x, layers = br.many_linears()
        c = {"bare": br.Contender(base, x)}
        recs = []
        for i, name in enumerate(PARTS):
            c[name] = br.Contender(base, x)
            recs.append(_parts_contender(name, c[name], os.path.join(tmp, f"parts{i}.zarr"),
                                         layers))
        with warnings.catch_warnings():      # the null sink's steps capture nothing: it says so
            warnings.filterwarnings("ignore", message=".*captured nothing")
            res = br.run(c, rounds, block)
        n = recs[-1]._buffer.captured                   # captures a step (402)
        for rec in recs:
            if rec is not None:
                rec.close()
        cpu = {k: statistics.mean(v.cpu) for k, v in c.items()}
        return res, (n, cpu)


def report(res, bare, extra):
    """Per captured tensor: each contender's added time, and its part's own; and
    the added CPU seconds of the whole process (all its threads, flush included:
    a figure the machine's load moves less than wall time)."""
    n, cpu = extra
    print(f"  {'per captured tensor (' + str(n) + ' a step)':34s} {'median':>8s} {'part':>7s}"
          f" {'sustained':>10s} {'part':>7s} {'CPU':>8s} {'part':>7s}")
    prev = (0.0, 0.0, 0.0)
    parts = {}
    for k in PARTS:
        med, sus = ((v - b) / n * 1e6 for v, b in zip(res[k], bare))
        used = (cpu[k] - cpu["bare"]) / n * 1e6
        parts[k] = (med - prev[0], sus - prev[1], used - prev[2])
        print(f"  {k:34s} {med:6.1f}us {parts[k][0]:+6.1f} {sus:8.1f}us {parts[k][1]:+6.1f}"
              f" {used:6.1f}us {parts[k][2]:+6.1f}")
        prev = (med, sus, used)
    for i, what in ((0, "median"), (1, "sustained"), (2, "CPU")):
        k = max(parts, key=lambda k: parts[k][i])
        print(f"  largest part ({what}): {k} ({parts[k][i]:.1f} us a tensor)")
    off, on = res[PARTS[4]][0], res[PARTS[-1]][0]
    print(f"  training thread's step (median): writer off {off * 1e3:.2f} ms, "
          f"on {on * 1e3:.2f} ms ({(on - off) / n * 1e6:+.1f} us a tensor)")
