"""Every reader of a run against the truth, for runs whose options hypothesis draws.

Each example draws a run: ``stats_every``, ``tensors_every``, ``on_nonfinite``
(record, or dump with a ``ring``), ``max_bytes`` (None or a few hundred bytes),
scalars logged or not (names of any text, values NaN, +-Inf, -0, huge, tiny, as
Python and numpy numbers and 0-dim tensors), layers named by any Unicode text
(NUL, ``/``, glob characters; torch refuses only ``.`` and the empty name) whose
outputs are float8 (every variant), bfloat16, float16, float32 or float64 with
extreme values (NaN, +-Inf, +-0, the largest and smallest of the dtype, subnormals,
a large mean with a tiny spread), micro-batches, layers that skip a micro-batch,
sometimes enough steps for the browser map's summary pyramid, and a resume with
``mode="a"`` that records some steps again.  ``test_ranks_agree_with_the_oracle``
records the same on two gloo ranks, whose steps differ, the resume within the same
job (every rank closes its Recorder and opens the next).

The truth is ``oracle.Oracle`` (plain hooks) on the same schedule, played again
without tensortape, with exact ``Fraction`` sums (``oracle.exact``).  Every
reader must agree with it: ``open_run`` (statistics, histograms in the public
bins of ``tensortape.recorder.histogram``, full tensors bit for bit, events,
``first_nonfinite``, scalars, ``dropped``, ``over_budget``), ``tensortape nan
--format json``, ``tensortape compare`` of the run against itself and against a
copy with one statistic changed through zarr, the HDF5 export read by xarray
(h5netcdf) and h5py and by ``open_run``, the TensorBoard export read by
TensorBoard's ``EventAccumulator``, and the served ``/api/runs``, ``/api/map``,
``/api/stats``, ``/api/histogram`` and ``/api/scalars`` at several widths (the
server opened before a resume, so it must read the run again).

An example runs every check and reports each reader that disagrees.
CI runs a fixed seed and a few examples; ``TENSORTAPE_ORACLE_EXAMPLES=500`` runs 500
random ones, ``TENSORTAPE_ORACLE_CHECKS=stats,hdf5`` only the named checks (the
``CHECKS`` below), and ``TENSORTAPE_ORACLE_SHRINK=1`` shrinks a failing example
(minutes: an example takes seconds), e.g. to shrink one reader's disagreement alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import traceback
import urllib.error
import urllib.parse
import urllib.request
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import example, given
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from oracle import (COUNTS, STATS, Oracle, agrees, at_least, bin_index, exact, histogram,
                    largest, truth)
from tensortape import Recorder, open_run
from tensortape.cli import cli
from tensortape.recorder import ConfigError
from tensortape.recorder.histogram import bin_edges

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("activations", "gradients")
DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
          "bfloat16", "float16", "float32", "float64")
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
FAMILIES = ("normal", "tiny", "huge", "wide", "offset", "zeros")
MAP_STATS = ("abs_max", "std", "norm", "rms", "nonfinite")


# --- the run a example draws -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    dtype: str
    ndim: int
    family: str            # its outputs' values (``values``)
    grad_family: str       # its gradients'
    specials: float        # the share of elements made NaN, +-Inf, +-0, the dtype's extremes


@dataclasses.dataclass(frozen=True)
class Spec:
    layers: tuple
    capture: tuple
    stats_every: int
    tensors_every: int | None
    ring: int
    on_nonfinite: str
    max_bytes: int | None
    sessions: tuple          # per recording: ((step, micro-batches), ...); the second resumes
    size: int                # the most elements along a tensor's first dimension
    skip: float              # the chance a layer does not run in a micro-batch
    scalars: tuple           # names logged (at some steps)
    seed: int
    ranks: int = 1
    lag: int = 0             # rank r of R leaves out the first r * lag steps of each recording
                             # and the last (R - 1 - r) * lag (every rank keeps one)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        d = json.loads(text)
        d["layers"] = tuple(Layer(**x) for x in d["layers"])
        d["sessions"] = tuple(tuple(tuple(s) for s in ses) for ses in d["sessions"])
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def steps_of(self, session: int, rank: int) -> tuple:
        steps = self.sessions[session]
        first = min(rank * self.lag, len(steps) - 1)
        return steps[first:max(first + 1, len(steps) - (self.ranks - 1 - rank) * self.lag)]

    @property
    def patterns(self) -> list[str]:
        """Each layer's name: a pattern that is a name selects that layer alone, whatever
        glob characters it holds (docs/REFERENCE.md)."""
        return [layer.name for layer in self.layers]


NAME = st.text(st.one_of(st.sampled_from("a\0/:#*?[]()'\" "), st.characters(exclude_characters=".")),
               min_size=1, max_size=5)
SCALAR_NAME = st.one_of(st.sampled_from(["loss", "step", "rank", "step'", "nonfinite"]),
                        st.text(min_size=1, max_size=4))


@st.composite
def specs(draw, ranks=1):
    names = draw(st.lists(NAME, min_size=1, max_size=3, unique=True))
    layers = tuple(Layer(n, draw(st.sampled_from(DTYPES)), draw(st.integers(1, 2)),
                         draw(st.sampled_from(FAMILIES)), draw(st.sampled_from(FAMILIES)),
                         draw(st.sampled_from([0.0, 0.05, 0.3])))
                   for n in names)
    long = draw(st.integers(0, 5)) == 5         # past the map's grains of 8 and 64 rows
    if long:
        first = tuple((s, 1) for s in range(draw(st.integers(65, 140))))
    else:
        gaps = draw(st.lists(st.integers(1, 3), min_size=1, max_size=7))
        first = tuple((int(n), draw(st.integers(1, 2))) for n in np.cumsum(gaps) - gaps[0])
    sessions = (first,)
    back = draw(st.none() | st.integers(0, 3))
    if back is not None:                         # resumed: from the next step or an earlier one
        start = max(first[-1][0] + 1 - back, 0)
        gaps = draw(st.lists(st.integers(1, 2), min_size=1, max_size=4))
        sessions += (tuple((int(start + n), draw(st.integers(1, 2)))
                           for n in np.cumsum(gaps) - gaps[0]),)
    stats_every = draw(st.integers(1, 3))
    dump = draw(st.booleans())                   # a ring without a dump keeps nothing
    return Spec(
        layers=layers, capture=draw(st.sampled_from([KINDS, ("activations",)])),
        stats_every=1 if long else stats_every,
        tensors_every=draw(st.none() | st.integers(1, 3)) if not long else None,
        ring=draw(st.integers(0, 2)) if dump else 0, on_nonfinite="dump" if dump else "record",
        max_bytes=draw(st.none() | st.integers(1, 1500)), sessions=sessions,
        size=draw(st.integers(0, 6)), skip=draw(st.sampled_from([0.0, 0.3])),
        scalars=tuple(draw(st.lists(SCALAR_NAME, max_size=3, unique=True))),
        seed=draw(st.integers(0, 2 ** 32 - 1)), ranks=ranks,
        lag=draw(st.integers(0, 2)) if ranks > 1 else 0)


# --- the model and its schedule ------------------------------------------------------------
class Emit(nn.Module):
    """A layer whose output is its payload (a float64 leaf that requires grad, set
    before each micro-batch) cast to its dtype: the values are the schedule's, exactly."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.payload = torch.zeros(0, dtype=torch.float64, requires_grad=True)

    def forward(self):
        return self.payload.to(self.dtype, copy=True)


