"""The CUDA statistics engine (Triton), run on the CPU by Triton's interpreter.

CI has no GPU: ``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors, and
``TENSORTAPE_ENGINE=triton`` makes the recorder use it.  Its statistics must
equal the CPU engine's: counts and histograms identical, sums equal but for
rounding.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tensortape.analysis import open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECORD = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from tensortape.recorder import Recorder

    g = torch.Generator().manual_seed(0)
    n = 12289                                   # odd, and past the batched tiny tensors
    def long_above():       # several blocks a program, and values far above every sampled one
        x = torch.randn(40961, generator=g)
        x[1::40] *= 1e6     # the shift samples every 40th element from the first
        return x

    def cases():
        normal = torch.randn(n, generator=g)
        special = torch.randn(n, generator=g)
        special[::7] = float("nan"); special[1::11] = float("inf"); special[2::13] = -float("inf")
        special[3::17] = 0.0; special[4::19] = -0.0
        tiny = torch.randn(n, generator=g) * 1e-40  # subnormal in float32
        out = {"normal": normal, "relu": normal.relu(), "zeros": torch.zeros(n),
               "special": special, "subnormal": tiny, "wide": torch.randn(n, generator=g) * 1e30,
               "spread": torch.randn(n, generator=g) * torch.logspace(-30, 30, n),  # past any window
               "above": long_above(),
               "matrix": torch.randn(97, 131, generator=g).t(),
               "nan first": torch.cat([torch.full((3,), float("nan")), torch.randn(n, generator=g) * 1e-3 + 1e4])}
        return [t.to(d) for d in (torch.float32, torch.float16, torch.bfloat16)
                for t in out.values()] + [torch.zeros(0), torch.arange(9000)]

    class Emit(nn.Module):
        def forward(self):
            return tuple(cases())

    model = Emit()
    with Recorder(model, sys.argv[1], layers="", capture="activations", tensors_every=None, stats_every=1) as rec:
        with rec.step():
            model()
    from tensortape.recorder.capture._engines import Engines
    print(type(Engines().for_tensor(torch.zeros(1))).__name__)
""")


def _record(store, engine):
    env = dict(os.environ, TENSORTAPE_ENGINE=engine, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", RECORD, store], env=env, capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip()


def test_triton_engine_equals_the_cpu_engine(tmp_path):
    pytest.importorskip("triton")
    assert _record(str(tmp_path / "triton.zarr"), "triton") == "TritonEngine"
    assert _record(str(tmp_path / "torch.zarr"), "torch") == "CpuEngine"
    a = open_run(str(tmp_path / "triton.zarr"))
    b = open_run(str(tmp_path / "torch.zarr"))
    sa, sb = a.stats().compute(), b.stats().compute()
    assert sa.sizes["layer"] == 3 * 10 + 2
    for s in ("count", "nan", "posinf", "neginf", "zero_frac", "min", "max", "abs_max"):
        np.testing.assert_array_equal(sa[s].values, sb[s].values, err_msg=s)
    for s in ("mean", "std", "norm"):
        np.testing.assert_allclose(sa[s].values, sb[s].values, rtol=1e-9, atol=1e-45, err_msg=s)
    for layer in sa.layer.values:
        np.testing.assert_array_equal(a.histogram(str(layer), step=0).values,
                                      b.histogram(str(layer), step=0).values, err_msg=str(layer))
    assert sa["nan"].values.sum() > 0 and sa["posinf"].values.sum() > 0      # the cases hold them
    nan_first = [str(layer) for layer in sa.layer.values][9::10][:3]           # each dtype's
    assert [sa.sel(layer=layer)["nan"].item() for layer in nan_first] == [3, 3, 3]
    std = sa.sel(layer=nan_first[0])["std"].item()     # float32: 1e4 + 1e-3 * randn, NaN first
    assert abs(std - 1e-3) < 1e-4, std                 # summed around 0 it was 14-40% off


LAUNCHES = textwrap.dedent("""
    import collections, concurrent.futures, json, torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from tensortape.recorder.capture import _triton
    from tensortape.recorder.capture._engines import Engines

    class Ops(TorchDispatchMode):         # the torch ops a capture's statistics queue
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    launches = collections.Counter()
    for name in ("_summary_kernel", "_finish_kernel"):
        kernel = getattr(_triton, name)
        def run(*a, _run=kernel.run, _name=name, **k):
            launches[_name] += 1
            return _run(*a, **k)
        kernel.run = run
    engine = Engines().for_tensor(torch.zeros(1))
    reference = Engines(choice="torch").for_tensor(torch.zeros(1))
    out = {"engine": type(engine).__name__, "tensors": []}
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = (torch.randn(3, 4099, generator=g) * 3 + 7).to(dtype)
        x[0, :5] = float("nan")
        engine.reduce(x)                  # compiled now: the count is of a warm launch
        launches.clear()
        with Ops() as ops:
            got = engine.reduce(x)
        want = reference.reduce(x)
        out["tensors"].append({"launches": dict(launches), "ops": dict(ops.ops),
                               "equal": bool(torch.equal(got[4:], want[4:]) and got[0] == want[0])})
    launches.clear()
    pending = concurrent.futures.Future()     # its kernels still compiling: the torch kernels
    engine._warming[torch.float32] = pending
    x = torch.randn(5000, generator=g)
    got = engine.reduce(x)
    out["compiling"] = {"launches": sum(launches.values()),
                        "equal": bool(torch.equal(got[4:], reference.reduce(x)[4:]))}
    print(json.dumps(out))
""")


def test_a_tensor_costs_two_launches_and_no_other_kernel(tmp_path):
    """The fixed cost per tensor (issue: 0.5 ms whatever its size): the pass and the
    finishing kernel, and no torch kernel besides (the interpreter's own copies
    of the arguments aside); while the kernels compile, the torch kernels give the
    same vector."""
    pytest.importorskip("triton")
    import json
    env = dict(os.environ, TENSORTAPE_ENGINE="triton", TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", LAUNCHES], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["engine"] == "TritonEngine"
    interpreter = {"empty", "new_empty", "set_", "copy_", "detach", "view"}
    for t in out["tensors"]:
        assert t["launches"] == {"_summary_kernel": 1, "_finish_kernel": 1}, t
        assert set(t["ops"]) <= interpreter, t
        assert t["equal"], t
    assert out["compiling"] == {"launches": 0, "equal": True}
