"""Store format 3, and the older formats it replaces.

The older stores are generated here, not committed: an MLP's layers 0 and 2 are
recorded for five steps of two micro-batches each (full tensors every second
step, a NaN fed at step 3), and ``old_format`` rewrites that store in the
layout formats 2 and 1 had, as the format-2 writer wrote it: an array per
statistic in chunks of 256 steps x 64 layers, unsharded int64 histograms in
chunks of 16 steps x 8 layers, and (format 1) no ``micro`` column.  What plain
forward hooks saw is the oracle.  The tests check that old stores still read
true, that ``tensortape migrate`` keeps every number, and that a format-3
rank's files grow with steps / 256, not with arrays x steps.
"""
import os
import shutil

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from torch import nn
from zarr.codecs import ZstdCodec

from tensortape.analysis import open_run
from tensortape.cli import cli
from oracle import STATS, histogram, statistics
from tensortape.recorder import ConfigError, Recorder
from tensortape.recorder import format as fmt
from tensortape.recorder.histogram import NBINS


def old_format(src: str, dst: str, version: int) -> str:
    """A copy of the format-3 store ``src`` in format ``version`` (2 or 1)."""
    shutil.copytree(src, dst)
    root = zarr.open_group(dst, mode="r+")

    def array(g, name, data, chunks, fill, dims):
        g.create_array(name, shape=data.shape, chunks=chunks, dtype=data.dtype, fill_value=fill,
                       dimension_names=dims, compressors=ZstdCodec(level=1), overwrite=True,
                       config={"write_empty_chunks": True})[...] = data
    for kind in root["rank0/stats"].group_keys():
        g = root[f"rank0/stats/{kind}"]
        packed, hist = g["stats"][...], g["hist"][...]
        del g["stats"]
        for j, s in enumerate(g.attrs["stats"]):
            array(g, s, packed[:, :, j], (256, 64), np.nan, ["step", "layer"])
        array(g, "hist", hist, (16, 8, NBINS), 0, ["step", "layer", "bin"])
    if version == 1:
        for kind in root["rank0/tensors"].group_keys():
            for node in root[f"rank0/tensors/{kind}"].group_keys():
                del root[f"rank0/tensors/{kind}/{node}/micro"]
    root.update_attributes({"tensortape_format": version})
    return dst


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The format-3 recording and what plain hooks saw: (layer, step) -> (micro, ...)."""
    path = str(tmp_path_factory.mktemp("old") / "run.zarr")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    seen, at = {}, {}
    for name in ("0", "2"):
        m.get_submodule(name).register_forward_hook(
            lambda mod, a, o, name=name: seen.setdefault((name, at["step"]), []).append(
                o.detach().numpy().copy()))
    with Recorder(m, path, layers=["0", "2"], tensors_every=2, stats_every=1) as rec:
        for step in range(5):
            at["step"] = step
            with rec.step(step):
                for k in range(2):                      # two micro-batches
                    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + k))
                    if step == 3 and k == 1:
                        x[0, 1] = float("nan")
                    m(x).sum().backward()
    return path, {k: np.stack(v) for k, v in seen.items()}


@pytest.fixture(params=[2, 1])
def old(recorded, tmp_path, request):
    """(the old store, the hooks' tensors)."""
    path, seen = recorded
    return old_format(path, str(tmp_path / f"format{request.param}.zarr"), request.param), seen


def same(got, want):
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300)