class Bank(nn.Module):
    """The root: runs the layers named, in order, and returns their outputs."""

    def __init__(self, layers):
        super().__init__()
        for layer in layers:
            self.add_module(layer.name, Emit(getattr(torch, layer.dtype)))

    def forward(self, names):
        return [self._modules[n]() for n in names]


def values(rng, family: str, shape, dtype: torch.dtype, specials: float) -> torch.Tensor:
    """Float64 values of ``family`` scaled to ``dtype``'s range, some made special."""
    fi = torch.finfo(dtype)
    n = int(np.prod(shape))
    z = rng.standard_normal(n)
    if family == "normal":
        v = z * 4
    elif family == "tiny":
        v = z * fi.tiny * 4
    elif family == "huge":
        v = z * fi.max / 8
    elif family == "wide":                      # every magnitude, subnormals to the largest
        v = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(np.log2(fi.tiny * fi.eps),
                                                              np.log2(fi.max), n))
    elif family == "offset":                    # a large mean, a tiny spread
        c = np.exp2(rng.uniform(0, np.log2(fi.max) * 0.9))
        v = c * (1 + z * fi.eps * 4)
    else:
        v = rng.choice([0.0, -0.0], n)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, fi.max, -fi.max, fi.tiny,
                        fi.tiny * fi.eps])
    hit = rng.random(n) < specials
    v[hit] = rng.choice(special, int(hit.sum()))
    return torch.from_numpy(v.reshape(shape))


def scalar(rng):
    """A value ``rec.log`` takes: a Python, numpy or 0-dim tensor number."""
    v = rng.choice([rng.standard_normal() * 10, np.nan, np.inf, -np.inf, 1e300, 5e-324, -0.0,
                    7.0])
    form = rng.integers(0, 5)
    if form == 0:
        return float(v)
    if form == 1:
        return int(v) if math.isfinite(v) and abs(v) < 2 ** 53 else float(v)
    if form == 2:
        return np.float32(torch.tensor(v, dtype=torch.float32).item())
    return torch.tensor(v, dtype=(torch.float32, torch.bfloat16, torch.float64)[rng.integers(0, 3)])


def train(spec: Spec, model: Bank, rng, micros: int, log) -> None:
    """One step's micro-batches (each runs the layers not skipped, then backward) and
    its scalars (``log``: the recorder's or the oracle's)."""
    layers = {layer.name: layer for layer in spec.layers}
    for _ in range(micros):
        ran = [n for n in layers if rng.random() >= spec.skip] or [spec.layers[0].name]
        grads = []
        for n in ran:
            layer, dtype = layers[n], getattr(torch, layers[n].dtype)
            shape = (int(rng.integers(0, spec.size + 1)),) + (
                (int(rng.integers(0, 3)),) if layer.ndim == 2 else ())
            model._modules[n].payload = values(rng, layer.family, shape, dtype,
                                               layer.specials).requires_grad_()
            grads.append(values(rng, layer.grad_family, shape, dtype, layer.specials))
        outs = model(ran)
        sum((o.to(torch.float64) * g).sum() for o, g in zip(outs, grads)).backward()
    for name in spec.scalars:
        for _ in range(int(rng.integers(0, 3))):     # none, once, or twice (the last kept)
            log.log({name: scalar(rng)})


def play(spec: Spec, rank: int = 0, store: str | None = None, between=None):
    """Run ``spec``'s schedule on a fresh model: recorded by tensortape into ``store``,
    or (``store=None``) by the oracle, whose truth it returns.  ``between(session)``:
    called after each recording closes."""
    model = Bank(spec.layers)
    oracle = None if store else Oracle(model, spec.patterns, spec.capture, spec.stats_every,
                                       spec.tensors_every, spec.ring, spec.on_nonfinite)
    for session in range(len(spec.sessions)):
        rec = None
        if store:
            rec = Recorder(model, store, layers=spec.patterns, capture=spec.capture,
                           stats_every=spec.stats_every, tensors_every=spec.tensors_every,
                           ring=spec.ring, on_nonfinite=spec.on_nonfinite,
                           max_bytes=spec.max_bytes, mode="a" if session else "w-").attach()
        elif session:
            oracle.resume()
        try:
            for number, micros in spec.steps_of(session, rank):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")   # the budget's notices: not the readers'
                    with rec.step(number) if rec else contextlib.nullcontext():
                        if oracle:
                            oracle.begin(number)
                        train(spec, model, np.random.default_rng([spec.seed, rank, session, number]),
                              micros, rec or oracle)
                        if oracle:
                            oracle.end()
        finally:
            if rec is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    rec.close()
        if between is not None:
            between(session)
    if oracle:
        oracle.close()
    return oracle


