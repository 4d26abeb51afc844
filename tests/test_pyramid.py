"""The stats tables' summary pyramid: written at record time, committed with the rows,
and read by the browser view's map, which answers the same with it or without it.

The oracle is numpy over ``open_run(...).stats()``: a map column is the largest
finite value of its steps (NaN where none) and non-finite when any step is.
Stores are recorded through ``Recorder`` on a small model: a layer that skips
steps, a NaN and an Inf at random steps, partial last grains (the pyramid's
grains are 64 and 8 rows), resumed recordings with and without steps recorded
again, a store cut as a SIGKILL leaves it, and a store without a pyramid (as
tensortape wrote before it had one)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATS = ("abs_max", "std", "norm", "rms", "nonfinite")
TABLE = "rank0/stats/activations"


class Net(nn.Module):
    """Three layers; ``b`` runs only when ``skip`` is false."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.skip = False

    def forward(self, x):
        h = self.a(x)
        if not self.skip:
            h = self.b(torch.relu(h))
        return self.c(torch.relu(h))


def record(path, steps, mode="w-", nan_step=None, inf_step=None, spike=None, seed=1):
    """Statistics of ``steps`` (an iterable); ``b`` skips every step = 2 (mod 5)."""
    model = Net()
    data = torch.Generator().manual_seed(seed)
    with Recorder(model, path, tensors_every=None, capture=("activations",), mode=mode, stats_every=1) as rec:
        for step in steps:
            x = torch.randn(3, 4, generator=data)
            x = x * 1e4 if step == spike else x
            if step == nan_step:
                x[0, 0] = float("nan")
            if step == inf_step:
                x[1, 1] = float("inf")
            model.skip = step % 5 == 2
            with rec.step(step), torch.no_grad():
                model(x)
    return path


def without_pyramid(path, copy):
    """``path`` copied as tensortape wrote it before pyramids: no levels, no state entry."""
    shutil.copytree(path, copy)
    g = zarr.open_group(copy, mode="r+")
    for name in list(g[TABLE].array_keys()):
        if name.startswith("pyramid"):
            del g[TABLE][name]
    attrs = dict(g["rank0"].attrs)
    attrs.pop("pyramid")
    g["rank0"].attrs.put(attrs)
    return copy


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("pyramid")
    rng = np.random.default_rng(7)
    nan_step, inf_step, spike = (int(s) for s in rng.choice(357, 3, replace=False))
    out = {"plain": record(str(base / "plain.zarr"), range(357), nan_step=nan_step,
                           inf_step=inf_step, spike=spike)}
    # resumed at its last step + 1: the partial grains (203 = 3 x 64 + 11 = 25 x 8 + 3)
    # are folded again from the stored rows
    out["resumed"] = record(str(base / "resumed.zarr"), range(203), nan_step=100)
    record(out["resumed"], range(203, 400), mode="a", spike=230, seed=2)
    # resumed from an earlier checkpoint: steps 150..199 recorded again
    out["again"] = record(str(base / "again.zarr"), range(200), spike=170)
    record(out["again"], range(150, 420), mode="a", nan_step=300, seed=3)
    out["old"] = without_pyramid(out["plain"], str(base / "old.zarr"))
    return out


class Server:
    def __init__(self, path):
        from tensortape.analysis.browser._serve import make_server
        self.server = make_server([path], "127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def map(self, **query):
        q = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        with urllib.request.urlopen(f"{self.url}/api/map?{q}", timeout=300) as r:
            return json.loads(r.read())

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def servers(stores):
    made = {name: Server(path) for name, path in stores.items()}
    yield made
    for s in made.values():
        s.close()


def as_float(v):
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v, v) if isinstance(v, str) else v