def check_against_hooks(run, seen, micro=True):
    """The statistics, histograms, full tensors and events of the old recording
    against the plain hooks' tensors (``micro``: its tables have a micro column)."""
    assert run.layers == ["0", "2"]
    ds = run.stats().compute()
    for (layer, step), parts in seen.items():
        step = str(step)
        want = statistics([torch.from_numpy(p) for p in parts])
        for s in STATS:
            same(float(ds[s].sel(step=int(step), layer=layer)), want[s])
        np.testing.assert_array_equal(
            run.histogram(layer, step=int(step)).values,
            histogram(np.concatenate([p.reshape(-1) for p in parts]).astype(np.float64)))
        if int(step) % 2 == 0 and not micro:
            # format 1 has no micro column: every row is micro-batch 0, the last one read
            np.testing.assert_array_equal(run.tensor(layer, step=int(step)).values, parts[-1])
        elif int(step) % 2 == 0:
            for k, part in enumerate(parts):
                np.testing.assert_array_equal(run.tensor(layer, step=int(step), micro=k).values,
                                              part)
    first = run.first_nonfinite()
    assert (first.step, first.layer, first.kind, first.micro) == (3, "0", "activations", 1)


def test_an_old_store_still_reads_true(old):
    path, seen = old
    run = open_run(path)
    assert run.attrs["tensortape_format"] in (1, 2)
    assert not os.path.exists(os.path.join(path, "rank0/stats/activations/stats"))
    check_against_hooks(run, seen, micro=run.attrs["tensortape_format"] == 2)


def test_migrate_keeps_every_number_and_the_old_store(tmp_path, old):
    OLD, seen = old
    before = sorted(os.path.relpath(os.path.join(d, f), OLD)
                    for d, _, files in os.walk(OLD) for f in files)
    new = str(tmp_path / "new.zarr")
    out = CliRunner().invoke(cli, ["migrate", OLD, new])
    assert out.exit_code == 0, out.output
    old_run, run = open_run(OLD), open_run(new)
    assert run.attrs["tensortape_format"] == fmt.FORMAT_VERSION == 3
    assert os.path.exists(os.path.join(new, "rank0/stats/activations/stats/zarr.json"))
    check_against_hooks(run, seen, micro=old_run.attrs["tensortape_format"] == 2)
    for kind in old_run.kinds:
        assert run.stats(kind).compute().identical(old_run.stats(kind).compute())
        for layer in old_run.layers:
            assert run.histogram(layer, kind).compute().identical(
                old_run.histogram(layer, kind).compute())
    assert run.events == old_run.events
    assert sorted(os.path.relpath(os.path.join(d, f), OLD)
                  for d, _, files in os.walk(OLD) for f in files) == before
    # NEW must not exist: migrate writes over nothing
    again = CliRunner().invoke(cli, ["migrate", OLD, new])
    assert again.exit_code == 2 and "exists" in again.output


def array_metadata(path):
    """Each array's ``zarr.json`` under ``path`` (chunks, shards, codecs, fill value,
    dimension names, attributes, shape) and each table group's attributes, by path."""
    import json
    out = {}
    for d, _, files in os.walk(path):
        rel = os.path.relpath(d, path)
        if "zarr.json" in files and rel.split(os.sep)[1:2] in (["stats"], ["tensors"]):
            with open(os.path.join(d, "zarr.json")) as f:
                meta = json.load(f)
            out[rel] = meta if meta["node_type"] == "array" else meta.get("attributes")
    return out


def test_migrate_lays_out_a_store_as_the_recorder_does(tmp_path, old, recorded):
    """The copy of an old store has the arrays a recording makes (the layout has one
    writer): every array's chunks, shards, codecs, fill value and attributes, and
    every table's attributes, those of the format-3 recording the old store was made of."""
    OLD, _ = old
    new = str(tmp_path / "new.zarr")
    out = CliRunner().invoke(cli, ["migrate", OLD, new])
    assert out.exit_code == 0, out.output
    want = array_metadata(recorded[0])
    assert any(k.endswith("/data") for k in want) and any(k.endswith("/hist") for k in want)
    assert array_metadata(new) == want


