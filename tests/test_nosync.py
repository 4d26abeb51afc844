"""The training thread never waits for the device: after the first step (which
compiles the statistics kernels), nothing tensortape runs in a step reads a value
back to the host (``.item()``, ``.cpu()``, ``.tolist()``, a scalar read), builds a
device tensor from a list, or synchronizes.  Checked on the CPU with a dispatch
mode and patched methods, which see the training thread only; only
``on_nonfinite="raise"`` may wait, at the step's end."""
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tensortape.recorder import NonFiniteError, Recorder


class Watch(TorchDispatchMode):
    """Every host read-back on this (the training) thread, with its op."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def patched(monkeypatch):
    seen, me = [], threading.get_ident()

    def spy(name, real):
        def call(*a, **k):
            if threading.get_ident() == me:
                seen.append(name)
            return real(*a, **k)
        return call
    for name in ("cpu", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", spy("synchronize", torch.cuda.synchronize))
    real_tensor = torch.tensor

    def tensor(data, *a, device=None, **k):
        if device is not None and torch.device(device).type != "cpu" and \
                threading.get_ident() == me:
            seen.append("torch.tensor(list, device=...)")
        return real_tensor(data, *a, device=device, **k)
    monkeypatch.setattr(torch, "tensor", tensor)
    return seen


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8), nn.Sigmoid())


CONFIGS = [dict(),                                            # statistics and full tensors
           dict(tensors_every=None),
           dict(stats_every=2, tensors_every=3, ring=2, on_nonfinite="dump"),
           dict(capture=("activations", "gradients", "inputs", "weights", "weight_grads")),
           dict(engine="torch")]     # the torch kernels (and their shift), not numba's


@pytest.mark.parametrize("kw", CONFIGS, ids=["default", "stats", "ring-dump", "every-kind",
                                             "torch-engine"])
def test_no_step_reads_back_from_the_device(tmp_path, patched, kw, monkeypatch):
    kw = dict(kw)
    if "engine" in kw:
        monkeypatch.setenv("TENSORTAPE_ENGINE", kw.pop("engine"))
    m = model()
    with Recorder(m, str(tmp_path / "r.zarr"), layers="*", **{"stats_every": 1, **kw}) as rec:
        for i in range(7):
            x = torch.randn(32, 64)                     # tiny and large tensors alike
            big = torch.randn(256 + 32 * (i % 2), 64)   # shapes change: no recompile
            if i == 4:
                big = big.clone()
                big[0, 0] = float("nan")
            watch = Watch()
            patched.clear()
            with watch:
                with rec.step(i):
                    for part in (x, big):               # two micro-batches
                        m(part).sum().backward()
            if i >= 2:      # steps 0 and 1 compile the kernels they use first (on this thread)
                assert watch.seen == [] and patched == [], (i, watch.seen, patched)


def test_raise_waits_only_at_the_step_end(tmp_path, patched):
    """on_nonfinite="raise" reads the step's counts back at its end, to raise; its
    forward and backward still read nothing back."""
    m = model()
    with pytest.raises(NonFiniteError):
        with Recorder(m, str(tmp_path / "r.zarr"), on_nonfinite="raise", tensors_every=1, stats_every=1) as rec:
            for i in range(4):
                x = torch.randn(32, 64) if i < 3 else torch.full((32, 64), float("nan"))
                with rec.step(i):
                    watch = Watch()
                    patched.clear()
                    with watch:                     # forward and backward only
                        m(x).sum().backward()
                    if i >= 1:
                        assert watch.seen == [] and patched == [], (i, watch.seen, patched)