# --- the truth, as the checks read it --------------------------------------------------------
class Truth:
    """One rank's truth: its oracle, and what the checks ask of it, computed once."""

    def __init__(self, oracle: Oracle, rank: int):
        self.o, self.rank = oracle, rank
        self.names = oracle.names()
        self.cells, self.hist, self.values = {}, {}, {}     # (kind, name, step) at stats steps
        for step, kind, name in oracle.keys():
            parts = oracle.parts(step, kind, name)
            self.cells[kind, name, step] = exact(parts)
            v = np.concatenate([p.detach().to(torch.float64).reshape(-1).numpy() for p in parts])
            self.values[kind, name, step] = v
            self.hist[kind, name, step] = histogram(v, bin_edges())
        self.kinds = [k for k in KINDS if oracle.stat_names(k)]
        self.layers = {k: [n for n in self.names if n in oracle.stat_names(k)] for k in self.kinds}
        self.stat_steps = {k: sorted({s for s, kind, _ in oracle.keys() if kind == k})
                           for k in self.kinds}
        self.live = {(c["kind"], c["name"], c["step"], c["micro"]): c["tensor"]
                     for c in oracle.live()}
        self.bad = {}                # (kind, name) -> {step: NaN + Inf elements}, every step
        for c in oracle.live():
            v = c["tensor"].detach().to(torch.float64)
            n = int((~torch.isfinite(v)).sum())
            if n:
                at = self.bad.setdefault((c["kind"], c["name"]), {})
                at[c["step"]] = at.get(c["step"], 0) + n
        self.events = [(*key[:3], (*e, rank)) for *key, e in oracle.ordered_events()]


def shown(truths) -> dict:
    """Each logged name (of any rank and recording) -> its name in the readers: itself,
    or for ``step`` and ``rank`` (run.scalars()' coordinates) with ``'`` added until it
    is no name logged (docs/REFERENCE.md)."""
    logged = [n for t in truths for values in t.o.logged.values() for n in values]
    taken, out = {"step", "rank", *logged}, {}
    for name in dict.fromkeys(logged):
        var = name
        while name in ("step", "rank") and var in taken:
            var += "'"
        taken.add(var)
        out[name] = var
    return out


def scalars_of(t: Truth, names: dict) -> dict:
    """step -> {name as read: value} of each step's latest recording."""
    return {step: {names[n]: v for n, v in values.items()} for step, values in t.o.scalars().items()}


def merged_events(truths) -> list:
    """Every rank's events: by step, forward before backward, execution order, rank."""
    return [e for *_, e in sorted((s, b, o, e[-1], e) for t in truths for s, b, o, e in t.events)]


def f32_agrees(stat: str, got: float, ex: dict) -> bool:
    """A statistic read back as float32 (TensorBoard's scalars): the truth to its
    rounding, and +-inf where the truth passes float32."""
    got = float(got)
    if stat not in ("mean", "std", "norm"):
        want = torch.tensor(float(ex[stat]), dtype=torch.float64).float().item()
        return got == want or (math.isnan(got) and math.isnan(want))
    if agrees(stat, got, ex, rel=2.0 ** -23, floor=2.0 ** -149):    # float32's rounding
        return True
    big = float(np.finfo(np.float32).max)
    if got == math.inf:
        return not at_least(stat, big, ex)
    return got == -math.inf and stat == "mean" and truth("mean", ex) < -big


def same_float(got, want) -> bool:
    """Bit for bit, a NaN as any NaN."""
    got, want = float(got), float(want)
    return (math.isnan(got) and math.isnan(want)) or (
        np.float64(got).view(np.uint64) == np.float64(want).view(np.uint64))


def raw_bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's stored bits."""
    return t.contiguous().view(getattr(torch, f"uint{8 * t.element_size()}")).numpy() \
        if t.element_size() < 8 else t.contiguous().view(torch.int64).numpy().view(np.uint64)


def decoded(t: torch.Tensor) -> np.ndarray:
    """What ``run.tensor`` gives for a tensor: its own dtype, or float32 for the dtypes
    numpy lacks (bfloat16, float8), exactly."""
    return t.float().numpy() if t.element_size() == 1 or t.dtype == torch.bfloat16 else t.numpy()


def same_tensor(got: np.ndarray, t: torch.Tensor) -> bool:
    """Bit for bit (a float8 NaN as any NaN: its float32 decoding has no one payload)."""
    want = decoded(t)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    g, w = got.view(BITS[got.itemsize]), want.view(BITS[want.itemsize])
    if t.element_size() == 1:
        nan = np.isnan(want)
        return bool((np.isnan(got) == nan).all() and (g[~nan] == w[~nan]).all())
    return bool((g == w).all())


def as_float(v):
    return math.nan if v is None else {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v, v) \
        if isinstance(v, str) or v is None else v


# --- open_run (also of the HDF5 export) ----------------------------------------------------
def check_stats(run, truths, spec):
    assert run.ranks == [t.rank for t in truths], run.ranks
    for t in truths:
        assert run.layers_of(t.rank) == t.names, (run.layers_of(t.rank), t.names)
        assert set(t.kinds) <= set(run.kinds_of(t.rank)) <= set(spec.capture), run.kinds_of(t.rank)
        for kind in t.kinds:
            ds = run.stats(kind, rank=t.rank).compute()
            assert ds.step.values.tolist() == t.stat_steps[kind], (kind, ds.step.values)
            assert ds.layer.values.tolist() == t.layers[kind], (kind, ds.layer.values)
            for stat in COUNTS:
                assert ds[stat].dtype == np.int64, (kind, stat, ds[stat].dtype)
            check_cells(ds, t, kind)
    if len(truths) > 1:                          # every rank's, along ``rank``
        for kind in {k for t in truths for k in t.kinds}:
            ds = run.stats(kind).compute()
            assert ds["rank"].values.tolist() == [t.rank for t in truths]
            for t in truths:
                check_cells(ds.sel(rank=t.rank), t, kind)


