"""``compare``'s full-tensor metrics (rel_l2, cosine, max_abs, sqnr_db) are right for
any finite values and quiet on any stored value: no numpy warning leaks (under
``-W error`` or pytest, a leaked one made ``compare`` exit 2).

The truth is exact ``Fraction`` sums of the tensors as recorded."""
import decimal
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from tensortape import Recorder, cli
from tensortape.analysis import compare_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Emit(nn.Module):
    """A layer whose output is the tensor set in ``value``, as it is."""

    def __init__(self):
        super().__init__()
        self.value = torch.zeros(1)

    def forward(self):
        return self.value.clone()


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.x, self.y = Emit(), Emit()

    def forward(self):
        return self.x(), self.y()


def record(path, steps):
    """A run of ``Two`` whose layer ``x`` emits ``steps[i][0]`` at step i, ``y``
    ``steps[i][1]`` (each a tensor, or None: the layer does not run)."""
    model = Two()
    with Recorder(model, path, layers=["x", "y"], capture=("activations",), tensors_every=1,
                  max_bytes=None, stats_every=1) as rec:
        for i, (x, y) in enumerate(steps):
            model.x.value, model.y.value = x, y
            with rec.step(i):
                model()
    return path


def exact(a, b) -> dict:
    """The metrics of ``b`` against ``a`` (finite float64), from exact sums (Fractions,
    then 60 digits for the roots and logarithms; floats round once, to inf past float64)."""
    fa, fb = [Fraction(v) for v in a], [Fraction(v) for v in b]
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        d = lambda f: decimal.Decimal(f.numerator) / decimal.Decimal(f.denominator)
        aa, bb = d(sum(x * x for x in fa)), d(sum(y * y for y in fb))
        dd = d(sum((y - x) ** 2 for x, y in zip(fa, fb)))
        ab = d(sum(x * y for x, y in zip(fa, fb)))
        big = d(max(abs(y - x) for x, y in zip(fa, fb)))
        return {"rel_l2": float((dd / aa).sqrt()) if aa else (0.0 if not dd else math.inf),
                "cosine": float(ab / (aa * bb).sqrt()) if aa and bb else float(aa == bb),
                "max_abs": float(big),
                "sqnr_db": math.inf if not dd else float(10 * (aa / dd).log10()) if aa
                else -math.inf}


FLOATS = st.floats(allow_nan=False, allow_infinity=False)
PAIRS = st.integers(1, 5).flatmap(lambda n: st.tuples(
    st.lists(FLOATS, min_size=n, max_size=n),
    st.one_of(st.none(), st.lists(FLOATS, min_size=n, max_size=n))))   # None: the same values