def test_appending_needs_the_current_format(tmp_path, old):
    old, _ = old
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match="tensortape migrate"):
        Recorder(m, old, layers=["0", "2"], mode="a", tensors_every=1, stats_every=1).attach()
    new = str(tmp_path / "new.zarr")
    CliRunner().invoke(cli, ["migrate", old, new])
    with Recorder(m, new, layers=["0", "2"], mode="a", tensors_every=1, stats_every=1) as rec:
        with rec.step():
            m(torch.ones(3, 4)).sum().backward()
    run = open_run(new)
    assert run.steps().tolist() == [0, 1, 2, 3, 4, 5]
    same(float(run.stats().sel(step=5, layer="2")["mean"]),
         float(m(torch.ones(3, 4)).detach().double().mean()))


def files_under(path):
    return sum(len(files) for _, _, files in os.walk(path))


def test_a_ranks_files_grow_with_steps_over_256_not_with_arrays(tmp_path):
    layers, steps = 40, 1100
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    with Recorder(m, str(tmp_path / "run.zarr"), layers=[str(i) for i in range(layers)],
                  tensors_every=None, flush_interval=0.2, stats_every=1) as rec:
        x = torch.randn(2, 4)
        for i in range(steps):
            with rec.step(i):
                m(x).sum().backward()
    run = open_run(str(tmp_path / "run.zarr"))
    assert run.steps().tolist() == list(range(steps))
    for kind in ("activations", "gradients"):
        group = tmp_path / "run.zarr" / "rank0" / "stats" / kind
        # zarr.json of the group and its 5 arrays; bin_lo, bin_hi: a chunk each; step: 2
        # chunks of 1024; stats: 2 shards of 1024 steps x 256 layers; hist: 5 shards of 256
        # steps x 256 layers (format 2: 11 x 5 + 69 x 5 + 5 for the same); the summary
        # pyramid: 2 arrays, 17 grains of 64 steps in 1 shard, 137 of 8 in 2 (128 a shard)
        assert files_under(group) == 6 + 2 + 2 + 2 + 5 + (2 + 1 + 2), sorted(
            os.path.relpath(os.path.join(d, f), group) for d, _, fs in os.walk(group) for f in fs)
    ds = run.stats("gradients").compute()
    assert ds.sizes == {"step": steps, "layer": layers}
    assert (ds["count"] == 8).all()


def test_a_shard_replaced_while_it_is_read_is_read_again(tmp_path, monkeypatch):
    """A live run: a reader takes a shard's index, the writer replaces the shard, the
    reader takes chunks at the old offsets.  The chunks' checksums catch it and the
    read is made again (here the first chunk read returns the wrong bytes)."""
    import zarr

    from tensortape.analysis import _source
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    path = str(tmp_path / "run.zarr")
    real, spoiled = zarr.storage.LocalStore.get, []

    async def get(self, key, prototype=None, byte_range=None):
        got = await real(self, key, prototype, byte_range)
        if "/stats/c/" in key and byte_range is not None and not spoiled and got is not None:
            spoiled.append(key)                # the bytes of another shard at these offsets
            raw = bytes(got.to_bytes())
            return got.from_bytes(bytes(b ^ 0x5A for b in raw))
        return got
    with Recorder(m, path, tensors_every=None, stats_every=1) as rec:      # read while the run is live
        for i in range(5):
            with rec.step(i):
                m(torch.randn(3, 4)).sum().backward()
        rec.flush()
        want = open_run(path).stats().compute()
        with monkeypatch.context() as patch:
            patch.setattr(zarr.storage.LocalStore, "get", get)
            got = open_run(path).stats().compute()
            assert spoiled and got.identical(want)
            spoiled.clear()
            patch.setattr(_source, "RETRIES", 0)             # without reading again: the read
            got = open_run(path).stats().compute()            # made a stored chunk at a time
            assert len(spoiled) == 1 and got.identical(want)
    # a finished run's shards are never replaced: no pause, the read made a chunk at a time
    spoiled.clear()
    monkeypatch.setattr(zarr.storage.LocalStore, "get", get)
    monkeypatch.setattr(_source.time, "sleep", lambda s: pytest.fail("a finished run waited"))
    assert open_run(path).stats().compute().identical(want)
    assert len(spoiled) == 1