def check_cells(ds, t: Truth, kind: str):
    """Each (step, layer) of a statistics dataset: the truth, or absent (-1, NaN)."""
    table = {stat: ds[stat].values for stat in STATS}
    for i, step in enumerate(ds.step.values.tolist()):
        for j, name in enumerate(ds.layer.values.tolist()):
            ex = t.cells.get((kind, name, step))
            for stat in STATS:
                got = table[stat][i, j]
                if ex is None:
                    assert (got == -1) if stat in COUNTS else np.isnan(got), \
                        ("absent", t.rank, kind, name, step, stat, got)
                else:
                    assert agrees(stat, got, ex), (t.rank, kind, name, step, stat, got, ex[stat])


def check_histograms(run, truths, spec):
    lo, hi = bin_edges()
    for t in truths:
        for kind in t.kinds:
            for name in t.layers[kind]:
                h = run.histogram(name, kind, rank=t.rank).compute()
                assert (h.bin_lo.values == lo).all() and (h.bin_hi.values == hi).all()
                assert h.step.values.tolist() == t.stat_steps[kind], (kind, name)
                for i, step in enumerate(t.stat_steps[kind]):
                    ex, what = t.cells.get((kind, name, step)), (t.rank, kind, name, step)
                    apart = [int(h[c].values[i]) for c in COUNTS[1:]]
                    if ex is None:
                        assert (h.values[i] == -1).all() and apart == [-1] * 3, what
                        continue
                    want = t.hist[kind, name, step]
                    assert (h.values[i] == want).all(), (what, np.nonzero(h.values[i] != want))
                    assert apart == [ex[c] for c in COUNTS[1:]], (what, apart)


def read_tensors(run, rank: int) -> dict:
    """(kind, name, step, micro) -> the full tensor at its true shape, as read."""
    out = {}
    for kind in run.kinds_of(rank):
        for name in run.tensor_layers(kind, rank=rank):
            for m in range(3):
                try:
                    arr = run.tensor(name, kind, micro=m, rank=rank)
                except ConfigError:
                    continue
                data = arr.values
                for i, step in enumerate(arr.step.values.tolist()):
                    cut = tuple(slice(0, int(arr[f"extent_{d}"].values[i])) for d in arr.dims[1:])
                    out[kind, name, step, m] = data[(i, *cut)]
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_tensors(run, truths, spec):
    for t in truths:
        stored = read_tensors(run, t.rank)
        for key, got in stored.items():
            assert key in t.live, ("a tensor nobody recorded", t.rank, key)
            assert same_tensor(got, t.live[key]), (t.rank, key, got, decoded(t.live[key]))
        due, dumped, have = t.o.due(), t.o.dumped(), set(stored)
        assert have <= due | dumped, ("stored, yet neither due nor dumped", have - due - dumped)
        assert dumped <= have, ("a NaN/Inf dump not stored", dumped - have)
        if spec.max_bytes is None:
            assert have == due | dumped, ("due, yet not stored", due - have)
        else:
            spent = sum(nbytes(t.live[k]) for k in have - dumped)
            assert spent <= spec.max_bytes, ("past max_bytes", spent, spec.max_bytes)
            if sum(nbytes(x) for _, x, _ in t.o.written()) <= spec.max_bytes:
                assert due <= have, ("within max_bytes, yet not stored", due - have)
        over = run.state(t.rank).over_budget
        assert over == len(due - have), ("over_budget", over, "due and unreadable",
                                         sorted(due - have))
        for kind in run.kinds_of(t.rank):
            assert run.steps(kind, tensors=True, rank=t.rank).tolist() == sorted(
                {s for k, _, s, _ in have if k == kind}), kind


def check_events(run, truths, spec):
    want = merged_events(truths)
    got = [(e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf, e.rank) for e in run.events]
    assert got == want, (got, want)
    order = {e: o for t in truths for _, _, o, e in t.events}
    for e in run.events:
        key = (e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf, e.rank)
        assert e.order == order[key] and e.phase == ("forward" if e.kind == "activations"
                                                     else "backward"), (key, e.order, e.phase)
    for t in truths:
        assert run.state(t.rank).events_total == len(t.events), (t.rank, len(t.events))
    assert run.dropped == 0 and not run.attrs.get("drop_reasons"), run.attrs.get("drop_reasons")
    assert run.attrs["outside_steps"] == 0


def history_truth(truths, first, around: int) -> tuple[Truth, list]:
    """The rank and stats steps of the first event's history: its layer's statistics
    at the last ``around + 1`` stats steps up to its step."""
    t = truths[first[-1]]
    kind = first[2]
    steps = [s for s in t.stat_steps.get(kind, []) if s <= first[0]][-(around + 1):]
    return t, steps


def check_first(run, truths, spec):
    want = merged_events(truths)
    first = run.first_nonfinite(history=2)
    if not want:
        assert first is None, first
        return
    got = (first.step, first.layer, first.kind, first.micro, first.nan, first.posinf,
           first.neginf, first.rank)
    assert got == want[0], (got, want[0])
    same = [(e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf, e.rank)
            for e in first.same_step]
    assert same == [e for e in want[1:] if e[0] == want[0][0]], same
    t, steps = history_truth(truths, want[0], 2)
    if first.layer not in t.layers.get(first.kind, []):
        return
    assert first.history.step.values.tolist() == steps, (first.history.step.values, steps)
    for s in steps:
        ex = t.cells.get((first.kind, first.layer, s))
        for stat in STATS:
            got = first.history[stat].sel(step=s).item()
            assert (got == -1 if stat in COUNTS else np.isnan(got)) if ex is None else \
                agrees(stat, got, ex), ("history", s, stat, got)


def check_scalars(run, truths, spec):
    names = shown(truths)
    for t in truths:
        ds = run.scalars(rank=t.rank) if len(truths) > 1 else run.scalars()
        check_scalar_set(ds, t, names)
        if len(truths) > 1:
            check_scalar_set(run.scalars().sel(rank=t.rank), t, names)


