"""Steps as a training loop has them: outside passes, pause, micro-batches, resumes."""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tensortape.analysis import open_run
from tensortape.recorder import InspectionError, Recorder, TensortapeWarning
from conftest import InplaceMLP, transformer


def _batch(i, n=4):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("policy", ["warn", "ignore"])
def test_forward_passes_outside_a_step_are_counted_not_recorded(tmp_store, policy):
    model = InplaceMLP()
    with Recorder(model, tmp_store, layers="fc*", outside_step=policy, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            model(_batch(0)).sum().backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.no_grad():                   # an evaluation loop
                for i in range(3):
                    model(_batch(10 + i))
        assert rec.outside_steps == 3
        warned = [w for w in seen if "outside a step" in str(w.message)]
        assert len(warned) == (1 if policy == "warn" else 0)      # once, not per pass
        with rec.step(1):
            model(_batch(1)).sum().backward()
    run = open_run(tmp_store)
    assert run.steps().tolist() == [0, 1] and run.attrs["outside_steps"] == 3
    assert run.tensor("fc1").sizes["step"] == 2
    np.testing.assert_array_equal(run.tensor("fc1", step=1).values,
                                  model.fc1(_batch(1)).detach().numpy())


def test_outside_step_raise_says_how_to_fix(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, outside_step="raise", tensors_every=1, stats_every=1) as rec:
        with pytest.raises(InspectionError, match=r"rec\.step\(\).*rec\.pause\(\)"):
            model(_batch(0))


def test_pause_records_nothing_inside_a_step_or_not(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, layers="fc1", outside_step="raise", tensors_every=1, stats_every=1) as rec:
        with rec.pause():
            model(_batch(0))                         # outside a step: no error, no count
        with rec.step(0):
            model(_batch(1)).sum().backward()
            with rec.pause():
                model(_batch(2)).sum().backward()    # inside the step: not a micro-batch
        assert rec.outside_steps == 0
    run = open_run(tmp_store)
    np.testing.assert_array_equal(run.tensor("fc1", step=0).values,
                                  model.fc1(_batch(1)).detach().numpy())
    with pytest.raises(ValueError, match="micro-batch 1"):
        run.tensor("fc1", step=0, micro=1)


def test_micro_batches_give_exact_step_statistics_and_every_tensor(tmp_path):
    """Four micro-batches of 3 rows equal, in statistics, one batch of 12 rows."""
    xs = [torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    layers = ["layers.0.linear1", "layers.1.self_attn"]
    micro_model, whole_model = transformer(), transformer()
    with Recorder(micro_model, str(tmp_path / "micro.zarr"), layers=layers, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            for x in xs:
                micro_model(x).pow(2).sum().backward()
    with Recorder(whole_model, str(tmp_path / "whole.zarr"), layers=layers, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            whole_model(torch.cat(xs)).pow(2).sum().backward()
    micro, whole = open_run(str(tmp_path / "micro.zarr")), open_run(str(tmp_path / "whole.zarr"))
    assert micro.layers == whole.layers == ["layers.0.linear1", "layers.1.self_attn:0"]
    for kind in ("activations", "gradients"):
        a, b = micro.stats(kind).compute(), whole.stats(kind).compute()
        for s in ("count", "nan", "zero_frac", "min", "max", "abs_max"):
            np.testing.assert_allclose(a[s].values, b[s].values, rtol=1e-6, err_msg=s)
        for s in ("mean", "std", "norm"):
            np.testing.assert_allclose(a[s].values, b[s].values, rtol=1e-4, err_msg=s)
        for layer in micro.layers:
            np.testing.assert_array_equal(micro.histogram(layer, kind, step=0).values,
                                          whole.histogram(layer, kind, step=0).values)
    whole_act = whole.tensor("layers.0.linear1", step=0).values
    for k in range(4):
        np.testing.assert_allclose(micro.tensor("layers.0.linear1", step=0, micro=k).values,
                                   whole_act[3 * k: 3 * k + 3], rtol=1e-5, atol=1e-6)


def test_events_carry_the_micro_batch(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, layers="fc1", tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            for k in range(3):
                x = _batch(k)
                if k == 2:
                    x[0, 0] = float("nan")
                model(x).sum().backward()
    first = open_run(tmp_store).first_nonfinite()
    assert (first.step, first.layer, first.micro, first.kind) == (0, "fc1", 2, "activations")


def test_repeated_step_numbers_explain_gradient_accumulation(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            model(_batch(0)).sum().backward()
        with pytest.raises(InspectionError, match="gradient accumulation.*micro-batch"):
            rec.step(0)


def test_a_resumed_job_rerecords_steps_and_readers_take_the_latest(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, layers="fc1", tensors_every=1, stats_every=1) as rec:
        for i in range(4):
            with rec.step(i):
                model(_batch(i)).sum().backward()
    with Recorder(model, tmp_store, layers="fc1", mode="a", tensors_every=1, stats_every=1) as rec:   # from a step-2 checkpoint
        for i in (2, 3, 4):
            with rec.step(i):
                model(_batch(100 + i)).sum().backward()
    run = open_run(tmp_store)
    assert run.steps().tolist() == [0, 1, 2, 3, 4]
    assert run.steps(tensors=True).tolist() == [0, 1, 2, 3, 4]
    want = model.fc1(_batch(102)).detach().numpy()
    np.testing.assert_array_equal(run.tensor("fc1", step=2).values, want)
    assert run.tensor("fc1").sizes["step"] == 5
    std = run.stats().sel(step=2, layer="fc1")["std"].compute().item()
    np.testing.assert_allclose(std, want.astype(np.float64).std(), rtol=1e-6)


def test_a_costly_default_warns_once_and_max_bytes_caps_full_tensors(tmp_path):
    wide = torch.nn.Linear(64, 4096)
    x = torch.randn(400, 64)                       # 6.6 MB an output, 13 MB a step with grads
    with pytest.warns(TensortapeWarning, match=r"GB every 100 steps.*tensors_every=.*max_bytes="):
        with Recorder(wide, str(tmp_path / "a.zarr"), tensors_every=1, stats_every=1) as rec:
            with rec.step(0):
                wide(x).sum().backward()
    row = 400 * 4096 * 4
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Recorder(wide, str(tmp_path / "b.zarr"), max_bytes=3 * row, tensors_every=1, stats_every=1) as rec:
            for i in range(4):
                with rec.step(i):
                    wide(x).sum().backward()
    said = [str(w.message) for w in seen if "max_bytes" in str(w.message)]
    assert len(said) == 2, said            # before the budget is reached, and when it is
    assert "every 100 steps: max_bytes=" in said[0] and "reached in about 1 step," in said[0]
    assert "reached at step 1" in said[1]
    run = open_run(str(tmp_path / "b.zarr"))
    assert run.steps().tolist() == [0, 1, 2, 3]                     # statistics go on
    assert run.steps(tensors=True, layer="(root)").tolist() == [0, 1]
    assert run.steps("gradients", tensors=True, layer="(root)").tolist() == [0]
    assert run.attrs["over_budget"] == 5


def test_metadata_takes_numpy_and_torch_scalars(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, metadata={"lr": np.float32(0.25), "n": np.int64(3),
                                              "t": torch.tensor(2.5)}, tensors_every=1, stats_every=1) as rec:
        with rec.step():
            model(_batch(0)).sum().backward()
    assert open_run(tmp_store).metadata == {"lr": 0.25, "n": 3, "t": 2.5}


def test_a_child_named_like_the_root_never_shares_its_table(tmp_store):
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("(root)", torch.nn.Linear(4, 4))

        def forward(self, x):
            return getattr(self, "(root)")(x) * 2
    model = Odd()
    x = torch.randn(2, 4)
    with Recorder(model, tmp_store, capture="activations", tensors_every=1, stats_every=1) as rec:
        with rec.step():
            model(x)
    run = open_run(tmp_store)
    assert run.layers == ["(root)", "(root)'"]
    child = getattr(model, "(root)")(x).detach().numpy()
    np.testing.assert_array_equal(run.tensor("(root)", step=0).values, child)
    np.testing.assert_array_equal(run.tensor("(root)'", step=0).values, child * 2)


def test_a_change_of_dtype_is_counted_never_silent(tmp_store):
    model = torch.nn.Linear(4, 4)
    with pytest.warns(TensortapeWarning, match="changed rank or dtype"):
        with Recorder(model, tmp_store, layers="", capture="activations", tensors_every=1, stats_every=1) as rec:
            for i in range(4):
                with rec.step(i), torch.autocast("cpu", dtype=torch.bfloat16, enabled=i >= 2):
                    model(torch.randn(2, 4))
    run = open_run(tmp_store)
    assert run.steps().tolist() == [0, 1, 2, 3]                  # statistics of every step
    assert run.steps(tensors=True).tolist() == [0, 1]
    assert run.dropped == 2
    assert run.attrs["drop_reasons"] == {"full tensor changed dtype or rank": 2}


def test_weights_are_captured_once_a_step_whatever_the_micro_batches(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, layers="fc1", capture=("weights", "activations"), tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            for k in range(3):
                model(_batch(k)).sum().backward()
    run = open_run(tmp_store)
    assert run.stats("weights").sel(layer="fc1:weight")["count"].values.tolist() == [16 * 8]
    assert run.stats().sel(layer="fc1")["count"].values.tolist() == [3 * 4 * 16]
    np.testing.assert_array_equal(run.tensor("fc1:weight", "weights", step=0).values,
                                  model.fc1.weight.detach().numpy())


@settings(max_examples=6, deadline=None)
@given(evals=st.integers(1, 2), mode=st.sampled_from(["no_grad", "inference_mode"]),
       poison=st.booleans(), stats_every=st.sampled_from([1, 2]))
def test_weight_gradients_outlive_the_evaluation_passes_before_training(tmp_path_factory, evals,
                                                                       mode, poison, stats_every):
    """A step that begins with evaluation passes (no grad) keeps its weight gradients:
    they are the step's, taken at its end, as ``.grad`` holds them (statistics at a
    step with them, a NaN/Inf event either way)."""
    store = str(tmp_path_factory.mktemp("wg") / "run.zarr")
    model = InplaceMLP()
    grads = {}
    with Recorder(model, store, layers="fc*", capture=("activations", "weight_grads"),
                  stats_every=stats_every, tensors_every=None) as rec:
        for step in range(2):
            with rec.step(step):
                for k in range(evals):
                    with getattr(torch, mode)():
                        model(_batch(100 + k))
                x = _batch(step)
                if poison and step == 1:
                    x[0, 0] = float("nan")
                model(x).sum().backward()
                grads[step] = {f"{n}:{p}": t.grad.clone() for n in ("fc1", "fc2")
                               for p, t in getattr(model, n).named_parameters()}
            model.zero_grad()
    run = open_run(store)
    ds = run.stats("weight_grads").compute()
    assert ds.step.values.tolist() == [s for s in (0, 1) if s % stats_every == 0]
    for step in ds.step.values.tolist():
        for name, g in grads[step].items():
            row = ds.sel(step=step, layer=name)
            finite = g[torch.isfinite(g)].double().numpy()
            assert row["count"].item() == g.numel()
            assert row["nan"].item() == int(torch.isnan(g).sum())
            np.testing.assert_allclose(row["norm"].item(), np.sqrt((finite ** 2).sum()), rtol=1e-9)
    want = sorted((1, name) for name, g in grads[1].items() if not torch.isfinite(g).all())
    got = sorted((e.step, e.layer) for e in run.events if e.kind == "weight_grads")
    assert got == want and (not poison or want)
    assert run.attrs["outside_steps"] == 2 * evals
