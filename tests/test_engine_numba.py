"""The numba CPU statistics engine (``recorder._numba``) against the oracle.

Its statistics and histograms must be the ones the SPEC defines (the oracle:
numpy in float64 on the tensor's values): counts, minimum, maximum and every
histogram bin exactly, the float64 sums but for rounding, for every float
dtype (read as their bits), every shape (0-dim, empty, over a million elements:
split across threads) and any mix of NaN, ±Inf and ±0.  A failing kernel
demotes to the torch engine; the training thread never compiles.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

pytest.importorskip("numba")

import oracle                                      # noqa: E402
from analysis import open_run                     # noqa: E402
from recorder import Recorder                      # noqa: E402
from recorder._engines import Engines              # noqa: E402
from recorder._summary import finalize, prepared   # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16] + [
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-42, 3e38, -65504.0]


def engine():
    """The process's numba engine (the Recorder's, under TENSORTAPE_ENGINE=numba),
    with its kernels compiled for every dtype here."""
    e = Engines(choice="numba").for_tensor(torch.zeros(1))
    assert type(e).__name__ == "NumbaEngine"
    for d in DTYPES:
        e.ready(d, wait=True)
    return e


def check(got_stats, got_hist, x):
    """One summary against the oracle's statistics and histogram of ``x``."""
    want = oracle.statistics([x])
    for k in ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac"):
        np.testing.assert_array_equal(got_stats[k], want[k], err_msg=k)
    for k in ("mean", "std", "norm"):
        np.testing.assert_allclose(got_stats[k], want[k], rtol=1e-9, atol=1e-300, err_msg=k)
    v = oracle.values(x)
    np.testing.assert_array_equal(got_hist, oracle.histogram(v))


def summary_of(e, x):
    s = finalize([e.reduce(prepared(x)).numpy()])
    return {k: a[0] for k, a in s.stats.items()}, s.hist[0]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(), (1,), (7,), (3, 5), (9000,), (129, 67), (70000,)]))
    n = int(np.prod(shape, dtype=np.int64))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 1e4]))
    x += draw(st.sampled_from([0.0, 1e4, -3.0]))
    for value in draw(st.lists(st.sampled_from(SPECIAL), max_size=4, unique=True)):
        k = draw(st.integers(0, 3))                  # every k-th element... or none
        if n and k:
            x[torch.randint(0, n, (max(1, n // (k * 7)),), generator=g)] = value
    x = x.reshape(shape).to(dtype)
    if x.dim() == 2 and draw(st.booleans()):
        x = x.t()                                    # read in memory order
    return x


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=tensors())
def test_numba_engine_equals_the_oracle(x):
    check(*summary_of(engine(), x), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_large_tensor_split_across_threads_equals_the_oracle(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1 << 21, generator=g) * 5 + 2).relu()
    x[::1001] = float("nan")
    x[7::3333] = -float("inf")
    x = x.to(dtype)
    e = engine()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        check(*summary_of(e, x), x)
        torch.set_num_threads(1)                     # one thread: the same numbers
        check(*summary_of(e, x), x)
    finally:
        torch.set_num_threads(threads)


class Emit(nn.Module):
    def __init__(self, xs):
        super().__init__()
        self.xs = xs

    def forward(self):
        return tuple(self.xs)


def _cases():
    g = torch.Generator().manual_seed(2)
    big = torch.randn(1100, 1000, generator=g)
    big[::3, ::5] = 0.0
    big[5, :9] = float("nan")
    small = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1.0, -2.5])
    return [big, big.t().bfloat16(), torch.randn(20000, generator=g).double() + 1e4,
            torch.randn(9000, generator=g).half(), small, small.bfloat16(),
            torch.randn(3, 4, generator=g), torch.tensor(3.5), torch.zeros(0, 4)] + [
        torch.randn(10000, generator=g).to(d) for d in DTYPES[4:]]


def test_the_recorder_stores_the_oracles_statistics(tmp_store, monkeypatch):
    monkeypatch.setenv("TENSORTAPE_ENGINE", "numba")
    engine()                                         # compiled: the numba kernels take them
    xs = _cases()
    model = Emit(xs)
    with Recorder(model, tmp_store, layers="", capture="activations", tensors_every=None) as rec:
        for i in range(2):
            with rec.step():
                model()
    run = open_run(tmp_store)
    ds = run.stats().compute()
    for step in (0, 1):
        for i, x in enumerate(xs):
            name = f"(root):{i}"
            row = ds.sel(layer=name).isel(step=step)
            check({k: row[k].item() for k in oracle.STATS},
                  run.histogram(name, step=step).values, x)


def test_a_failing_kernel_is_demoted_to_the_torch_engine(tmp_store, monkeypatch):
    from recorder import _nbkernels
    monkeypatch.setenv("TENSORTAPE_ENGINE", "numba")
    engine()

    def broken(*args):
        raise RuntimeError("kernel broken")
    monkeypatch.setattr(_nbkernels, "one", broken)
    x = torch.randn(50000)
    model = Emit([x])
    with Recorder(model, tmp_store, layers="", capture="activations", tensors_every=None) as rec:
        for i in range(2):
            with pytest.warns(Warning, match="kernel broken") if i == 0 else _nothing():
                with rec.step():
                    model()
    run = open_run(tmp_store)
    assert run.dropped == 1                          # the failed capture, counted
    row = run.stats().compute().sel(layer="(root):0", step=1)
    check({k: row[k].item() for k in oracle.STATS}, run.histogram("(root):0", step=1).values, x)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_training_thread_never_compiles():
    from recorder import _nbkernels as K
    e = engine()
    kernels = (K.one, K.chunk, K.finish, K.many, K.nonfinite, K.shift_of)
    before = [len(k.signatures) for k in kernels]
    g = torch.Generator().manual_seed(3)
    for d in DTYPES:
        for x in (torch.randn(10000, generator=g), torch.randn(700, 900, generator=g).t(),
                  torch.randn(1 << 19, generator=g)):
            e.reduce(prepared(x.to(d)))
            e.count_nonfinite(prepared(x.to(d)))
    for bits in (8, 11):
        e.reduce_many([torch.randn(5, generator=g), torch.randn(3, 3, generator=g).t()], bits)
    assert [len(k.signatures) for k in kernels] == before


def test_without_numba_the_torch_engine_takes_the_cpu():
    code = ("import sys; sys.modules['numba'] = None\n"
            "import torch\nfrom recorder._engines import Engines\n"
            "print(type(Engines().for_tensor(torch.zeros(1))).__name__)")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "CpuEngine", p.stderr[-2000:]


def test_an_empty_cache_is_filled_by_a_child_process(tmp_path):
    code = ("import os, torch\nfrom recorder._numba import NumbaEngine\n"
            "from recorder._nbkernels import cached_mark\nfrom recorder._engine import Engine\n"
            "e = NumbaEngine('cpu', True)\nx = torch.randn(30000)\n"
            "assert not os.path.exists(cached_mark('float32'))\n"
            "e.ready(torch.float32, wait=True)\nassert os.path.exists(cached_mark('float32'))\n"
            "a, b = e.reduce(x), Engine('cpu', False).reduce(x)\n"
            "assert torch.equal(a[6:], b[6:]) and torch.equal(a[4:6], b[4:6])\nprint('ok')")
    env = dict(os.environ, PYTHONPATH=ROOT, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