def check_scalar_set(ds, t: Truth, names: dict):
    want = scalars_of(t, names)
    steps = ds.step.values.tolist() if "step" in ds.coords else []
    names = {n for values in want.values() for n in values}
    assert names <= set(ds.data_vars), (names, list(ds.data_vars))
    assert "step" in ds.coords or not names, ds
    assert {s for s, v in want.items() if v} <= set(steps), (sorted(want), steps)
    for name in ds.data_vars:
        for i, step in enumerate(steps):
            got = ds[name].values[i]
            expect = want.get(step, {}).get(name, math.nan)
            assert same_float(got, expect), ("scalar", t.rank, name, step, got, expect)


READ = {"stats": check_stats, "histograms": check_histograms, "tensors": check_tensors,
        "events": check_events, "first": check_first, "scalars": check_scalars}


# --- the command line --------------------------------------------------------------------
def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def check_nan_cli(path, truths, spec, tmp):
    want = merged_events(truths)
    r = invoke("nan", path, "--format", "json", "--around", 2)
    assert r.exit_code == (1 if want else 0), (r.exit_code, r.output)
    got = json.loads(r.output)
    if not want:
        assert got is None, got
        return
    keys = ("step", "layer", "kind", "micro", "nan", "posinf", "neginf", "rank")
    assert tuple(got[k] for k in keys) == want[0], (got, want[0])
    assert [tuple(e[k] for k in keys) for e in got["same_step"]] == \
        [e for e in want[1:] if e[0] == want[0][0]], got["same_step"]
    t, steps = history_truth(truths, want[0], 2)
    if want[0][1] not in t.layers.get(want[0][2], []):
        return
    assert [h["step"] for h in got["history"]] == steps, got["history"]
    for h in got["history"]:
        ex = t.cells.get((want[0][2], want[0][1], h["step"]))
        for stat in STATS:
            v = as_float(h[stat])
            assert (v == -1 if stat in COUNTS else math.isnan(v)) if ex is None else \
                agrees(stat, v, ex), ("nan --format json history", h["step"], stat, v)


