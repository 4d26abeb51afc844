"""Statistics, histograms and the NaN flight recorder."""
import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import Inspector, open_run
from tensortape.recorder import NonFiniteError, Recorder
from tensortape.recorder.histogram import ZERO_BIN
from conftest import record_shapes, transformer


def inspect(x):
    """Statistics and histogram of one tensor, through the public Inspector."""
    ident = nn.Identity()
    insp = Inspector(ident)
    insp.watch("", what="activations")
    insp.run_inspection(x)
    return insp.get_statistics("(root)"), insp.get_histogram("(root)").values


class Emit(nn.Module):
    """A model whose output is the given tensors (each recorded as ``(root):i``)."""
    def __init__(self, xs):
        super().__init__()
        self.xs = xs

    def forward(self, _=None):
        return tuple(self.xs)


def record_tensors(store, xs):
    model = Emit(xs)
    with Recorder(model, store, layers="", capture="activations", tensors_every=None, stats_every=1) as rec:
        with rec.step():
            model()
    run = open_run(store)
    return run.stats().isel(step=0).compute(), run


def test_statistics_equal_numpy_on_the_stored_tensor(tmp_store):
    model = transformer()
    with Recorder(model, tmp_store, layers=["layers.*.linear*", "layers.0.self_attn"], tensors_every=1, stats_every=1) as rec:
        for i in range(2):
            with rec.step():
                model(torch.randn(3, 5, 32)).relu().sum().backward()
    run = open_run(tmp_store)
    for kind in ("activations", "gradients"):
        ds = run.stats(kind).compute()
        for layer in ds.layer.values:
            for step in ds.step.values:
                a = run.tensor(str(layer), kind, step=int(step)).values.astype(np.float64).ravel()
                s = ds.sel(layer=layer, step=step)
                assert s["count"] == a.size and s["nan"] == 0
                np.testing.assert_allclose(
                    [s[k].item() for k in ("mean", "std", "min", "max", "abs_max", "norm", "zero_frac")],
                    [a.mean(), a.std(), a.min(), a.max(), np.abs(a).max(), np.linalg.norm(a), (a == 0).mean()],
                    rtol=1e-6, atol=1e-12)
                h = run.histogram(str(layer), kind, step=int(step))
                assert int(h.sum()) == a.size
                np.testing.assert_array_equal(h.values, _numpy_hist(a, h.bin_lo.values, h.bin_hi.values))


def _numpy_hist(a, lo, hi):
    """The shared bins, by their documented edges: [lo, hi) above zero, (lo, hi] below."""
    idx = np.where(a > 0, np.searchsorted(lo, a, side="right") - 1, np.searchsorted(hi, a, side="left"))
    idx = np.where(a == 0, ZERO_BIN, idx)
    return np.bincount(idx, minlength=len(lo))


def test_nan_and_inf_are_counted_and_never_poison_the_rest():
    x = torch.tensor([1.0, -3.0, 0.0, float("nan"), float("inf"), -float("inf"), 2.0, -0.0])
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        stats, hist = inspect(x.to(dtype))
        assert (stats["nan"], stats["posinf"], stats["neginf"], stats["count"]) == (1, 1, 1, 8)
        f = np.array([1.0, -3.0, 0.0, 2.0, 0.0])
        np.testing.assert_allclose([stats["mean"], stats["std"], stats["min"], stats["max"],
                                    stats["zero_frac"], stats["norm"]],
                                   [f.mean(), f.std(), -3, 2, 0.4, np.linalg.norm(f)])
        assert hist.sum() == 5 and hist[ZERO_BIN] == 2


