"""Nothing tensortape runs raises into training, unless the user asked for it.

A failure is injected into each statistics engine (Triton, the compiled and the
eager torch kernels, the batched kernels of tiny tensors, the NaN/Inf counter),
into the snapshot and into the hooks' own walk of an output.  Each time the
training is bit-identical to an unrecorded run, the failed captures are dropped
and counted with their reason, one warning names the cause, and a failing engine
is replaced by the next one (later steps have statistics again).  The policies
a user chose still raise.
"""
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import ConfigError, InspectionError, NonFiniteError, Recorder
from tensortape.recorder.capture import _engines, _snapshot
from tensortape.recorder.hooks import _hooks

try:                                   # the numba engine, when numba is installed
    from tensortape.recorder.capture import _numba
except ImportError:
    _numba = None

STEPS = 4


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def batch(i):
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(i))


def train(m, rec=None, **step_kw):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(STEPS):
        with rec.step(i) if rec is not None else torch.enable_grad():
            m(batch(i)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in m.parameters()]


class Injected(RuntimeError):
    pass


def failing(real, calls):
    """``real``, but its first call raises."""
    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise Injected("injected failure")
        return real(*args, **kwargs)
    return wrapper


# where: (object, attribute, Recorder keywords, environment)
TORCH = {"TENSORTAPE_ENGINE": "torch"}           # the torch kernels, not numba's
PLACES = {
    "compiled kernels": (_engines.CpuEngine, "reduce", {}, {"TENSORTAPE_COMPILE": "1", **TORCH}),
    "eager kernels": (_engines.CpuEngine, "reduce", {}, {"TENSORTAPE_COMPILE": "0"}),
    "batched tiny tensors": (_engines.CpuEngine, "reduce_many", {}, TORCH),
    # a step without statistics counts tiny tensors' NaN/Inf in one batch (this model's)
    "NaN/Inf counter": (_engines.CpuEngine, "count_nonfinite_many", {"stats_every": 2}, TORCH),
    "snapshot": (_snapshot.Stager, "take", {"tensors_every": 1}, {}),
    "hook walk": (_hooks, "leaves", {}, {}),
}


@pytest.mark.parametrize("where", list(PLACES))
def test_a_failure_inside_tensortape_never_reaches_training(tmp_store, monkeypatch, where):
    owner, attr, kw, env = PLACES[where]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    want = train(model())
    calls = []
    monkeypatch.setattr(owner, attr, failing(getattr(owner, attr), calls))
    m = model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = tmp_store
        with Recorder(m, store, capture=("activations", "gradients"),
                      **{"stats_every": 1, "tensors_every": None, **kw}) as rec:
            got = train(m, rec)
    for a, b in zip(got, want):                      # training is untouched, to the bit
        assert torch.equal(a, b)
    run = open_run(store)
    reasons = run.attrs["drop_reasons"]
    failed = {r: n for r, n in reasons.items() if "Injected: injected failure" in r}
    assert failed and sum(failed.values()) >= 1, reasons
    assert run.dropped == sum(reasons.values())
    told = [w for w in seen if "injected failure" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in seen]          # once, naming the cause
    assert len(calls) > 1                   # the failing piece was not a one-time thing ...
    if "stats_every" not in kw:             # ... and every later step has statistics again
        assert run.steps().tolist()[-2:] == [STEPS - 2, STEPS - 1]


def test_a_failing_triton_engine_gives_way_to_the_torch_kernels(tmp_store, monkeypatch):
    triton_engine = pytest.importorskip("tensortape.recorder.capture._triton").TritonEngine
    monkeypatch.setenv("TENSORTAPE_ENGINE", "triton")       # Triton for CPU tensors: it fails,
    calls = []                                               # as a launch on a bad device would
    monkeypatch.setattr(triton_engine, "reduce", failing(lambda self, x: (_ for _ in ()).throw(
        Injected("injected failure")), calls))
    want = train(model())
    m = model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Recorder(m, tmp_store, tensors_every=None, stats_every=1) as rec:
            got = train(m, rec)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    told = [str(w.message) for w in seen if "injected failure" in str(w.message)]
    cpu = "CpuEngine" if _numba is None else "NumbaEngine"  # what takes the CPU after Triton
    assert len(told) == 1 and "TritonEngine" in told[0] and cpu in told[0], told
    assert len(calls) == 1                                   # never asked again
    run = open_run(tmp_store)
    assert run.steps().tolist() == list(range(STEPS))
    stats = run.stats().compute()
    assert np.isfinite(stats["std"].sel(step=STEPS - 1).values).all()


def test_the_policies_a_user_chose_still_raise(tmp_store, tmp_path):
    m = model()
    with Recorder(m, tmp_store, outside_step="raise", tensors_every=1, stats_every=1) as rec:
        with pytest.raises(InspectionError, match="outside a step"):
            m(batch(0))
    m = model()
    with pytest.raises(NonFiniteError, match="step 1"):
        with Recorder(m, str(tmp_path / "b.zarr"), on_nonfinite="raise", tensors_every=1, stats_every=1) as rec:
            for i in range(3):
                with rec.step(i):
                    x = batch(i)
                    if i == 1:
                        x[0, 0] = float("nan")
                    m(x).sum().backward()


def test_a_bad_engine_setting_is_a_config_error_in_one_line(monkeypatch):
    monkeypatch.setenv("TENSORTAPE_ENGINE", "cuda")
    for make in (_engines.engine_choice, _engines.Engines):
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value) == ("TENSORTAPE_ENGINE='cuda' is not valid; use one of auto, numba, "
                                "torch, triton (or leave it unset)")
    monkeypatch.setenv("TENSORTAPE_ENGINE", "torch")
    assert _engines.engine_choice() == "torch"
