"""The numba CPU statistics engine (``recorder.capture._numba``) against the oracle.

Its statistics and histograms must be the ones the SPEC defines (the oracle:
numpy in float64 on the tensor's values): counts, minimum, maximum and every
histogram bin exactly, the float64 sums but for rounding, for every float
dtype (read as their bits), every shape (0-dim, empty, over a million elements:
split across threads) and any mix of NaN, ±Inf and ±0.  A failing kernel
demotes to the torch engine; the training thread never compiles.
"""
import hashlib
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
from tensortape.analysis import open_run                     # noqa: E402
from tensortape.recorder import Recorder                      # noqa: E402
from tensortape.recorder.capture._engine import Engine                # noqa: E402
from tensortape.recorder.capture._engines import Engines              # noqa: E402
from tensortape.recorder.capture._summary import finalize, prepared   # noqa: E402

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


def test_a_first_element_that_is_not_finite_leaves_the_variance_exact():
    """Summed around the first finite element: around 0, a large mean with a small
    spread cancels (the std was 14-40% off)."""
    e = engine()
    g = torch.Generator().manual_seed(4)
    for n in (9000, 70000, 1 << 20):
        for lead in (float("nan"), float("inf")):
            x = (torch.randn(n, generator=g, dtype=torch.float64) * 1e-3 + 1e4).float()
            x[:3] = lead
            check(*summary_of(e, x), x)
    xs = [torch.tensor([float("nan"), 1e4, 1e4 + 1e-3, 1e4 - 2e-3] * 8)] * 3
    for row, x in zip(e.reduce_many(xs, 8).numpy(), xs):   # a step's tiny tensors too
        s = finalize([row])
        check({f: a[0] for f, a in s.stats.items()}, s.hist[0], x)


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
    with Recorder(model, tmp_store, layers="", capture="activations", tensors_every=None, stats_every=1) as rec:
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
    from tensortape.recorder.capture import _nbkernels
    monkeypatch.setenv("TENSORTAPE_ENGINE", "numba")
    engine()

    def broken(*args):
        raise RuntimeError("kernel broken")
    monkeypatch.setattr(_nbkernels, "one", broken)
    x = torch.randn(50000)
    model = Emit([x])
    with Recorder(model, tmp_store, layers="", capture="activations", tensors_every=None, stats_every=1) as rec:
        for i in range(2):
            with pytest.warns(Warning, match="kernel broken") if i == 0 else _nothing():
                with rec.step():
                    model()
    run = open_run(tmp_store)
    assert run.dropped == 1                          # the failed capture, counted
    row = run.stats().compute().sel(layer="(root):0", step=1)
    check({k: row[k].item() for k in oracle.STATS}, run.histogram("(root):0", step=1).values, x)


def _left_to_the_writer(monkeypatch, later):
    """Fresh engines (a failure must not outlive the test), every capture of a dtype
    for which ``later(engine, dtype)`` holds left to the writer; the copies it got."""
    from tensortape.recorder.capture import _engines, _numba, _summarizer
    monkeypatch.setenv("TENSORTAPE_ENGINE", "numba")
    monkeypatch.setattr(_engines, "_instances", {})
    monkeypatch.setattr(_numba.NumbaEngine, "later", later)
    copies, copy = [], _summarizer._Held.copy

    def counted(self, x):
        c = copy(self, x)
        copies.append(c is not None)
        return c
    monkeypatch.setattr(_summarizer._Held, "copy", counted)
    return copies


def _record_cases(store, xs, **kw):
    model = Emit(xs)
    with Recorder(model, store, layers="", capture="activations", tensors_every=None, **{"stats_every": 1, **kw}) as rec:
        for i in range(2):
            with rec.step():
                model()
            rec.flush()                      # step 0 resolved by the writer before step 1
    return open_run(store)


def test_captures_left_to_the_writer_store_the_oracles_statistics(tmp_path, monkeypatch):
    copies = _left_to_the_writer(monkeypatch, lambda self, dtype: True)
    xs = _cases()
    run = _record_cases(str(tmp_path / "later.zarr"), xs)
    assert any(copies) and run.dropped == 0
    ds = run.stats().compute()
    for step in (0, 1):
        for i, x in enumerate(xs):
            row = ds.sel(layer=f"(root):{i}").isel(step=step)
            check({k: row[k].item() for k in oracle.STATS},
                  run.histogram(f"(root):{i}", step=step).values, x)
    copies.clear()                            # the policies that resolve on the training thread
    _record_cases(str(tmp_path / "raise.zarr"), [torch.randn(20000), torch.randn(9000).half()],
                  on_nonfinite="raise")
    assert copies == []