def check(run, m, stat, start, stop):
    """``m`` (a map answer) against numpy over ``run.stats()``."""
    ds = run.stats("activations").compute()
    steps = ds.step.values
    inside = steps[(steps >= (start if start is not None else steps[0]))
                   & (steps < (stop if stop is not None else steps[-1] + 1))]
    covered = [int(s) for a, b in zip(m["step_lo"], m["step_hi"]) for s in inside if a <= s <= b]
    assert covered == inside.tolist()
    ran = ds["count"].values >= 0            # a layer that did not run: counts of -1
    count = {k: np.where(ran, ds[k].values, np.nan) for k in ("nan", "posinf", "neginf", "count")}
    bad = count["nan"] + count["posinf"] + count["neginf"]
    if stat == "nonfinite":
        vals = bad
    elif stat == "rms":
        finite = count["count"] - bad
        vals = ds["norm"].values / np.sqrt(np.where(finite > 0, finite, np.nan))
    else:
        vals = ds[stat].values
    layers = list(ds.layer.values)
    assert m["layers"] == [n for n in run.layers if n in layers]
    for row, name in enumerate(m["layers"]):
        j = layers.index(name)
        for c, (a, b) in enumerate(zip(m["step_lo"], m["step_hi"])):
            v = vals[(steps >= a) & (steps <= b), j]
            want = np.nanmax(v) if (~np.isnan(v)).any() else math.nan
            got = as_float(m["values"][row][c])
            assert got == want or (math.isnan(got) and math.isnan(want)), (name, a, b, got, want)
            with np.errstate(invalid="ignore"):
                flag = bool((bad[(steps >= a) & (steps <= b), j] > 0).any())
            assert m["nonfinite"][row][c] == flag, (name, a, b)


WINDOWS = st.tuples(st.one_of(st.none(), st.integers(0, 420)), st.integers(1, 500),
                    st.integers(1, 400), st.sampled_from(STATS))


