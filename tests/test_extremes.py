"""float64 tensors at the ends of its range: every finite tensor gets finite, right moments.

Values past ``2 ** 512`` square past float64, and values below ``2 ** -537`` square to zero: a
float64 model that diverges (or vanishes) must still show its layers, with the mean, std and
norm of its values, on every engine (numba, the torch kernels compiled and eager, Triton, and
a step's tiny tensors summarised together), for one micro-batch and for several taken
together.  ``inf`` only where the truth itself is past float64.

The truth is exact integer arithmetic: every float64 is an integer times ``2 ** -1074``
(numpy in float64 is no truth here: it overflows, underflows, and loses a small spread under
a large mean).
"""
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st
from torch import nn

import oracle
from tensortape import Recorder, open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = {"numba": {"TENSORTAPE_ENGINE": "numba"},
           "torch compiled": {"TENSORTAPE_ENGINE": "torch", "TENSORTAPE_COMPILE": "1"},
           "torch eager": {"TENSORTAPE_ENGINE": "torch", "TENSORTAPE_COMPILE": "0"}}
TOP = 1.7976931348623157e308
# the issue's tensor: truth norm 7.746e201, std 8.165e199 (they were NaN)
ISSUE = (9000, 0, 0, 0.0, 0, "issue")


def extreme(n, e, spread, center, seed, special=""):
    """A float64 tensor of ``n`` values ``(center + 2 ** spread * z) * 2 ** e`` (``z``
    normal); ``special``: the issue's tensor, float64's largest values alone ("edges": the
    std is the largest, the norm past float64), or extremes sprinkled in."""
    if special == "issue":
        return torch.tensor([1e200, -1e200, 1e150] * (n // 3), dtype=torch.float64)
    if special == "edges":
        return torch.tensor([TOP, -TOP] * (n // 2), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64).numpy()
    with np.errstate(over="ignore"):                   # past float64: inf, a value counted
        x = torch.from_numpy(np.ldexp(center + math.ldexp(1.0, spread) * z, e))
    if special:
        values = {"top": [TOP, -TOP], "tiny": [5e-324, -5e-324, 0.0, -0.0],
                  "nonfinite": [float("nan"), float("inf"), -float("inf")]}[special]
        at = torch.randint(0, n, (max(1, n // 50),), generator=g)
        x[at] = torch.tensor(values, dtype=torch.float64).repeat(len(at))[:len(at)]
    return x


def _scaled_ints(x):
    """The finite values of ``x`` as integers times 2 ** -1074 (exact)."""
    out = []
    for v in x.reshape(-1).tolist():
        if math.isfinite(v):
            p, q = v.as_integer_ratio()                # q: a power of two, at most 2 ** 1074
            out.append(p << (1075 - q.bit_length()))
    return out


def _root(f):
    """The square root of a non-negative rational, as a float (within two ulps; inf
    past float64)."""
    if not f:
        return 0.0
    e = (f.numerator.bit_length() - f.denominator.bit_length()) // 2
    m = f * 4 ** -e if e < 0 else f / 4 ** e             # exact: within [1/4, 16)
    try:
        return math.ldexp(math.sqrt(m.numerator / m.denominator), e)
    except OverflowError:
        return math.inf


def truth(xs):
    """Exact count, mean, std and norm of tensors taken together, and a bound on a
    float64 sum's rounding of the mean (``n`` times float64's epsilon of the range,
    plus a few of the largest magnitude)."""
    from fractions import Fraction
    ints = [i for x in xs for i in _scaled_ints(x)]
    n, s, q = len(ints), sum(ints), sum(i * i for i in ints)
    if not n:
        return None
    unit = Fraction(1, 1 << 1074)
    span = (max(ints) - min(ints)) * unit
    top = max(abs(i) for i in ints) * unit
    return {"mean": float(Fraction(s, n) * unit),
            "std": _root(Fraction(n * q - s * s, n * n) * unit ** 2),
            "norm": _root(q * unit ** 2),
            "tol": float(span * n * Fraction(1, 1 << 50) + top / (1 << 50))}


def check(run, stats, step, layer, xs, t):
    """One stored row (of ``stats``, the run's statistics) against ``t``, the truth of
    ``xs`` (its micro-batches)."""
    row = stats.sel(layer=layer, step=step)
    with np.errstate(all="ignore"):                    # the oracle's numpy moments overflow
        want = oracle.statistics(xs)
    for k in ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac"):
        np.testing.assert_array_equal(row[k].item(), want[k], err_msg=f"{k} of {layer}")
    np.testing.assert_array_equal(run.histogram(layer, step=step).values,
                                  oracle.histogram(np.concatenate([oracle.values(x) for x in xs])))
    if t is None:
        for k in ("mean", "std"):
            assert math.isnan(row[k].item()), (layer, k)
        return
    for k in ("std", "norm"):
        got = row[k].item()
        # a norm within rounding of float64's largest value may round either way
        edge = k == "norm" and got == math.inf and t[k] >= TOP * (1 - 1e-12)
        assert got == t[k] or math.isclose(got, t[k], rel_tol=1e-9) or edge, (layer, k, got, t[k])
    assert math.isfinite(row["std"].item()), layer
    got = row["mean"].item()
    assert math.isfinite(got) and abs(got - t["mean"]) <= t["tol"], (layer, got, t)


class Emit(nn.Module):
    def __init__(self):
        super().__init__()
        self.xs = []

    def forward(self):
        return tuple(self.xs)


def record(store, cases):
    """Step 0: each case in one pass; step 1: each case's two halves, one pass each (two
    micro-batches, taken together)."""
    model = Emit()
    halves = [(x[: len(x) // 2], x[len(x) // 2:]) for x in cases]
    with Recorder(model, store, layers="", capture="activations", tensors_every=None, stats_every=1) as rec:
        with rec.step():
            model.xs = cases
            model()
        with rec.step():
            for part in (0, 1):
                model.xs = [h[part] for h in halves]
                model()
    return open_run(store), halves


def check_all(run, cases, halves, truths):
    """Every case's rows: step 0's (one pass) and step 1's (its halves together), whose
    truth is the same.  The statistics are read once (a read each row took seconds)."""
    stats = run.stats().compute()
    for i, (x, t) in enumerate(zip(cases, truths)):
        check(run, stats, 0, f"(root):{i}", [x], t)
        check(run, stats, 1, f"(root):{i}", list(halves[i]), t)


# exponents at both ends of float64 and around 1; sizes below and above the tiny tensors' batch
_case = st.tuples(st.sampled_from([2, 7, 300, 9000, 20000]),
                  st.one_of(st.integers(-1074, -400), st.integers(400, 1023), st.integers(-30, 30)),
                  st.integers(-60, 0), st.sampled_from([0.0, 1.0, -0.75]),
                  st.integers(0, 2 ** 31 - 1), st.sampled_from(["", "top", "tiny", "nonfinite"]))


@pytest.fixture(scope="module")
def numba_ready():
    """numba's float64 kernels loaded, so that its engine (not the eager kernels a
    capture takes while they compile) summarises what the test records."""
    pytest.importorskip("numba")
    from tensortape.recorder.capture._engines import Engines
    Engines(choice="numba").for_tensor(torch.zeros(1)).ready(torch.float64, wait=True)


@pytest.mark.parametrize("engine", list(ENGINES))
@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cases=st.lists(_case, min_size=6, max_size=10))
@example(cases=[ISSUE, (9000, 1023, -2, 1.0, 1, ""), (9000, 1023, -2, -1.0, 2, "top"),
                (20000, -1074, 0, 0.0, 3, ""), (300, -1050, -3, 1.0, 4, "tiny"),
                (7, 1000, 0, 1.0, 5, "nonfinite"), (7, -960, -60, 0.0, 24034, "top"),
                (2, 0, 0, 0.0, 0, "edges"), (9000, 0, 0, 0.0, 0, "edges")])
def test_every_finite_float64_tensor_gets_finite_right_moments(cases, engine, numba_ready,
                                                               tmp_path_factory, monkeypatch):
    for k, v in ENGINES[engine].items():
        monkeypatch.setenv(k, v)
    xs = [extreme(*c) for c in cases]
    run, halves = record(str(tmp_path_factory.mktemp("run") / "run.zarr"), xs)
    check_all(run, xs, halves, [truth([x]) for x in xs])


def test_a_float64_tensor_in_pieces_is_scaled_as_a_whole(tmp_path, monkeypatch, numba_ready):
    """A tensor past an engine's piece (2 ** 21 elements) whose one huge value is in
    its last piece: every piece's sums take the whole tensor's scale."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn((1 << 21) + 4099, generator=g, dtype=torch.float64) + 3.0
    x[-3:] = torch.tensor([1e300, -3e299, 1e-300], dtype=torch.float64)
    t = truth([x])
    for engine, env in ENGINES.items():
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        run, halves = record(str(tmp_path / f"{engine}.zarr"), [x])
        check_all(run, [x], halves, [t])


TRITON = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from tensortape import Recorder
    sys.path.insert(0, sys.argv[3])
    from test_extremes import record, extreme
    cases = [extreme(*c) for c in eval(sys.argv[2])]
    torch.save(cases, sys.argv[1] + ".pt")
    record(sys.argv[1], cases)
    from tensortape.recorder.capture._engines import Engines
    print(type(Engines().for_tensor(torch.zeros(1))).__name__)
""")


def test_the_triton_engine_gets_them_too(tmp_path):
    """Triton (run by its interpreter on the CPU) hands float64 to the torch kernels."""
    pytest.importorskip("triton")
    cases = [ISSUE, (9000, 1023, -2, 1.0, 1, ""), (20000, -1074, 0, 0.0, 3, ""),
             (300, -1050, -3, 1.0, 4, "tiny"), (9000, 600, -40, 1.0, 6, "top")]
    store = str(tmp_path / "run.zarr")
    env = dict(os.environ, TENSORTAPE_ENGINE="triton", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", TRITON, store, repr(cases),
                        os.path.dirname(__file__)],
                       env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "TritonEngine", p.stderr[-3000:]
    xs = torch.load(store + ".pt")
    check_all(open_run(store), xs, [(x[: len(x) // 2], x[len(x) // 2:]) for x in xs],
              [truth([x]) for x in xs])