def test_a_nan_with_low_mantissa_bits_is_still_a_nan():
    x = torch.tensor([0x7F800001, 0xFF800002, 0x7F800000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    stats, hist = inspect(x)
    assert (stats["nan"], stats["posinf"], stats["neginf"]) == (2, 1, 0) and hist.sum() == 0


def _awkward_tensors():
    x = torch.randn(1000) * 10 + 1e4       # a large mean: the shifted variance stays exact
    x[1::97] = float("nan")
    x[5] = -float("inf")
    big = torch.randn(64, 8192).relu()      # large: the kernels split across threads
    big[3, ::7] = float("nan")
    outlier = x.clone()
    outlier[0] = 1e30                       # the shift is a huge outlier
    return [x.to(d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)] + [
        big, big.t(), outlier, torch.randn(4, 3, 5).permute(2, 0, 1)]


def test_compiled_and_eager_kernels_record_the_same_statistics(tmp_path, monkeypatch):
    xs = _awkward_tensors()
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TENSORTAPE_COMPILE", flag)
        got[flag] = record_tensors(str(tmp_path / f"c{flag}.zarr"), xs)
    (a, run_a), (b, run_b) = got["1"], got["0"]
    for s in ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac"):
        np.testing.assert_array_equal(a[s].values, b[s].values, err_msg=s)
    for s in ("mean", "std", "norm"):
        np.testing.assert_allclose(a[s].values, b[s].values, rtol=1e-9, err_msg=s)
    for layer in run_a.stats().layer.values:
        np.testing.assert_array_equal(run_a.histogram(str(layer), step=0).values,
                                      run_b.histogram(str(layer), step=0).values)
    for i, x in enumerate(xs):                 # and both equal numpy, in float64
        f = x[torch.isfinite(x)].double().numpy()
        np.testing.assert_allclose([a["mean"].values[i], a["std"].values[i], a["norm"].values[i]],
                                   [f.mean(), f.std(), np.linalg.norm(f)], rtol=1e-9)


@pytest.mark.parametrize("engine", ["torch", "numba"])
def test_a_first_element_that_is_not_finite_leaves_the_variance_exact(tmp_path, monkeypatch,
                                                                       engine):
    """The sums are taken around a finite element: around 0, a large mean with a
    small spread cancels (the std was 0.5-40% off), with every engine, large
    tensors and a step's tiny ones alike."""
    pytest.importorskip(engine)
    monkeypatch.setenv("TENSORTAPE_ENGINE", engine)
    g = torch.Generator().manual_seed(4)
    xs = []
    for n, lead in ((70000, 1), (70000, 5000), (12289, 5), (64, 1), (300, 7)):
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 1e-3 + 1e4).float()
        x[:lead] = float("nan")
        xs.append(x)
    x = (torch.randn(20000, 3, generator=g, dtype=torch.float64) * 1e-3 + 1e4).float()
    x[:50] = float("nan")
    xs.append(x[:, :2])                            # not contiguous: its first rows are NaN
    stats, _ = record_tensors(str(tmp_path / "run.zarr"), xs)
    for i, x in enumerate(xs):
        f = x[torch.isfinite(x)].double().numpy()
        row = stats.sel(layer=f"(root):{i}")
        np.testing.assert_allclose([row["mean"].item(), row["std"].item()], [f.mean(), f.std()],
                                   rtol=1e-9, err_msg=f"tensor {i}")


def test_tiny_tensors_summarised_together_equal_one_at_a_time(tmp_store):
    """A step's tiny tensors share kernels; their statistics must not show it."""
    xs = [torch.randn(5, 7), torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1.0]),
          torch.randn(300).double(), torch.randn(64).bfloat16(), torch.full((3,), float("nan")),
          torch.randn(2, 3).t(), torch.randn(40, dtype=torch.float16) * 1e4]
    stats, run = record_tensors(tmp_store, xs)
    for i, x in enumerate(xs):
        one, hist = inspect(x)
        row = stats.sel(layer=f"(root):{i}")
        for s in ("count", "nan", "posinf", "neginf", "min", "max", "zero_frac"):
            np.testing.assert_array_equal(row[s].item(), one[s], err_msg=f"{s} of tensor {i}")
        np.testing.assert_allclose([row[s].item() for s in ("mean", "std", "norm")],
                                   [one[s] for s in ("mean", "std", "norm")], rtol=1e-12)
        np.testing.assert_array_equal(run.histogram(f"(root):{i}", step=0).values, hist)


def test_integer_tensors_get_a_count_only(tmp_store):
    class Argmax(nn.Module):
        def forward(self, x):
            return x.argmax(-1)
    model = nn.Sequential(nn.Linear(4, 4), Argmax())
    with Recorder(model, tmp_store, layers="1", capture="activations", tensors_every=1, stats_every=1) as rec:
        with rec.step():
            model(torch.randn(3, 4))
    run = open_run(tmp_store)
    s = run.stats().isel(step=0, layer=0).compute()
    assert s["count"] == 3 and np.isnan(s["mean"]) and run.tensor("1", step=0).dtype == np.int64


def test_padding_is_never_counted_as_nan(tmp_store):
    run = open_run(record_shapes(tmp_store))
    ds = run.stats().compute()
    assert ds["nan"].values.sum() == 0 and ds["count"].values[:, 0].tolist() == [4 * 6 * 64, 2 * 3 * 64]
    assert run.first_nonfinite() is None


class Poisoned(nn.Module):
    """A two-layer net whose first layer emits NaN from a given step on."""
    def __init__(self, from_step):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.from_step, self.step = from_step, 0

    def forward(self, x):
        h = self.a(x)
        if self.step >= self.from_step:
            h = h.clone()
            h[0, 0] = float("nan")
        return self.b(h)


def _run_poisoned(store, ring=3, **kw):
    model = Poisoned(7)
    rec = Recorder(model, store, layers=["a", "b"], tensors_every=None, ring=ring, **{"stats_every": 1, **kw})
    with rec:
        for i in range(10):
            model.step = i
            with rec.step(i):
                model(torch.randn(2, 4)).sum().backward()
    return rec