def test_a_kernel_failing_on_the_writer_is_demoted_and_nothing_is_lost(tmp_path, monkeypatch):
    """The writer summarises that capture eagerly (exact); the training thread
    demotes the dtype at its next capture, warned once, that capture counted."""
    import threading
    from tensortape.recorder.capture import _numba
    _left_to_the_writer(monkeypatch, lambda self, dtype: dtype not in self._failed)
    reduce = _numba.NumbaEngine.reduce

    def broken_off_the_training_thread(self, x):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("kernel broken on the writer")
        return reduce(self, x)
    monkeypatch.setattr(_numba.NumbaEngine, "reduce", broken_off_the_training_thread)
    x = torch.randn(50000)
    x[::97] = float("nan")
    with pytest.warns(Warning, match="kernel broken on the writer"):
        run = _record_cases(str(tmp_path / "run.zarr"), [x])
    assert run.dropped == 1                   # step 1's capture, met by the demotion
    ds = run.stats().compute()
    row = ds.sel(layer="(root):0", step=0)    # summarised by the writer, eagerly
    check({k: row[k].item() for k in oracle.STATS}, run.histogram("(root):0", step=0).values, x)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_training_thread_never_compiles():
    from tensortape.recorder.capture import _nbkernels as K
    e = engine()
    kernels = (K.one, K.chunk, K.finish, K.many, K.nonfinite, K.shift_of, K._moments, K._codes)
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
            "import torch\nfrom recorder.capture._engines import Engines\n"
            "print(type(Engines().for_tensor(torch.zeros(1))).__name__)")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "CpuEngine", p.stderr[-2000:]