def check_compare(path, truths, spec, tmp):
    """The run against itself: no divergence, on every rank; against a copy whose one
    statistic (a mean at a step without full tensors) is changed through zarr: that
    step and layer, first.  Activations alone (compare is slow)."""
    for t in truths:
        if "activations" in t.kinds:
            r = invoke("compare", path, path, "--rank", t.rank, "--format", "json")
            assert r.exit_code == 0, ("compare to itself", t.rank, r.exit_code, r.output)
            assert json.loads(r.output)["first_divergence"] is None, r.output
    t = truths[0]
    if "activations" not in t.kinds:
        return
    with_tensors = {(n, s) for k, n, s, _ in read_tensors(open_run(path), 0) if k == "activations"}
    cells = [(s, n) for s in t.stat_steps["activations"] for n in t.layers["activations"]
             if (n, s) not in with_tensors and (ex := t.cells.get(("activations", n, s)))
             and ex["n"] and ex["size"] < 1e100]      # far from overflow: this checks compare
    if not cells:
        return
    import zarr
    step, name = cells[len(cells) // 2]
    copy = os.path.join(tmp, "changed.zarr")
    shutil.copytree(path, copy)
    group = zarr.open_group(copy, mode="r+")
    col = group["rank0"].attrs["stats_layers"]["activations"].index(name)
    table = group["rank0/stats/activations"]
    stat = list(table.attrs["stats"]).index("mean")
    rows = np.nonzero(table["step"][:] == step)[0]
    for row in rows:
        mean = float(table["stats"][row, col, stat])
        table["stats"][row, col, stat] = mean + max(1.0, abs(mean))
    r = invoke("compare", path, copy, "--kind", "activations", "--format", "json")
    assert r.exit_code == 1, ("compare to a changed copy", r.exit_code, r.output)
    first = json.loads(r.output)["first_divergence"]
    assert (first["step"], first["layer"]) == (step, name), ("changed", step, name, first)


# --- the exports ---------------------------------------------------------------------------
def latest_rows(recording, steps, t: Truth) -> np.ndarray:
    """The rows (of an exported table) of each step's latest recording."""
    rec = np.zeros(len(steps), np.int64) if recording is None else np.asarray(recording)
    return np.array([i for i, s in enumerate(steps) if rec[i] == t.o.latest[int(s)]], np.int64)


def h5_name(text) -> str:
    """A name as the HDF5 export stores it: itself, or its JSON string literal where HDF5
    text cannot hold it (docs/REFERENCE.md)."""
    text = text.decode() if isinstance(text, bytes) else str(text)
    return json.loads(text) if text.startswith('"') else text


def check_hdf5(path, truths, spec, tmp):
    """``tensortape export`` to HDF5, read by xarray (h5netcdf) and h5py against the
    truth, and by ``open_run`` through every ``open_run`` check."""
    import h5py
    import xarray as xr
    h5 = os.path.join(tmp, "run.h5")
    r = invoke("export", path, h5)
    assert r.exit_code == 0, ("export", r.output)
    lo, hi = bin_edges()
    with xr.open_dataset(h5, engine="h5netcdf") as root:
        assert [h5_name(n) for n in root.layer.values] == truths[0].names, root.layer.values
    for t in truths:
        for kind in t.kinds:
            with xr.open_dataset(h5, engine="h5netcdf", group=f"rank{t.rank}/stats/{kind}") as g:
                assert g.stat.values.tolist() == list(STATS)
                assert (g.bin_lo.values == lo).all() and (g.bin_hi.values == hi).all()
                rows = latest_rows(g["recording"].values if "recording" in g else None,
                                   g.step.values, t)
                rows = rows[np.argsort(g.step.values[rows], kind="stable")]
                assert g.step.values[rows].tolist() == t.stat_steps[kind], (kind, g.step.values)
                names = [h5_name(n) for n in g.layer.values]
                assert sorted(names) == sorted(t.layers[kind]), names
                stats, hist = g.stats.values[rows], g.hist.values[rows]
            for i, step in enumerate(t.stat_steps[kind]):
                for j, name in enumerate(names):
                    ex = t.cells.get((kind, name, step))
                    what = ("hdf5", t.rank, kind, name, step)
                    if ex is None:
                        assert np.isnan(stats[i, j]).all(), (what, stats[i, j])
                        continue
                    for k, stat in enumerate(STATS):
                        assert agrees(stat, stats[i, j, k], ex), (what, stat, stats[i, j, k])
                    assert (hist[i, j] == t.hist[kind, name, step]).all(), what
        stored = read_tensors(open_run(path), t.rank)
        seen, scalars = set(), {}
        with h5py.File(h5, "r") as f:
            for kind in f.get(f"rank{t.rank}/tensors", {}):
                for node in f[f"rank{t.rank}/tensors/{kind}"].values():
                    name = h5_name(node.attrs["layer"])
                    rec = node["recording"][:] if "recording" in node else None
                    steps, micros, extent = node["step"][:], node["micro"][:], node["extent"][:]
                    for i in latest_rows(rec, steps, t):
                        key = (kind, name, int(steps[i]), int(micros[i]))
                        cut = tuple(slice(0, int(e)) for e in extent[i])
                        want = t.live[key]
                        got = node["data"][(i, *cut)]
                        assert got.shape == tuple(want.shape) and (
                            got.view(BITS[got.itemsize]) == raw_bits(want)).all(), ("hdf5", key)
                        seen.add(key)
            if f"rank{t.rank}/scalars" in f:
                g = f[f"rank{t.rank}/scalars"]
                known = [h5_name(n) for n in g["scalar"][:]]
                rec = g["recording"][:] if "recording" in g else None
                steps, which, value = g["step"][:], g["name"][:], g["value"][:]
                for i in latest_rows(rec, steps, t):         # a name's last value of a step
                    scalars.setdefault(int(steps[i]), {})[known[which[i]]] = float(value[i])
        assert seen == set(stored), ("hdf5 tensors", seen ^ set(stored))
        want = {s: v for s, v in t.o.scalars().items() if v}
        assert scalars.keys() == want.keys() and all(
            scalars[s].keys() == want[s].keys() and all(same_float(scalars[s][n], want[s][n])
                                                        for n in want[s]) for s in want), \
            ("hdf5 scalars", scalars, want)
    back = open_run(h5)
    for check in READ.values():
        check(back, truths, spec)


def tb_tag(*parts):
    """A TensorBoard tag as REFERENCE gives it: UTF-8, a lone surrogate as its escape."""
    return "/".join(parts).encode("utf-8", "backslashreplace").decode("utf-8")


def check_tensorboard(path, truths, spec, tmp):
    """``--format tensorboard``, read by TensorBoard's ``EventAccumulator``: a histogram
    per (layer, step) with finite values, its buckets strictly increasing and holding
    the truth's values, every statistic as a float32 scalar, the logged scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = os.path.join(tmp, "tb")
    r = invoke("export", path, out, "--format", "tensorboard")
    assert r.exit_code == 0, ("export", r.output)
    lo, hi = bin_edges()
    for t in truths:
        ea = EventAccumulator(out if len(truths) == 1 else os.path.join(out, f"rank{t.rank}"),
                              size_guidance={"histograms": 0, "scalars": 0})
        with warnings.catch_warnings():      # its compressed histograms overflow on huge values
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="tensorboard")
            ea.Reload()
        tags = ea.Tags()
        for kind in t.kinds:
            for name in t.layers[kind]:
                tag = tb_tag(kind, name)
                hists = {e.step: e.histogram_value for e in ea.Histograms(tag)} \
                    if tag in tags["histograms"] else {}
                for step in t.stat_steps[kind]:
                    ex, what = t.cells.get((kind, name, step)), ("tensorboard", t.rank, tag, step)
                    if ex is None or not ex["n"]:
                        assert step not in hists, what
                    else:
                        check_bucket(hists[step], t.values[kind, name, step],
                                     t.hist[kind, name, step], ex, what)
                    for stat in STATS:
                        got = [e.value for e in ea.Scalars(f"{tag}/{stat}") if e.step == step] \
                            if f"{tag}/{stat}" in tags["scalars"] else []
                        if ex is None:
                            assert got == [], (what, stat, got)
                        else:
                            assert len(got) == 1 and f32_agrees(stat, got[0], ex), (what, stat, got)
        logged = {}
        for step, values in scalars_of(t, shown(truths)).items():
            for name, v in values.items():
                logged.setdefault(name, []).append((step, v))
        for name, want in logged.items():
            got = [(e.step, e.value) for e in ea.Scalars(tb_tag("scalars", name))]
            assert [s for s, _ in got] == [s for s, _ in want], ("tensorboard scalars", name, got)
            for (_, g), (_, w) in zip(got, want):
                assert same_float(g, torch.tensor(w, dtype=torch.float64).float().item()), (name, g, w)


def check_bucket(h, values, counts, ex, what):
    """One TensorBoard histogram against the truth: limits strictly increasing, the
    non-empty buckets the non-empty bins in order, each bucket (from the limit before
    it to its own) holding its bin's values; num, min and max the finite values'."""
    limits, buckets = list(h.bucket_limit), list(h.bucket)
    worse = [(limits[i], limits[i + 1]) for i in range(len(limits) - 1) if limits[i] >= limits[i + 1]]
    assert not worse, (what, "bucket limits not increasing", worse)
    finite = values[np.isfinite(values)]
    held = np.nonzero(counts)[0]
    full = [i for i, c in enumerate(buckets) if c]
    assert [buckets[i] for i in full] == counts[held].tolist(), (what, buckets, counts[held])
    idx = bin_index(finite, bin_edges())
    for i, b in zip(full, held):
        mine = finite[idx == b]
        before = limits[i - 1] if i else -math.inf
        assert before <= mine.min() and mine.max() <= limits[i], (what, i, before, limits[i], mine)
    assert (h.num, h.min, h.max) == (len(finite), ex["min"], ex["max"]), (what, h.num, h.min, h.max)


# --- the browser view's API ----------------------------------------------------------------
class Served:
    """``tensortape serve``'s server of one run on a free loopback port, in a thread;
    ``get`` answers (status, JSON body)."""

    def __init__(self, path: str):
        from tensortape.analysis.browser._serve import make_server
        self.server = make_server([path], "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d/api/" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def get(self, route: str, **query):
        query = {k: v for k, v in query.items() if v is not None}
        try:
            with urllib.request.urlopen(self.url + route + "?" + urllib.parse.urlencode(
                    query, encoding="utf-8", errors="surrogatepass"),
                                        timeout=120) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read()
        return status, json.loads(body, parse_constant=lambda c: pytest.fail(f"JSON holds {c}"))

    def ok(self, route: str, **query):
        status, body = self.get(route, **query)
        assert status == 200, (route, query, status, body)
        return body

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def check_serve(served: Served, truths, spec):
    events = merged_events(truths)
    (one,) = served.ok("runs")
    assert one["layers"] == truths[0].names and one["ranks"] == [t.rank for t in truths], one
    steps = sorted({s for t in truths for k in t.kinds for s in t.stat_steps[k]})
    assert one["steps"] == ([steps[0], steps[-1]] if steps else None), (one["steps"], steps)
    assert one["events"] == len(events), one["events"]
    first = one["first_nonfinite"]
    keys = ("step", "layer", "kind", "micro", "nan", "posinf", "neginf", "rank")
    assert (first and tuple(first[k] for k in keys)) == (events[0] if events else None), first
    assert one["scalars"] == any(v for t in truths for v in t.o.scalars().values()), one["scalars"]
    for t in truths:
        for kind in t.kinds:
            steps = t.stat_steps[kind]
            windows = [(None, None)] + ([(steps[1], steps[-1])] if len(steps) > 2 else [])
            for start, stop in windows:
                for width in (1, 3, 7, 1000):
                    for stat in MAP_STATS:
                        m = served.ok("map", kind=kind, stat=stat, rank=t.rank, width=width,
                                      start=start, stop=stop)
                        check_map(m, t, kind, stat, start, stop)
            for name in t.layers[kind]:
                for width in (None, 2):
                    check_stats_api(served.ok("stats", layer=name, kind=kind, rank=t.rank,
                                              width=width), t, kind, name)
                for step in steps[::max(1, len(steps) // 6)] + steps[-1:]:
                    check_histogram_api(served.ok("histogram", layer=name, kind=kind, step=step,
                                                  rank=t.rank), t, kind, name, step)
        check_scalars_api(served.ok("scalars", rank=t.rank), t, shown(truths))
    for route in ("scalars", "map", "stats"):
        status, body = served.get(route, rank=len(truths), layer=truths[0].names[0])
        assert status == 404 and set(body) == {"error"}, (route, "an unknown rank", status, body)


def columns(lo, hi, steps: list) -> list[list]:
    """The steps of each column [lo, hi]: every step once, the columns in order."""
    assert all(a <= b for a, b in zip(lo, hi)) and all(b < a for b, a in zip(hi, lo[1:])), (lo, hi)
    cols = [[s for s in steps if a <= s <= b] for a, b in zip(lo, hi)]
    assert sum(cols, []) == steps, ("columns do not cover the steps", lo, hi, steps)
    return cols


def check_map(m, t: Truth, kind, stat, start, stop):
    """Each column is the largest of its steps; non-finite where any step it spans
    (statistics or not) holds a NaN or an Inf; every such step in a column."""
    what = ("map", t.rank, kind, stat, start, stop, len(m["step_lo"]))
    inside = [s for s in t.stat_steps[kind] if (start is None or s >= start)
              and (stop is None or s < stop)]
    assert m["steps_in_window"] == len(inside) and m["layers"] == t.layers[kind], (what, m)
    cols = columns(m["step_lo"], m["step_hi"], inside)
    for r, name in enumerate(m["layers"]):
        bad = t.bad.get((kind, name), {})
        for c, (a, b) in enumerate(zip(m["step_lo"], m["step_hi"])):
            got = as_float(m["values"][r][c])
            cells = [t.cells.get((kind, name, s)) for s in cols[c]]
            counted = [n for s, n in bad.items() if a <= s <= b]
            ok = largest(stat, got, cells) or (      # NaN/Inf of steps without statistics
                stat == "nonfinite" and counted and largest(stat, got, cells + [
                    {"nan": max(counted), "posinf": 0, "neginf": 0, "n": 0}]))
            assert ok, (what, repr(name), (a, b), got)
            assert m["nonfinite"][r][c] == bool(counted), (what, repr(name), (a, b),
                                                           "non-finite steps", sorted(bad))
        if m["step_lo"]:
            shown = [s for s in bad if (start is None or s >= start) and (stop is None or s < stop)]
            lost = [s for s in shown if not any(a <= s <= b for a, b in zip(m["step_lo"],
                                                                             m["step_hi"]))]
            assert not lost, (what, repr(name), "NaN/Inf at steps no column holds", lost)


def check_stats_api(st_, t: Truth, kind, name):
    steps = t.stat_steps[kind]
    cols = columns(st_["step"], st_["step_hi"], steps)
    for stat in (*STATS, "rms"):
        for c, col in enumerate(cols):
            got = as_float(st_[stat][c])
            assert largest(stat, got, [t.cells.get((kind, name, s)) for s in col]), \
                ("/api/stats", t.rank, kind, repr(name), col, stat, got)


def check_histogram_api(h, t: Truth, kind, name, step):
    ex, what = t.cells.get((kind, name, step)), ("/api/histogram", t.rank, kind, repr(name), step)
    if ex is None:
        assert h["absent"] and not any(h["counts"]), (what, h)
        return
    lo, hi = bin_edges()
    a, n = h["first_bin"], len(h["counts"])
    counts = np.zeros(h["bins"], np.int64)
    counts[a:a + n] = h["counts"]
    assert not h["absent"] and (counts == t.hist[kind, name, step]).all(), (what, h)
    assert [as_float(v) for v in h["bin_lo"]] == lo[a:a + n].tolist(), what
    assert [as_float(v) for v in h["bin_hi"]] == hi[a:a + n].tolist(), what
    assert [h[c] for c in COUNTS[1:]] == [ex[c] for c in COUNTS[1:]], (what, h)


def check_scalars_api(sc, t: Truth, names: dict):
    want = scalars_of(t, names)
    names = {n for values in want.values() for n in values}
    assert set(sc) == {"step", "values", "nonfinite", "series", "once"}, ("/api/scalars", list(sc))
    got = sc["values"]
    assert names <= set(got), ("/api/scalars", names, list(got))
    assert {s for s, v in want.items() if v} <= set(sc["step"]), ("/api/scalars", sc["step"])
    for name, vals in got.items():
        for step, v in zip(sc["step"], vals):
            assert same_float(as_float(v), want.get(step, {}).get(name, math.nan)), \
                ("/api/scalars", t.rank, name, step, v)
    bad = {n: [s for s, values in sorted(want.items()) if n in values
               and not math.isfinite(values[n])] for n in names}
    assert {n: s for n, s in sc["nonfinite"].items() if s} == \
        {n: s for n, s in bad.items() if s}, ("/api/scalars nonfinite", sc.get("nonfinite"), bad)
    for name in names:                       # each name's logged points alone, in step order
        points = [(s, values[name]) for s, values in sorted(want.items()) if name in values]
        series = sc["series"][name]
        assert series["step"] == [s for s, _ in points], ("/api/scalars series", name, series)
        assert all(same_float(as_float(v), w) for v, (_, w) in zip(series["value"], points)), \
            ("/api/scalars series", name, series)
    assert sorted(sc["once"]) == sorted(n for n in names
                                        if sum(n in v for v in want.values()) == 1), sc["once"]


# --- one example -----------------------------------------------------------------------------
CHECKS = {**{name: (lambda check: lambda ctx: check(open_run(ctx.path), ctx.truths, ctx.spec))(c)
             for name, c in READ.items()},
          "nan": lambda ctx: check_nan_cli(ctx.path, ctx.truths, ctx.spec, ctx.tmp),
          "compare": lambda ctx: check_compare(ctx.path, ctx.truths, ctx.spec, ctx.tmp),
          "hdf5": lambda ctx: check_hdf5(ctx.path, ctx.truths, ctx.spec, ctx.tmp),
          "tensorboard": lambda ctx: check_tensorboard(ctx.path, ctx.truths, ctx.spec, ctx.tmp),
          "serve": lambda ctx: check_serve(ctx.served(), ctx.truths, ctx.spec)}


def chosen() -> list[str]:
    names = os.environ.get("TENSORTAPE_ORACLE_CHECKS")
    return names.split(",") if names else list(CHECKS)


class Example:
    """A drawn run: recorded (on its ranks), its truth played, every check run."""

    def __init__(self, spec: Spec, tmp: str):
        self.spec, self.tmp = spec, tmp
        self.path = os.path.join(tmp, "run.zarr")
        self.server = None

    def served(self) -> Served:
        if self.server is None:
            self.server = Served(self.path)
        return self.server

    def between(self, session: int):
        """A server opened on the run before a resume, and asked: it must read the
        resumed run again."""
        if "serve" in chosen() and session + 1 < len(self.spec.sessions):
            with contextlib.suppress(Exception):    # what fails here fails the check again
                self.served().ok("runs")
                for kind in self.spec.capture:
                    self.served().get("map", kind=kind, width=3)

    def record(self):
        if self.spec.ranks == 1:
            play(self.spec, 0, self.path, self.between)
        else:
            record_ranks(self.spec, self.path, self.tmp)

    def run(self):
        self.record()
        self.truths = [Truth(play(self.spec, r), r) for r in range(self.spec.ranks)]
        failures = []
        for name in chosen():
            try:
                CHECKS[name](self)
            except Exception as e:           # every reader's disagreement, not the first alone
                where = traceback.extract_tb(e.__traceback__)[-1]
                failures.append(f"{name}: {type(e).__name__} at {os.path.basename(where.filename)}:"
                                f"{where.lineno}: {str(e)[:1500]}")
        assert not failures, "readers disagree with the truth:\n" + "\n".join(failures)

    def close(self):
        if self.server is not None:
            self.server.close()


def run_example(spec: Spec):
    tmp = tempfile.mkdtemp(prefix="tt-readers-")
    example = Example(spec, tmp)
    try:
        example.run()
    finally:
        example.close()
        shutil.rmtree(tmp, ignore_errors=True)


# --- several ranks --------------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from test_readers_oracle import Spec, play
    dist.init_process_group("gloo", init_method="env://")
    play(Spec.from_json(open(sys.argv[2]).read()), dist.get_rank(), sys.argv[3])
    dist.destroy_process_group()
""")