@settings(max_examples=5, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(pairs=st.lists(PAIRS, min_size=1, max_size=3))
@example(pairs=[([1e200, -1e200, 3.0], None)])             # squares past float64
@example(pairs=[([1e308, -1e308], [-1e308, 1e308])])       # a difference past float64
@example(pairs=[([1e308, 1e-300], [1e308, 2e-300])])       # a difference far below the values
@example(pairs=[([5e-324, 1e-320], [5e-324, 2e-320])])     # subnormals
def test_full_tensor_metrics_are_exact_for_any_finite_values(tmp_path_factory, pairs):
    """Before: float64 values above 1e154 overflowed the dot products: "overflow in
    dot" warnings, and cosine NaN for identical tensors."""
    tmp = tmp_path_factory.mktemp("metrics")
    steps = [(torch.tensor(a, dtype=torch.float64), torch.tensor(a if b is None else b,
                                                                  dtype=torch.float64))
             for a, b in pairs]
    run_a = record(str(tmp / "a.zarr"), [(x, y) for x, y in steps])
    run_b = record(str(tmp / "b.zarr"), [(y, x) for x, y in steps])
    ds = compare_runs(run_a, run_b)
    for i, (a, b) in enumerate(pairs):
        b = a if b is None else b
        for layer, (x, y) in (("x", (a, b)), ("y", (b, a))):
            want = exact(x, y)
            for metric, w in want.items():
                got = float(ds[metric].sel(step=i, layer=np.array([layer], object)).item())
                what = (i, layer, metric, got, w, x, y)
                if math.isinf(w) or w == 0:
                    assert got == w, what
                elif metric == "sqnr_db":
                    assert got == pytest.approx(w, rel=1e-12, abs=1e-9), what
                else:
                    assert got == pytest.approx(w, rel=1e-12), what


FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


@pytest.mark.parametrize("dtype", FLOAT8)
def test_compare_of_a_float8_nan_is_quiet(tmp_path, dtype):
    """Before: the NaN of e4m3fnuz, e5m2fnuz and e8m0fnu (decoded, as torch widens it,
    to the signalling NaN 0x7F800001) warned "invalid value encountered in cast", and
    ``compare`` exited 2 under ``-W error`` and pytest."""
    value = torch.tensor([1.0, 0.5, math.nan]).to(getattr(torch, dtype))
    path = record(str(tmp_path / "run.zarr"), [(value, value)] * 2)
    r = CliRunner().invoke(cli.cli, ["compare", path, path, "--format", "json"])
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    ds = compare_runs(path, path)
    assert (ds["rel_l2"].values == 0).all() and (ds["cosine"].values == 1).all()
    if dtype == "float8_e4m3fnuz":         # as a user runs it
        p = subprocess.run([sys.executable, "-W", "error", "-m", "tensortape", "compare", path,
                            path], capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert p.returncode == 0 and "warning" not in p.stderr, p.stderr


ODD = st.sampled_from([math.nan, math.inf, -math.inf])
STEP = st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-1e3, 1e3), min_size=n, max_size=n),
    st.lists(st.floats(-1e3, 1e3), min_size=n, max_size=n),
    st.one_of(st.none(), st.tuples(st.integers(0, n - 1), ODD, st.booleans()))))


@settings(max_examples=5, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(steps=st.lists(STEP, min_size=2, max_size=6))
@example(steps=[([1.0, 2.0], [1.0, 2.5], (0, math.nan, True)),      # the same NaN: left out
                ([1.0, 2.0], [1.5, 2.0], None),
                ([1.0, 2.0], [1.0, 2.0], (1, math.inf, False)),      # an Inf in one run only
                ([3.0, 4.0, 5.0], [3.0, 4.0, 6.0], None)])
def test_a_layers_steps_compared_together_are_each_as_alone(tmp_path_factory, steps):
    """The steps of one layer are compared as rows of one array where their shapes
    agree; finite and non-finite steps, and steps of other shapes, side by side, each
    as a plain sum over its own elements says."""
    tmp = tmp_path_factory.mktemp("rows")
    pairs = []
    for a, b, odd in steps:
        a, b = list(a), list(b)
        if odd is not None:
            at, value, both = odd
            a[at] = value
            b[at] = value if both else b[at]
        pairs.append((a, b))
    tensors = [(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
               for a, b in pairs]
    ds = compare_runs(record(str(tmp / "a.zarr"), [(x, x) for x, _ in tensors]),
                      record(str(tmp / "b.zarr"), [(y, y) for _, y in tensors]))
    for i, (a, b) in enumerate(pairs):
        keep = [j for j in range(len(a)) if math.isfinite(a[j]) and math.isfinite(b[j])]
        same = all(j in keep or a[j] == b[j] or (math.isnan(a[j]) and math.isnan(b[j]))
                   for j in range(len(a)))
        want = exact([a[j] for j in keep], [b[j] for j in keep]) if same else \
            {"rel_l2": math.inf, "cosine": math.nan, "max_abs": math.inf, "sqnr_db": -math.inf}
        for metric, w in want.items():
            got = float(ds[metric].sel(step=i, layer=np.array(["x"], object)).item())
            if math.isnan(w) or math.isinf(w) or w == 0:
                assert got == w or (math.isnan(w) and math.isnan(got)), (i, metric, got, w, a, b)
            else:
                assert got == pytest.approx(w, rel=1e-9, abs=1e-12), (i, metric, got, w, a, b)
