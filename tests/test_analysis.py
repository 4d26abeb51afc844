"""Post-mortems, comparison, plots, HDF5 and the Inspector, on recorded runs."""
import os
import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import Inspector, compare_runs, first_divergence, open_run, plot_comparison
from tensortape.recorder import LayerNotFoundError, Recorder, RecorderError
from conftest import has_hooks, record_shapes, transformer


def _record(store, seed=0, perturb_at=None, nan_at=None, steps=5, **kw):
    model = transformer(seed=0)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, store, layers=["layers.*.linear*", "layers.*.norm2"],
                  **{"stats_every": 1, "tensors_every": 1, **kw}) as rec:
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
    (tmp_path / "empty").mkdir()                 # where a run may begin: none yet
    with pytest.raises(FileNotFoundError, match="no run at .* yet: the folder is empty"):
        open_run(tmp_path / "empty")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
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


# xarray writes the string coordinates (layer names) as a dtype Zarr v3 has no spec for yet
@pytest.mark.filterwarnings("ignore::zarr.errors.UnstableSpecificationWarning")
def test_tensors_and_statistics_round_trip_through_zarr_and_netcdf(tmp_path):
    import xarray as xr
    run = open_run(record_shapes(str(tmp_path / "a.zarr")))
    tensor = run.tensor("layers.0.linear1").compute()
    assert tensor["extent_dim_0"].values.tolist() == [4, 2]
    assert tensor["extent_dim_1"].values.tolist() == [6, 3]
    for obj in (tensor, run.stats().compute(), run.histogram("layers.0.linear1").compute()):
        ds = obj.to_dataset(name="x") if isinstance(obj, xr.DataArray) else obj
        ds.to_zarr(str(tmp_path / "out.zarr"), mode="w", consolidated=False)  # not in Zarr v3's spec
        ds.to_netcdf(str(tmp_path / "out.nc"))
        for back in (xr.open_zarr(str(tmp_path / "out.zarr"), consolidated=False).compute(),
                     xr.open_dataset(str(tmp_path / "out.nc")).compute()):
            xr.testing.assert_identical(back.drop_attrs() if hasattr(back, "drop_attrs") else back,
                                        ds.drop_attrs() if hasattr(ds, "drop_attrs") else ds)


def test_histograms_plot_against_bin_centres(tmp_path):
    run = open_run(_record(str(tmp_path / "a.zarr"), tensors_every=None))
    h = run.histogram("layers.0.linear1", step=2).compute()
    assert np.all(h.bin_lo.values <= h.bin.values) and np.all(h.bin.values <= h.bin_hi.values)
    line = h.plot()[0]
    np.testing.assert_array_equal(line.get_xdata(), h.bin.values)


def test_distribution_spans_the_true_range_and_shows_nonfinite_counts(tmp_path):
    run = open_run(_record(str(tmp_path / "a.zarr"), nan_at=3, tensors_every=None))
    h = run.histogram("layers.0.linear2").compute()
    st = run.stats("activations", ["layers.0.linear2"]).isel(layer=0).compute()
    fig = run.plot_distribution("layers.0.linear2")
    heat = fig.axes[0]
    strip = next(ax for ax in fig.axes if ax.get_ylabel() == "NaN/Inf")
    true_lo, true_hi = float(st["min"].min()), float(st["max"].max())
    lo, hi = heat.get_ylim()                 # the true range, and only that (2% margin)
    span = true_hi - true_lo
    assert lo <= true_lo and hi >= true_hi
    assert true_lo - lo <= 0.03 * span and hi - true_hi <= 0.03 * span
    band = heat.collections[0].get_paths()[0].vertices[:, 1]          # the min-max band
    assert np.isclose(band.min(), true_lo) and np.isclose(band.max(), true_hi)
    bars = [p.get_height() for p in strip.patches]
    bad = (h.nan + h.posinf + h.neginf).values
    assert bars == bad.tolist() and bad[3] > 0 and bad[:3].sum() == 0


def test_evolution_marks_each_layers_nonfinite_steps_and_breaks_its_line_there(tmp_path):
    run = open_run(_record(str(tmp_path / "a.zarr"), nan_at=3, steps=6, tensors_every=None))
    fig = run.plot_evolution(kind="activations", stat="abs_max")
    ax = fig.axes[0]
    ds = run.stats("activations").compute()
    assert "a.zarr" in ax.get_title()                                     # the run is named
    bad = (ds.nan + ds.posinf + ds.neginf)
    lines = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_linestyle() == "-"}
    marks = [ln for a in fig.axes for ln in a.get_lines() if ln.get_marker() == "|"]  # the strip
    for i, layer in enumerate(ds.layer.values):
        steps = ds.step.values[bad.isel(layer=i).values > 0]
        label = next(k for k in lines if k.startswith(str(layer)[:20]) or str(layer) in k)
        if steps.size:
            assert f"NaN/Inf from step {steps[0]} ({int(bad.isel(layer=i)[steps[0]]):,} values" \
                in label
            mark = next(m for m in marks if m.get_color() == lines[label].get_color())
            assert mark.get_xdata().tolist() == steps.tolist()
            assert np.isnan(lines[label].get_ydata()[steps[0]])   # no finite-only value drawn
    assert int(bad.sum()) > 0
    assert ax.get_xlim() == (0, 5)                                        # the whole run
    drawn = ds.abs_max.values[(bad == 0).values]                  # a log axis over decades only
    assert ax.get_yscale() == ("log" if drawn.max() > 10 * drawn.min() else "linear")


