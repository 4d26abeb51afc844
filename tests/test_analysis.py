"""Post-mortems, comparison, plots, HDF5 and the Inspector, on recorded runs."""
import numpy as np
import pytest
import torch
from torch import nn

from analysis import Inspector, compare_runs, first_divergence, open_run, plot_comparison
from recorder import LayerNotFoundError, Recorder, RecorderError
from conftest import has_hooks, transformer


def _record(store, seed=0, perturb_at=None, nan_at=None, steps=5, **kw):
    model = transformer(seed=0)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, store, layers=["layers.*.linear*", "layers.*.norm2"], **kw) as rec:
        for i in range(steps):
            if i == perturb_at:
                with torch.no_grad():
                    model.layers[1].linear1.weight[0, 0] += 0.5
            if i == nan_at:
                with torch.no_grad():
                    model.layers[0].linear2.bias[0] = float("nan")
            x = torch.randn(2, 4, 32, generator=gen)
            with rec.step(i):
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return store


def test_injected_nan_is_found_first(tmp_path):
    run = open_run(_record(str(tmp_path / "a.zarr"), nan_at=3, tensors_every=None))
    first = run.first_nonfinite()
    assert (first.step, first.layer, first.kind) == (3, "layers.0.linear2", "activations")
    assert any(e.layer == "layers.1.linear1" for e in first.same_step)
    assert list(first.history.step.values) == [0, 1, 2, 3]


def test_identical_runs_do_not_diverge(tmp_path):
    a = _record(str(tmp_path / "a.zarr"))
    b = _record(str(tmp_path / "b.zarr"))
    assert first_divergence(a, b) is None
    seen = []
    ds = compare_runs(a, b, progress=lambda layers: (seen.append(n) or n for n in layers))
    assert float(ds["rel_l2"].max()) == 0 and float(abs(ds["delta_mean"]).max()) == 0
    assert sorted(seen) == sorted(ds.layer.values.tolist())   # the scan reports each layer once


@pytest.mark.parametrize("tensors_every", [1, None])
def test_perturbed_weight_diverges_at_that_step_and_layer(tmp_path, tensors_every):
    a = _record(str(tmp_path / "a.zarr"), tensors_every=tensors_every)
    b = _record(str(tmp_path / "b.zarr"), perturb_at=3, tensors_every=tensors_every)
    assert first_divergence(a, b) == (3, "layers.1.linear1")
    ds = compare_runs(a, b)
    key = "rel_l2" if tensors_every else "delta_std"
    assert float(abs(ds[key].sel(step=2)).max()) == 0
    assert float(abs(ds[key].sel(step=3, layer="layers.1.linear1"))) > 0
    assert float(abs(ds[key].sel(step=3, layer="layers.0.linear1"))) == 0


def test_hdf5_round_trip_is_equal(tmp_path):
    src = open_run(_record(str(tmp_path / "a.zarr"), nan_at=4))
    h5 = open_run(src.to_hdf5(str(tmp_path / "a.h5")))
    assert h5.layers == src.layers and h5.kinds == src.kinds and h5.events == src.events
    for kind in src.kinds:
        assert src.stats(kind).compute().identical(h5.stats(kind).compute())
        np.testing.assert_array_equal(src.histogram("layers.0.linear1", kind).values,
                                      h5.histogram("layers.0.linear1", kind).values)
    np.testing.assert_array_equal(src.tensor("layers.1.linear2", "gradients").values,
                                  h5.tensor("layers.1.linear2", "gradients").values)
    assert h5.first_nonfinite() == src.first_nonfinite()


def test_plots_render_to_png(tmp_path):
    a = open_run(_record(str(tmp_path / "a.zarr"), nan_at=4))
    b = _record(str(tmp_path / "b.zarr"), perturb_at=2)
    figs = [a.plot_histogram("layers.0.linear1", steps=[0, 4]),
            a.plot_evolution(kind="gradients", stat="norm"),
            a.plot_distribution("layers.1.linear2"),
            plot_comparison(a, b, "layers.1.linear1")]
    for i, fig in enumerate(figs):
        out = tmp_path / f"p{i}.png"
        fig.savefig(out)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert "layers.0.linear1" in a._repr_html_() and "status=complete" in repr(a)


def test_open_run_refuses_what_is_not_a_store(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(RecorderError, match="not a"):
        open_run(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="no run"):
        open_run(tmp_path / "missing")
    (tmp_path / "f.txt").write_text("hello")
    with pytest.raises(RecorderError, match="neither"):
        open_run(tmp_path / "f.txt")


def test_inspector_covers_forward_and_backward_and_leaves_no_hooks():
    model = transformer()
    insp = Inspector(model)
    insp.watch("layers.*.linear*", what=("activations", "gradients"))
    x = torch.randn(2, 3, 32)
    out = insp.run_inspection(x, target=torch.zeros(2, 3, 32), loss_fn=nn.functional.mse_loss)
    assert not has_hooks(model)
    act = insp.captured_data[("layers.0.linear1", "activations")]
    assert act.device.type == "cpu" and act.shape == (2, 3, 64)
    grad = insp.captured_data[("layers.1.linear2", "gradients")]
    s = insp.get_statistics("layers.1.linear2", what="gradients")
    np.testing.assert_allclose(s["std"], grad.double().std(unbiased=False).item(), rtol=1e-6)
    assert s["count"] == grad.numel() and out.shape == x.shape
    insp.plot_histogram("layers.0.linear1", what="gradients")
    with pytest.raises(LayerNotFoundError):
        insp.watch("nope*")
    with pytest.raises(LayerNotFoundError):
        insp.get_statistics("layers.9.linear1")
