"""CPU snapshots reuse their host memory step to step, and a buffer is never reused while
the ring, the writer or a chunk write still holds it.

Against plain hooks (a clone of every activation and gradient at hook time), through the
public API: hypothesis draws a schedule (which steps persist their full tensors, the ring's
length, the steps whose input holds a NaN and dump the ring, float32 or bfloat16, one write
thread or several, a roomy host pool or a tiny one, a store whose writes are slow), and every full tensor the store holds is
bit-exact, at exactly the steps the schedule stores: persisted ones, and each NaN step with the
``ring`` steps before it.  bfloat16 goes to the store through a dtype view, which only the
storage's own count sees; with a chunk a step, several write threads and a slow store, a
step's chunk writes still read its snapshots after the writer has let them go.  A long recording of the defaults keeps about the ring's steps of buffers,
not one per step.  The pool takes only large tensors by default; here it takes every one.
"""
import os
import threading

import pytest

import numpy as np
import torch
from hypothesis import given, strategies as st
from torch import nn

from conftest import examples
from faultstore import faulty
from tensortape import Recorder, open_run
from tensortape.recorder.capture import _hostpool
from tensortape.recorder.store import _layout

KINDS = ("activations", "gradients")


@pytest.fixture(autouse=True)
def every_tensor_pooled(monkeypatch):
    """The pool takes tensors of any size here (by default only large ones), so that these
    small models go through it."""
    monkeypatch.setattr(_hostpool, "MIN_BYTES", 0)


def model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(dtype)


def train(m, rec, steps, nans, dtype):
    """Train under ``rec``; every activation and gradient by plain hooks: (kind, name,
    step) -> a float32 numpy copy taken at hook time."""
    seen, at = {}, {"i": None}

    def hook(mod, args, out, name):
        i = at["i"]
        seen[("activations", name, i)] = out.detach().float().clone().numpy()
        out.register_hook(lambda g: seen.__setitem__(("gradients", name, i),
                                                     g.detach().float().clone().numpy()))
    for name, mod in m.named_modules():
        mod.register_forward_hook(lambda mod, a, out, name=name or "(root)": hook(mod, a, out, name))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for i in range(steps):
        at["i"] = i
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(dtype)
        if i in nans:
            x[0, 0] = float("nan")
        with rec.step(i):
            m(x).float().square().mean().backward()
        if i not in nans:                  # the NaN stays in its step
            opt.step()
        opt.zero_grad()
    return seen


def stored(path):
    run = open_run(path)
    out = {}
    for kind in KINDS:
        for name in run.tensor_layers(kind):
            for step in run.steps(kind, tensors=True, layer=name).tolist():
                out[(kind, name, step)] = run.tensor(name, kind, step=step).values
    return out


@examples(8)
@given(steps=st.integers(4, 12), every=st.sampled_from([None, 2, 3]), ring=st.integers(1, 3),
       nans=st.sets(st.integers(0, 11), max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       threads=st.sampled_from(["1", "4"]), roomy=st.booleans(), slow=st.booleans())
def test_full_tensors_are_bit_exact_under_reuse(tmp_path_factory, steps, every, ring, nans, dtype,
                                               threads, roomy, slow):
    os.environ["TENSORTAPE_WRITE_THREADS"] = threads
    chunk_bytes, _layout.CHUNK_BYTES = _layout.CHUNK_BYTES, 1    # a chunk a step: written from
    try:                                                         # the snapshot, no copy first
        path = tmp_path_factory.mktemp("run") / "run"
        m = model(dtype)
        pending = (1 << 30) if roomy else 600          # tiny: the pool holds a buffer or two
        with faulty(latency=0.02 if slow else 0.0), \
                Recorder(m, path, tensors_every=every, ring=ring, on_nonfinite="dump",
                         max_pending_bytes=pending, flush_interval=0.05) as rec:
            seen = train(m, rec, steps, nans, dtype)
            pool = rec._buffer.summarizer.stager.pool
            assert pool.bytes <= pending
    finally:
        del os.environ["TENSORTAPE_WRITE_THREADS"]
        _layout.CHUNK_BYTES = chunk_bytes
    want = {s for s in range(steps) if every and s % every == 0}
    for s in nans:
        if s < steps:
            want.update(range(max(0, s - ring), s + 1))
    got = stored(path)
    assert {s for _, _, s in got} == want
    assert got.keys() == {k for k in seen if k[2] in want}
    for key, values in got.items():
        np.testing.assert_array_equal(values, seen[key], err_msg=str(key))


def test_a_long_recording_keeps_the_rings_buffers_not_one_per_step(tmp_path):
    m, x = model(torch.float32), torch.randn(4, 8)
    with Recorder(m, tmp_path / "run", flush_interval=0.05) as rec:     # the defaults: a ring
        pool = rec._buffer.summarizer.stager.pool
        for i in range(60):
            with rec.step(i):
                m(x).square().mean().backward()
            rec.flush()                    # the writer keeps up: the ring holds what is held
        step_bytes = 2 * 4 * 4 * (16 + 16 + 8 + 8)     # 4 activations and 4 gradients of 4 rows
        assert 0 < pool.bytes <= 5 * step_bytes, pool.bytes       # the ring's 2 steps, and more


def test_many_threads_never_share_a_buffer_they_hold():
    """Copies taken on several threads at once, each held a while and checked before it is
    let go: no copy is ever overwritten while held."""
    pool, bad = _hostpool.HostPool(1 << 20), []

    def work(k):
        held = []
        for i in range(300):
            x = torch.full((4, 8), float(k * 1000 + i))
            held.append((x.clone(), pool.copy(x)))
            if len(held) > 3:
                want, got = held.pop(0)
                if not torch.equal(want, got):
                    bad.append((k, i))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert pool.bytes <= 4 * 300 * 4 * 8 * 4 / 10      # reused: far fewer buffers than copies