def test_histogram_defaults_to_the_last_step_with_finite_values(tmp_path):
    model = nn.Linear(4, 4)
    store = str(tmp_path / "h.zarr")
    with Recorder(model, store, layers="", capture="activations", tensors_every=1, stats_every=1) as rec:
        for i in range(4):
            with rec.step(i):
                model(torch.full((2, 4), float("nan")) if i == 3 else torch.randn(2, 4))
    fig = open_run(store).plot_histogram("(root)")
    assert fig.axes[0].get_legend().get_texts()[0].get_text().startswith("step 2 ")


def test_comparison_marks_the_first_divergence_on_a_layer_by_step_map(tmp_path):
    a = _record(str(tmp_path / "a.zarr"), tensors_every=None)
    b = _record(str(tmp_path / "b.zarr"), perturb_at=3, tensors_every=None)
    fig = plot_comparison(a, b, "layers.1.linear1")
    heat = fig.axes[0]
    lines = next(ax for ax in fig.axes if ax.get_xlabel() == "step" and ax.get_legend()
                 and ax is not heat)
    marker = next(line for line in heat.get_lines() if line.get_marker() == "o")
    layers = [t.get_text() for t in heat.get_yticklabels()]
    assert marker.get_xdata()[0] == 3 and layers[int(marker.get_ydata()[0])] == "layers.1.linear1"
    assert [t.get_text() for t in lines.get_legend().get_texts()] == ["a.zarr", "b.zarr"]


def test_a_dask_distributed_cluster_gives_the_local_answers(tmp_path):
    """Worker processes unpickle what ``open_run`` puts in a dask graph and reopen
    the store themselves: a full-tensor reduction, statistics and the post-mortem
    give the local scheduler's answers, for a Zarr store and its HDF5 export."""
    distributed = pytest.importorskip("distributed")
    import dask
    src = _record(str(tmp_path / "a.zarr"), nan_at=3)
    h5 = open_run(src).to_hdf5(str(tmp_path / "a.h5"))

    def answers(path):
        run = open_run(path)
        t = run.tensor("layers.1.linear1", "gradients")
        first = run.first_nonfinite()
        return (float(abs(t).max().compute()), float(t.sum().compute()),
                run.stats("gradients")["norm"].sum().compute().item(),
                (first.step, first.layer, first.kind), first.history["std"].values.tolist())

    with dask.config.set(scheduler="threads"):
        local = [answers(p) for p in (src, h5)]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster):
        remote = [answers(p) for p in (src, h5)]
    assert remote == local
    assert local[0][3] == (3, "layers.0.linear2", "activations")


def _chain(store, scale_from=None, steps=130):
    """Four Linear layers, a full tensor of each (and of the root) at every step (64
    steps to a chunk: three chunks a layer); from ``scale_from`` on, the input is 1% larger."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad(), Recorder(model, store, capture="activations", tensors_every=1, stats_every=1) as rec:
        for i in range(steps):
            x = torch.randn(3, 8, generator=gen)
            with rec.step(i):
                model(x * 1.01 if scale_from is not None and i >= scale_from else x)
    return store


def test_two_runs_are_compared_reading_each_chunk_once(tmp_path, monkeypatch):
    """compare_runs and first_divergence read each chunk of full tensors from disk
    once (counted at the store: zarr's LocalStore.get), not once a step, and
    compare_runs each chunk of a tensor table's key columns once (counted at the store
    and at the reader's own chunk-file reads, ``os.open``); and
    first_divergence reads no chunk past the step where the runs part."""
    import collections
    import zarr
    a, b = _chain(str(tmp_path / "a.zarr")), _chain(str(tmp_path / "b.zarr"), scale_from=100)
    reads, tables = collections.Counter(), collections.Counter()
    get = zarr.storage.LocalStore.get

    async def counted(self, key, *args, **kw):
        if "/tensors/" in key and "/data/c/" in key:
            reads[(str(self.root), key)] += 1
        if "/tensors/" in key and "/c/" in key:        # a table's key columns too
            tables[(str(self.root), key)] += 1
        return await get(self, key, *args, **kw)
    monkeypatch.setattr(zarr.storage.LocalStore, "get", counted)
    roots = [str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")]
    real_open = os.open

    def opened(path, *args, **kw):                   # the reader's own chunk-file reads
        p = str(path)
        for root in roots:
            key = p[len(root) + 1:]
            if p.startswith(root + "/") and "/tensors/" in key and "/data/c/" in key:
                reads[(root, key)] += 1
            if p.startswith(root + "/") and "/tensors/" in key and "/c/" in key:
                tables[(root, key)] += 1
        return real_open(path, *args, **kw)
    monkeypatch.setattr(os, "open", opened)
    stored = {(str(root), str(f.relative_to(root))) for root in (tmp_path / "a.zarr", tmp_path / "b.zarr")
              for f in root.glob("rank0/tensors/activations/*/data/c/*/*/*")}
    assert len(stored) == 2 * 5 * 3            # 4 layers and the root, 3 chunks each
    ds = compare_runs(a, b)
    assert set(reads) == stored and set(reads.values()) == {1}, reads   # every chunk, once
    assert set(tables.values()) == {1}, tables      # each table checked once, not once a part
    assert float(ds["rel_l2"].sel(step=99).max()) == 0 and float(ds["rel_l2"].sel(step=100).min()) > 0
    reads.clear()
    assert first_divergence(a, b) == (100, "0")
    assert set(reads.values()) == {1}, reads
    assert {k.rsplit("/c/", 1)[1].split("/")[0] for _, k in reads} == {"0", "1"}   # not rows 128-
