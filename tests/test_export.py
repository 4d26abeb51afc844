"""The HDF5 export (`tensortape export RUN OUT.h5`, `run.to_hdf5`): what a user reads from
it, through open_run, h5py or xarray (or from the Zarr run `tensortape migrate` makes of it),
is what the Zarr run holds and what the test logged.

Names are read as docs/REFERENCE.md tells an h5py or xarray user to read them (``decode``)."""
import json
import os
import tempfile

import h5py
import numpy as np
import pytest
import torch
import xarray as xr
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from tensortape import Recorder, cli, open_run

pytest.importorskip("h5netcdf")


def decode(text: str) -> str:
    """A name as the export stores it, read back (docs/REFERENCE.md)."""
    return json.loads(text) if text.startswith('"') else text


def export(store, out) -> str:
    r = CliRunner().invoke(cli.cli, ["export", store, out])
    assert r.exit_code == 0, r.output
    return out


def same_run(h5, zarr):
    """open_run on the export gives what it gives on the Zarr run."""
    a, b = open_run(h5), open_run(zarr)
    assert a.layers == b.layers and a.kinds == b.kinds and a.events == b.events
    assert a.scalars().identical(b.scalars())
    for kind in b.kinds:
        assert a.stats(kind).compute().identical(b.stats(kind).compute())
    return a, b


def test_a_run_that_logged_scalars_exports_them(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    store, logged = str(tmp_path / "run.zarr"), {}
    with Recorder(m, store, max_bytes=None, tensors_every=2, stats_every=1) as rec:
        for i in range(5):
            with rec.step(i):
                loss = m(torch.randn(3, 4)).pow(2).mean()
                loss.backward()
                loss = loss.detach()
                values = {"loss": loss} if i % 2 else {"loss": loss, "lr": 0.5 ** i}
                rec.log(values)
                logged.update({(i, k): float(v) for k, v in values.items()})
    h5 = export(store, str(tmp_path / "run.h5"))
    back, _ = same_run(h5, store)
    ds = back.scalars()
    assert {(s, n): v for n in ds.data_vars for s, v in zip(ds.step.values.tolist(),
                                                            ds[n].values.tolist())
            if not np.isnan(v)} == logged
    np.testing.assert_array_equal(back.tensor("0", step=2).values,
                                  open_run(store).tensor("0", step=2).values)
    # a reader without tensortape: xarray, a row per (step, name), the names as data
    g = xr.open_dataset(h5, engine="h5netcdf", group="rank0/scalars")
    names = [decode(t) for t in g.scalar.values.tolist()]
    assert {(s, names[n]): v for s, n, v in zip(g.step.values.tolist(), g.name.values.tolist(),
                                                g.value.values.tolist())} == logged
    assert g.value.dims == ("row",) and "long_name" in g.value.attrs
    g.close()
    with h5py.File(h5) as f:
        assert [d.label for d in f["rank0/scalars/value"].dims] == ["row"]
    # and a Zarr run again (tensortape migrate), the scalars with it
    again = str(tmp_path / "again.zarr")
    assert CliRunner().invoke(cli.cli, ["migrate", h5, again]).exit_code == 0
    same_run(again, store)


class Nothing(nn.Module):
    """An empty selection: no features of each sample (a layer's output with a
    dimension of size 0 at every step)."""

    def forward(self, x):
        return x[:, :0]


def test_full_tensors_with_an_empty_dimension_export(tmp_path):
    """Full tensors whose every step has a dimension of size 0 export as the run holds
    them (h5py refused chunks larger than an array with an empty dimension)."""
    m = nn.Sequential(nn.Linear(2, 3), Nothing())
    store = str(tmp_path / "run.zarr")
    with Recorder(m, store, tensors_every=1, max_bytes=None, capture=("activations",), stats_every=1) as rec:
        for i in range(2):
            with rec.step(i):
                m(torch.ones(i + 1, 2))
    back, zarr = same_run(export(store, str(tmp_path / "run.h5")), store)
    for s in (0, 1):
        assert back.tensor("1", step=s).shape == (s + 1, 0)
        np.testing.assert_array_equal(back.tensor("0", step=s).values,
                                      zarr.tensor("0", step=s).values)
    with h5py.File(str(tmp_path / "run.h5")) as f:
        assert f["rank0/tensors/activations/1/data"].shape == (2, 2, 0)


# names from any Unicode text (NUL, "/", lone surrogates included); "." makes a module
# path, and nn.Module refuses an empty name or one of its attributes
names = st.text(st.characters(exclude_categories=()), min_size=1, max_size=6).filter(
    lambda n: "." not in n and not hasattr(nn.Sequential(), n))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.lists(names, min_size=1, max_size=3, unique=True),
       scalar=st.text(st.characters(exclude_categories=()), min_size=1, max_size=6))
@example(layers=["a\x00b/c", "\ud800", '"q"\\'], scalar="l\x00\udfff")
@example(layers=["\ud83d\ude00", "\U0001f600x"], scalar="\ud83d\ude00")
def test_any_name_the_store_holds_reads_back_equal_from_the_export(layers, scalar):
    m = nn.Sequential()
    for n in layers:
        m.add_module(n, nn.Linear(2, 2))
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "run.zarr")
        with Recorder(m, store, tensors_every=1, max_bytes=None, capture=("activations",), stats_every=1) as rec:
            with rec.step(0):
                out = m(torch.ones(1, 2))
                rec.log({scalar: 1.5})
        zarr = open_run(store)
        want = [json.loads(json.dumps(n)) for n in layers]     # the store's JSON reads a
        assert zarr.layers == [*want, "(root)"]                 # surrogate pair as one character
        h5 = export(store, os.path.join(tmp, "run.h5"))
        back, _ = same_run(h5, store)
        np.testing.assert_array_equal(back.tensor(back.layers[-2], step=0).values,
                                      out.detach().numpy())
        root = xr.open_dataset(h5, engine="h5netcdf")
        stats = xr.open_dataset(h5, engine="h5netcdf", group="rank0/stats/activations")
        scalars = xr.open_dataset(h5, engine="h5netcdf", group="rank0/scalars")
        assert [decode(t) for t in root.layer.values.tolist()] == zarr.layers
        assert [decode(t) for t in stats.layer.values.tolist()] == zarr.layers
        # the names as logged (run.scalars() adds a ' to a coordinate's name, step or rank)
        assert [decode(t) for t in scalars.scalar.values.tolist()] == [json.loads(json.dumps(scalar))]
        for ds in (root, stats, scalars):
            ds.close()
        with h5py.File(h5) as f:
            tensors = f["rank0/tensors/activations"]
            assert sorted(decode(g.attrs["layer"]) for g in tensors.values()) == sorted(zarr.layers)
            assert [decode(t) for t in f["layer"].asstr()[()]] == zarr.layers