@pytest.mark.parametrize("name", ["plain", "resumed", "again", "old"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(window=WINDOWS)
def test_map_columns_are_the_largest_of_their_steps(stores, servers, name, window):
    start, span, width, stat = window
    stop = None if start is None else start + span
    run = open_run(stores[name])
    check(run, servers[name].map(stat=stat, width=width, start=start, stop=stop), stat, start, stop)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(window=WINDOWS)
def test_a_store_without_its_pyramid_gives_the_same_maps_bit_for_bit(servers, window):
    start, span, width, stat = window
    stop = None if start is None else start + span
    q = dict(stat=stat, width=width, start=start, stop=stop)
    assert servers["plain"].map(**q) == servers["old"].map(**q)


def stored_oracle(path, grain):
    """A pyramid level as format.py documents it, recomputed with numpy from the stored
    rows of the stats table (plain zarr, as a reader without tensortape would)."""
    g = zarr.open_group(path, mode="r")
    names = list(g[TABLE].attrs["stats"])
    rows = g[TABLE]["stats"][: dict(g["rank0"].attrs)["committed"][TABLE]]
    s = {k: rows[..., names.index(k)] for k in names}
    bad = np.nan_to_num(s["nan"]) + np.nan_to_num(s["posinf"]) + np.nan_to_num(s["neginf"])
    finite = s["count"] - bad
    with np.errstate(divide="ignore", invalid="ignore"):
        rms = np.where(finite > 0, s["norm"] / np.sqrt(finite), np.nan)
    v = np.stack([s["abs_max"], s["std"], s["norm"], rms,
                  np.where(np.isnan(s["nan"]), np.nan, bad), bad > 0], axis=-1)
    n = len(v) // grain
    out = np.full((n, *v.shape[1:]), np.nan)
    for i in range(n):
        with np.errstate(invalid="ignore"):
            part = v[i * grain:(i + 1) * grain]
            seen = ~np.isnan(part).all(axis=0)
            out[i][seen] = np.nanmax(part, axis=0)[seen]
    return out


@pytest.mark.parametrize("name", ["plain", "resumed", "again"])
@pytest.mark.parametrize("grain", [64, 8])
def test_the_stored_pyramid_is_the_grains_of_the_stored_rows(stores, name, grain):
    """Also after a resumed recording, whose partial grains were folded again."""
    g = zarr.open_group(stores[name], mode="r")
    level = g[TABLE][f"pyramid{grain}"]
    assert level.metadata.dimension_names == (f"grain{grain}", "layer", "grain_stat")
    want = stored_oracle(stores[name], grain)
    got = level[: len(want)]
    assert dict(g["rank0"].attrs)["pyramid"][TABLE] == dict(g["rank0"].attrs)["committed"][TABLE]
    np.testing.assert_array_equal(got[..., :5], want[..., :5])
    assert ((got[..., 5] > 0) == (want[..., 5] > 0)).all()


def test_a_store_migrated_from_its_export_has_its_pyramid(stores, tmp_path):
    from click.testing import CliRunner
    from tensortape.cli import cli
    h5 = open_run(stores["plain"]).to_hdf5(str(tmp_path / "plain.h5"))
    new = str(tmp_path / "back.zarr")
    assert CliRunner().invoke(cli, ["migrate", h5, new]).exit_code == 0
    g = zarr.open_group(new, mode="r")
    assert dict(g["rank0"].attrs)["pyramid"][TABLE] == 357
    for grain in (64, 8):
        want = stored_oracle(new, grain)
        got = g[TABLE][f"pyramid{grain}"][:]
        assert got.shape[0] == 357 // grain
        np.testing.assert_array_equal(got[..., :5], want[..., :5])


def test_a_store_with_a_pyramid_opens_with_plain_xarray(stores):
    import xarray as xr
    tree = xr.open_datatree(stores["resumed"], engine="zarr", consolidated=False)
    assert tree[TABLE].ds["pyramid64"].dims == ("grain64", "layer", "grain_stat")


def check_served(path, window):
    """The served maps of ``path`` (abs_max and non-finite, whole and zoomed to ``window``:
    width, start, stop) against the oracle."""
    run = open_run(path)
    s = Server(path)
    try:
        for width, start, stop in ((1, None, None), (4, None, None), (30, None, None),
                                   window, (1000, None, None)):
            for stat in ("abs_max", "nonfinite"):
                check(run, s.map(stat=stat, width=width, start=start, stop=stop), stat, start, stop)
    finally:
        s.close()


def cut(path, copy, rows, garbage=False, entry=True):
    """``path`` copied with its stats table's commit set back to ``rows`` (what a
    SIGKILL between writing rows and committing them leaves: data, grains and all,
    past the commit); ``garbage``: its pyramid's levels overwritten with nonsense;
    ``entry``: keep the rank state's pyramid entry."""
    shutil.copytree(path, copy)
    g = zarr.open_group(copy, mode="r+")
    attrs = dict(g["rank0"].attrs)
    attrs["committed"][TABLE] = rows
    if entry:
        attrs["pyramid"][TABLE] = max(attrs["pyramid"][TABLE], rows)
    else:
        attrs.pop("pyramid")
    g["rank0"].attrs.put(attrs)
    if garbage:
        for grain in (64, 8):
            level = g[TABLE][f"pyramid{grain}"]
            level[...] = np.zeros(level.shape)
    return copy


@pytest.mark.parametrize("case", ["uncommitted rows", "entry behind"])
def test_only_grains_of_committed_rows_the_state_vouches_for_are_read(stores, tmp_path, case):
    """A spike at step 300, past the commit, is in the stored grains of rows 256..319
    (and 296..303): a reader that trusted them would show it."""
    src = record(str(tmp_path / "src.zarr"), range(357), spike=300, nan_step=301)
    if case == "uncommitted rows":
        path = cut(src, str(tmp_path / "cut.zarr"), 297)
    else:                                     # the pyramid covers fewer rows than committed
        path = cut(src, str(tmp_path / "cut.zarr"), 357, garbage=True)
        g = zarr.open_group(path, mode="r+")
        attrs = dict(g["rank0"].attrs)
        attrs["pyramid"][TABLE] = 0
        g["rank0"].attrs.put(attrs)
    check_served(path, (12, 8, 330))


def test_a_table_widened_by_a_writer_without_pyramids_is_read_from_its_rows(tmp_path,
                                                                           monkeypatch):
    """A tensortape older than pyramids appending to a store keeps the rank state's
    pyramid entry (attributes are merged) but widens only ``stats`` when a layer is
    added: the narrower levels must not be read, or the new layer would show another
    layer's grains (or the map would fail)."""
    from tensortape.recorder.store import _store
    path = str(tmp_path / "mixed.zarr")
    model, data = Net(), torch.Generator().manual_seed(5)

    def steps(layers, span, mode):
        with Recorder(model, path, layers=layers, tensors_every=None, capture=("activations",),
                      mode=mode, stats_every=1) as rec:
            for step in span:
                with rec.step(step), torch.no_grad():
                    model(torch.randn(3, 4, generator=data) * (1 + step))
    steps(["a"], range(130), "w-")
    with monkeypatch.context() as m:                 # the older writer: no pyramid kept
        m.setattr(_store.RunStore, "_pyramid", lambda self, *a: None)
        steps(["a", "c"], range(130, 300), "a")
    g = zarr.open_group(path, mode="r+")
    assert g[TABLE]["stats"].shape[1] == 2 and g[TABLE]["pyramid64"].shape[1] == 1
    # its rank state knew no "pyramid" key, and zarr merged its commit into the attributes
    g["rank0"].attrs.update({"pyramid": {TABLE: 130}})
    check_served(path, (7, 0, 128))


def test_a_corrupt_chunk_of_the_pyramid_is_read_from_the_rows(tmp_path):
    """Before: a pyramid level's chunk that cannot be decoded refused the map.  Now
    the map reads those grains from the rows, and says so once."""
    from tensortape.recorder.errors import TensortapeWarning
    path = record(str(tmp_path / "src.zarr"), range(357), spike=300, nan_step=301)
    for grain in (64, 8):
        chunk = os.path.join(path, TABLE, f"pyramid{grain}", "c", "0", "0", "0")
        assert os.path.isfile(chunk)
        with open(chunk, "wb") as f:
            f.write(b"\x28\xb5\x2f\xfdgarbage")
    with pytest.warns(TensortapeWarning, match="cannot be read.*the map reads the rows instead"):
        check_served(path, (12, 8, 330))


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from tests.test_pyramid import Net
    from tensortape.recorder import Recorder
    model = Net()
    g = torch.Generator().manual_seed(0)
    with Recorder(model, sys.argv[1], tensors_every=None, capture=("activations",),
                  flush_interval=0.01, stats_every=1) as rec:
        for step in range(100000):
            x = torch.randn(3, 4, generator=g) * (1 + step % 97)
            if step % 331 == 7:
                x[0, 0] = float("nan")
            model.skip = step % 5 == 2
            with rec.step(step), torch.no_grad():
                model(x)
            if step == 150:
                print("ready", flush=True)
""")


def committed(path) -> int:
    try:
        with open(os.path.join(path, "rank0", "zarr.json")) as f:
            return json.load(f)["attributes"]["committed"].get(TABLE, 0)
    except (OSError, ValueError, KeyError):
        return 0


def test_a_run_killed_while_recording_reads_right(tmp_path):
    path = str(tmp_path / "killed.zarr")
    env = dict(os.environ, TENSORTAPE_COMPILE="0")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, ROOT], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 120
    while committed(path) < 200 and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)            # while it records: rows, grains, commits
    proc.wait()
    proc.stdout.close()
    run = open_run(path)
    assert run.status == "recording" and len(run.steps("activations")) >= 200
    s = Server(path)
    try:
        n = int(run.steps("activations")[-1]) + 1
        for width, start in ((1, None), (3, None), (20, None), (60, 5), (n, None)):
            check(run, s.map(stat="nonfinite", width=width, start=start), "nonfinite", start, None)
            check(run, s.map(stat="abs_max", width=width, start=start), "abs_max", start, None)
    finally:
        s.close()