def test_nan_from_step_7_is_located_and_the_ring_is_dumped(tmp_store):
    _run_poisoned(tmp_store, on_nonfinite="dump")
    run = open_run(tmp_store)
    first = run.first_nonfinite()
    # the Linear "a" itself is finite; its consumer "b" is the first to emit NaN
    assert (first.step, first.kind, first.layer) == (7, "activations", "b")
    assert first.nan > 0 and first.history["std"].sizes["step"] >= 2
    assert run.steps(tensors=True, layer="a").tolist() == [4, 5, 6, 7, 8, 9]
    assert all(e.step >= 7 for e in run.events)


class InfGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return y * torch.tensor([1.0, 1.0, 3e38])  # finite forward, overflowing backward


def test_inf_only_in_backward_is_a_gradients_event(tmp_store):
    model = InfGrad()
    with Recorder(model, tmp_store, layers="lin", tensors_every=1, stats_every=1) as rec:
        with rec.step():
            (model(torch.randn(2, 3)).sum() * 1e10).backward()
    ev = open_run(tmp_store).first_nonfinite()
    assert ev.kind == "gradients" and ev.layer == "lin" and ev.phase == "backward"
    assert ev.posinf + ev.neginf > 0 and ev.nan == 0


def test_raise_flushes_before_raising(tmp_store):
    with pytest.raises(NonFiniteError, match=r"step 7: activations of layer 'b'") as e:
        _run_poisoned(tmp_store, on_nonfinite="raise")
    assert isinstance(e.value, FloatingPointError)
    run = open_run(tmp_store)
    assert run.status == "interrupted"
    assert run.steps(tensors=True, layer="b").tolist() == [4, 5, 6, 7]
    assert run.steps().tolist() == list(range(8))


def test_nonfinite_between_stats_steps_is_still_an_event(tmp_store):
    _run_poisoned(tmp_store, ring=0, stats_every=4)
    run = open_run(tmp_store)
    assert run.steps().tolist() == [0, 4, 8]
    assert run.first_nonfinite().step == 7


def _poisoned(n, nan, posinf, neginf, seed):
    """``n`` values holding that many NaN, +Inf and -Inf, at random places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:nan] = float("nan")
    x[nan: nan + posinf] = float("inf")
    x[nan + posinf: nan + posinf + neginf] = -float("inf")
    return x[torch.randperm(n, generator=g)]


def test_every_event_holds_its_own_captures_nan_and_inf_counts(tmp_store):
    """Each capture's NaN, +Inf and -Inf counts, against plain counts of the tensor,
    in every form a capture takes: tiny tensors (summarised in the step's batch),
    large ones (an engine's own vector), integer ones (a count only, never an
    event), at a step without statistics (NaN/Inf counts only), over micro-batches."""
    model = Emit([])
    expected = set()
    with Recorder(model, tmp_store, layers="", capture="activations", tensors_every=None,
                  stats_every=2) as rec:
        for step in range(3):                      # steps 0 and 2 with statistics, 1 without
            with rec.step():
                for micro in range(2):
                    seed = 10 * step + micro
                    model.xs = [_poisoned(64, 1 + micro, 0, 2, seed), _poisoned(64, 0, 3, step, seed),
                                _poisoned(20000, 5, 7 + micro, 11, seed),
                                _poisoned(64, 0, 0, 0, seed), _poisoned(9000, 0, 0, 4, seed),
                                torch.arange(5)]
                    model()
                    for i, x in enumerate(model.xs):
                        if x.is_floating_point():
                            bad = (int(x.isnan().sum()), int((x == float("inf")).sum()),
                                   int((x == -float("inf")).sum()))
                            if any(bad):
                                expected.add((step, f"(root):{i}", micro, *bad))
    got = {(e.step, e.layer, e.micro, e.nan, e.posinf, e.neginf) for e in open_run(tmp_store).events}
    assert got == expected


def test_histogram_bins_are_identical_across_runs(tmp_path):
    bins = []
    for seed in (0, 1):
        model = transformer(seed)
        store = str(tmp_path / f"r{seed}.zarr")
        with Recorder(model, store, layers="layers.0.linear1", tensors_every=None, stats_every=1) as rec:
            with rec.step():
                model(torch.randn(2, 3, 32) * (seed + 1)).sum().backward()
        h = open_run(store).histogram("layers.0.linear1", step=0)
        bins.append((h.bin_lo.values, h.bin_hi.values))
    np.testing.assert_array_equal(bins[0][0], bins[1][0])
    np.testing.assert_array_equal(bins[0][1], bins[1][1])
    assert bins[0][0][0] == -np.inf and bins[0][1][-1] == np.inf