def test_an_empty_cache_is_filled_by_a_child_process(tmp_path):
    code = ("import os, torch\nfrom recorder.capture._numba import NumbaEngine\n"
            "from recorder.capture._nbkernels import cached_mark\nfrom recorder.capture._engine import Engine\n"
            "e = NumbaEngine('cpu', True)\nx = torch.randn(30000)\n"
            "assert not os.path.exists(cached_mark('float32'))\n"
            "e.ready(torch.float32, wait=True)\nassert os.path.exists(cached_mark('float32'))\n"
            "a, b = e.reduce(x), Engine('cpu', False).reduce(x)\n"
            "assert torch.equal(a[6:], b[6:]) and torch.equal(a[4:6], b[4:6])\nprint('ok')")
    env = dict(os.environ, PYTHONPATH=ROOT, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


# --- a fresh machine: the first steps' summaries, while the kernels compile apart ------------
# A child process records with an empty numba cache; its plain forward hooks and tensor hooks
# save every captured tensor (the oracle's input), and a spy notes the torch kernels the
# training thread ran meanwhile.
COLD = r'''
import hashlib, json, sys, threading, torch
from torch import nn
from tensortape.recorder import Recorder; from tensortape.recorder.capture import _engine, _nbkernels
out, mode = sys.argv[1], sys.argv[2]
on_training, eager = [], []        # eager: the tensors the writer summarised with the torch
for kernel in ("reduce", "reduce_many", "count_nonfinite"):     # kernels (past its patience)
    def spy(self, *a, _orig=getattr(_engine.Engine, kernel), _name=kernel):
        if threading.current_thread() is threading.main_thread():
            on_training.append(_name)
        elif _name == "reduce":
            eager.append(hashlib.sha1(a[0].contiguous().view(torch.uint8).numpy()).hexdigest())
        return _orig(self, *a)
    setattr(_engine.Engine, kernel, spy)
if mode == "broken":                                # no kernels: nothing compiles, loads fail
    import tensortape.recorder.capture._numba as N
    N._compile_apart = lambda reads: None
    def broken(*a, **k):
        raise RuntimeError("compile broken")
    _nbkernels.compile_for = broken
g = torch.Generator().manual_seed(5)
special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1.0, -2.5])
fixed = [special.repeat(3000), special.bfloat16(), torch.randn(40, 300, generator=g).double().t(),
         torch.randn(9000, generator=g).half(), torch.arange(12)]

class Emit(nn.Module):
    def forward(self):
        return tuple(fixed)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 1200)          # 512 x 1200: split across threads
        self.act = nn.ReLU()
        self.head = nn.Linear(1200, 3)
        self.emit = Emit()

    def forward(self, x):
        self.emit()
        return self.head(self.act(self.fc(x)))

torch.manual_seed(0)
model = Net()
seen, step = [], [0]
def keep(name, t):
    seen.append((name, step[0], t.detach().clone()))
def hook(m, a, o, name):
    for i, t in enumerate(o if isinstance(o, tuple) else (o,)):
        keep(f"{name}:{i}" if isinstance(o, tuple) else name, t)
for name, m in [("(root)", model), *model.named_children()]:
    m.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
x = torch.randn(512, 64, generator=g)
rec = Recorder(model, out + "/run", layers="*", capture="activations", tensors_every=None,
               stats_every=2 if mode == "cold" else 1, close_timeout=300).attach()
for i in range(4):
    step[0] = i
    with rec.step():
        model(x).square().mean().backward()
    if mode == "broken" and i == 0:
        rec.flush()                                 # the writer's load has failed: told to all
rec.close()
torch.save(seen, out + "/seen.pt")
print(json.dumps([on_training, torch.get_num_threads(), eager]))
'''


def _cold(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=ROOT, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               TENSORTAPE_ENGINE="numba")
    p = subprocess.run([sys.executable, "-c", COLD, str(tmp_path), mode], env=env,
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return open_run(str(tmp_path / "run")), torch.load(tmp_path / "seen.pt"), \
        __import__("json").loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _stored(run, seen, every):
    """Each capture the hooks saw, with what the store holds of it: statistics and
    histogram at a step with statistics (of ``every``), non-finite counts (events) at
    one without; None where no statistics are stored (a float tensor's only its count)."""
    ds = run.stats().compute()
    events = {(e.step, e.layer): (e.nan, e.posinf, e.neginf) for e in run.events}
    for name, step, x in seen:
        if step % every:
            yield name, step, x, events.get((step, name), (0, 0, 0))
            continue
        if step not in ds["step"].values:
            yield name, step, x, None
            continue
        row = ds.sel(layer=name, step=step)
        got = {k: row[k].item() for k in oracle.STATS}
        lost = np.isnan(got["count"]) or x.is_floating_point() and np.isnan(got["min"])
        yield name, step, x, None if lost else (got, run.histogram(name, step=step).values)


def _digest(x):
    return hashlib.sha1(x.view(torch.uint8).numpy()).hexdigest()


def _nonfinite(x):
    if not x.is_floating_point():
        return 0, 0, 0
    v = oracle.values(x)
    return tuple(int(n) for n in ((np.isnan(v).sum(), (v == np.inf).sum(), (v == -np.inf).sum())))


def test_the_first_steps_on_a_fresh_machine_are_summarised_off_the_training_thread(tmp_path):
    run, seen, (on_training, threads, eager), _ = _cold(tmp_path, "cold")
    assert run.dropped == 0
    assert on_training == []          # no eager kernel on the training thread: the writer's work
    e = engine()                      # this process's numba kernels, loaded (warm)
    assert len(seen) == 4 * 9
    for name, step, x, stored in _stored(run, seen, 2):
        if step % 2:                  # no statistics: the exact non-finite counts
            assert stored == _nonfinite(x), (name, step)
            continue
        got, hist = stored
        if not x.is_floating_point():                 # a count, and nothing else
            assert got["count"] == x.numel() and np.isnan(got["mean"]), (name, step)
            continue
        check(got, hist, x)
        # bit for bit the sums of the engine that made them: the warm numba kernels', or the
        # torch kernels' where the numba ones came past the writer's patience (a loaded
        # machine: their compile apart runs niced); split as the child split them (another
        # test in this process may have changed the threads)
        if x.numel() >= 8192 and x.is_floating_point():
            x = prepared(x).contiguous()              # the copy the writer was handed
            eagerly = eager.count(_digest(x)) > 0      # the earliest of equal tensors first
            if eagerly:
                eager.remove(_digest(x))
            by = Engine.reduce if eagerly else type(e).reduce
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                want = {k: v[0] for k, v in finalize([by(e, x).numpy()]).stats.items()}
            finally:
                torch.set_num_threads(before)
            for k in ("mean", "std", "norm"):
                assert got[k] == want[k], (name, step, k, got[k], want[k])


def test_kernels_that_fail_to_compile_still_store_the_first_steps(tmp_path):
    run, seen, _, err = _cold(tmp_path, "broken")
    assert "compile broken" in err                  # told (once), never raised
    lost = [(name, step) for name, step, x, stored in _stored(run, seen, 1) if stored is None]
    for name, step, x, stored in _stored(run, seen, 1):
        if stored is not None and x.is_floating_point():
            check(*stored, x)
    # a dtype's capture that met the failure on the training thread is dropped (counted) as
    # its engine is demoted; the captures left to the writer are summarised there (eagerly)
    assert len(lost) == run.dropped and 0 < run.dropped < 8, lost
    assert all(step == 0 for _, step in lost[:-2]) and all(step < 2 for _, step in lost), lost