def record_ranks(spec: Spec, path: str, tmp: str) -> None:
    """Record ``spec`` on ``spec.ranks`` gloo processes into ``path``: one job, whose
    every rank closes its Recorder and opens the next for the resume."""
    with open(os.path.join(tmp, "spec.json"), "w") as f:
        f.write(spec.to_json())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, HERE, f.name, path],
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE=str(spec.ranks)), cwd=tmp)
             for r in range(spec.ranks)]
    codes = []
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:                      # a rank that failed leaves the others waiting
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * spec.ranks, ("a rank failed", codes)


# --- the tests ------------------------------------------------------------------------------
@examples(8)
@given(spec=specs())
@example(spec=Spec(     # a lone surrogate in a name: TensorBoard's tags and the served API
    layers=(Layer(name='\udfff("(', dtype="float8_e5m2fnuz", ndim=2, family="offset",
                  grad_family="huge", specials=0.05),),
    capture=("activations",), stats_every=3, tensors_every=None, ring=0, on_nonfinite="record",
    max_bytes=None, sessions=(((0, 2),),), size=2, skip=0.0, scalars=("'Üÿ", "rank"),
    seed=107562, ranks=1, lag=0))
def test_readers_agree_with_the_oracle(spec):
    run_example(spec)


@examples(1)
@given(spec=specs(ranks=2))
def test_ranks_agree_with_the_oracle(spec):
    run_example(spec)
