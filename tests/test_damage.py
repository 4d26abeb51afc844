"""Damage is local: a chunk missing from a run's committed rows, or there but
undecodable (corrupt, truncated, a bit flipped: every chunk has a checksum), makes only its rows unreadable.  They read as
missing (NaN, counts -1; a full tensor or a row whose step is lost is not there)
and are named, in `info` and in a warning; every other row reads exactly as a
pristine copy of the run does, through every reader.  An undecodable chunk is
found when it is read (opening a run reads no chunk): its table's key columns
(step, micro-batch, extent, scalar name) when the table is first read, the rest
when their rows are; a full tensor's, as its rows are read, which then read as
its padding (NaN) there.

The truth is the pristine copy, and which rows the damaged chunk held, read with
zarr itself."""
import json
import math
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from torch import nn

from tensortape import Recorder, cli, open_run
from tensortape.recorder import RecorderError
from tensortape.recorder.errors import TensortapeWarning

from test_serve import Served

STEPS = 1100            # past a stats shard (1024 rows), a histogram shard (256), a step chunk
POISON = 1060           # the step whose probe holds NaN (the run's first non-finite event)
COUNTS = ("count", "nan", "posinf", "neginf")


class Net(nn.Module):
    """Two linears, and a probe that sees a detached copy of the hidden layer (a
    NaN there at one step, which training never sees)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.probe = nn.Linear(4, 8), nn.Linear(8, 2), nn.Identity()
        self.poison = 0.0

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        self.probe(h.detach() + self.poison)
        return self.fc2(h)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("damage") / "pristine.zarr")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, path, layers=["fc1", "fc2", "probe"], tensors_every=16,
                  max_bytes=None, stats_every=1) as rec:
        for step in range(STEPS):
            model.poison = math.nan if step == POISON else 0.0
            with rec.step(step):
                loss = model(torch.randn(3, 4)).pow(2).mean()
                loss.backward()
                rec.log({"loss": loss.detach(), "lr": 0.01})
            opt.step()
            opt.zero_grad()
    return path


@pytest.fixture(scope="module")
def truth(pristine):
    """What every reader gives of the pristine run, read once for the module's cases:
    ``library_reads``, ``info`` and ``nan`` as JSON, and the served maps by (kind,
    stat, width)."""
    reads = library_reads(pristine)
    served = Served(pristine)
    try:
        maps = {(kind, stat, width): served.get("map", kind=kind, stat=stat, width=width)[1]
                for kind in reads["kinds"] for stat, width in MAPS}
    finally:
        served.close()
    nan, _, code = cli_json("nan", pristine, "--format", "json")
    return {"reads": reads, "info": cli_json("info", pristine, "--format", "json")[0],
            "nan": (nan, code), "maps": maps}


# the chunk damaged: (table, column, chunk key), under rank0/
CASES = {
    "statistics": ("stats/activations", "stats", "c/0/0/0"),
    "histograms": ("stats/activations", "hist", "c/1/0/0"),
    "steps of statistics": ("stats/gradients", "step", "c/0"),
    "full tensors": ("tensors/activations/fc1", "data", "c/0/0/0"),
    "full tensors' steps": ("tensors/gradients/fc2", "step", "c/0"),
    "full tensors' micro-batches": ("tensors/activations/probe", "micro", "c/0"),
    "full tensors' extents": ("tensors/activations/fc2", "extent", "c/0/0"),
    "scalars' values": ("scalars", "value", "c/1"),
    "scalars' names": ("scalars", "name", "c/0"),
}
KEYS = ("step", "micro", "extent", "name")      # read when their table is first read
# how a chunk is damaged: deleted, or there but undecodable
HOW = {"missing": os.remove,
       "corrupt": lambda f: Path(f).write_bytes(b"\x28\xb5\x2f\xfdgarbage"),
       "truncated": lambda f: os.truncate(f, os.path.getsize(f) // 2),
       "flipped": lambda f: _flip(f, os.path.getsize(f) // 2)}
DAMAGES = [*(("missing", c) for c in sorted(CASES)),
           *(("corrupt", c) for c in sorted(CASES)),
           ("truncated", "statistics"), ("truncated", "full tensors' micro-batches"),
           ("flipped", "full tensors"), ("flipped", "scalars' values")]


def _flip(path, at):
    """One bit of a chunk flipped (a bad disk block): the chunk may still decode."""
    raw = bytearray(Path(path).read_bytes())
    raw[at] ^= 0x10
    Path(path).write_bytes(bytes(raw))


def held_rows(store, table, column, key):
    """The rows ``[lo, hi)`` of a table that a chunk of ``column`` holds, and their
    steps, read with zarr."""
    arr = zarr.open_array(os.path.join(store, "rank0", table, column), mode="r")
    per = (arr.shards or arr.chunks)[0]
    i = int(key.split("/")[1])
    committed = json.loads(Path(store, "rank0", "zarr.json").read_text())["attributes"][
        "committed"][f"rank0/{table}"]
    lo, hi = i * per, min((i + 1) * per, committed)
    steps = zarr.open_array(os.path.join(store, "rank0", table, "step"), mode="r")[lo:hi]
    return lo, hi, steps


def library_reads(path):
    """What open_run gives of a run: statistics and every histogram of each kind,
    every full tensor, the scalars and the first non-finite event."""
    run = open_run(path)
    out = {"kinds": run.kinds, "scalars": run.scalars(), "first": run.first_nonfinite()}
    for kind in run.kinds:
        out[("stats", kind)] = run.stats(kind).compute()
        for layer in out[("stats", kind)].layer.values.tolist():
            out[("hist", kind, layer)] = run.histogram(layer, kind).compute()
        for layer in run.tensor_layers(kind):
            out[("tensor", kind, layer)] = run.tensor(layer, kind).compute()
    return out


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def cli_json(*args):
    r = CliRunner().invoke(cli.cli, list(args))
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout), r.stderr, r.exit_code


@pytest.mark.parametrize("how, case", DAMAGES)
def test_a_damaged_chunk_reads_as_missing_and_the_rest_as_recorded(pristine, truth, tmp_path, how,
                                                                  case):
    """Before (how: corrupt, truncated): an undecodable chunk refused the whole run."""
    table, column, key = CASES[case]
    damaged = str(tmp_path / "damaged.zarr")
    shutil.copytree(pristine, damaged)
    chunk = f"rank0/{table}/{column}/{key}"
    HOW[how](os.path.join(damaged, chunk))
    said = "is missing" if how == "missing" else "cannot be read ("
    lo, hi, lost = held_rows(pristine, table, column, key)
    lost = set(np.asarray(lost).tolist())
    assert lost and hi > lo

    want = truth["reads"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = library_reads(damaged)
    warned = [str(w.message) for w in caught]
    assert warned and all(w.category is TensortapeWarning for w in caught), warned
    assert all(f"{chunk} {said}" in s and "the rest of the run reads as recorded" in s
               for s in warned), warned

    section = table.split("/")
    for k in want["kinds"]:                                # statistics: NaN and -1 where lost
        w, g = want[("stats", k)], got[("stats", k)]
        rows = section[:2] == ["stats", k]
        if rows and column == "step":                     # the lost rows' steps are not there
            assert set(w.step.values.tolist()) - set(g.step.values.tolist()) == lost
            w = w.sel(step=g.step)
        assert list(g.step.values) == list(w.step.values)
        hit = np.isin(g.step.values, list(lost)) if rows and column == "stats" else \
            np.zeros(len(g.step), bool)
        for s in w.data_vars:
            gs, ws = g[s].values, w[s].values
            same(gs[~hit], ws[~hit])
            same(gs[hit], np.full_like(ws[hit], -1 if s in COUNTS else np.nan))
        for layer in w.layer.values.tolist():               # histograms: -1 where lost
            wh, gh = want[("hist", k, layer)], got[("hist", k, layer)]
            wh = wh.sel(step=gh.step)
            hit_h = np.isin(gh.step.values, list(lost)) if rows and column == "hist" else \
                np.zeros(len(gh.step), bool)
            same(gh.values[~hit_h], wh.values[~hit_h])
            assert (gh.values[hit_h] == -1).all()
            for c in ("nan", "posinf", "neginf"):
                same(gh[c].values[~hit], wh[c].values[~hit])
    for name, w in want.items():                            # full tensors: lost steps absent
        if name[0] != "tensor":
            continue
        lost_here = lost if table == f"tensors/{name[1]}/{name[2]}" else set()
        if how != "missing" and column == "data" and lost_here:    # found as its rows are read:
            g = got[name]                                          # its padding, NaN, there
            hit = np.isin(g.step.values, list(lost_here))
            assert g.step.values.tolist() == w.step.values.tolist() and hit.any()
            assert np.isnan(g.values[hit]).all()
            same(g.values[~hit], w.values[~hit])
            continue
        if lost_here >= set(w.step.values.tolist()):
            assert name not in got                          # every row lost: no such layer
            continue
        g = got[name]
        assert set(w.step.values.tolist()) - set(g.step.values.tolist()) == lost_here
        same(g.values, w.sel(step=g.step).values)
        same(g.extent_dim_0.values, w.sel(step=g.step).extent_dim_0.values)
    ws, gs = want["scalars"], got["scalars"]                # scalars: NaN where lost
    if table == "scalars" and column != "value":
        assert set(ws.step.values.tolist()) - set(gs.step.values.tolist()) == lost
        ws = ws.sel(step=gs.step)
    assert list(gs.step.values) == list(ws.step.values)
    for name in ws.data_vars:
        hit = np.isin(gs.step.values, list(lost)) if (table, column) == ("scalars", "value") \
            else np.zeros(len(gs.step), bool)
        same(gs[name].values[~hit], ws[name].values[~hit])
        assert np.isnan(gs[name].values[hit]).all()
    assert got["first"] == want["first"]                    # the event, and its history
    h_w, h_g = want["first"].history, got["first"].history
    assert list(h_g.step.values) == list(h_w.step.values)

    # the command line: info names the chunk; nan and compare read the rest as recorded
    info, err, code = cli_json("info", damaged, "--format", "json")
    named = how == "missing" or column in KEYS               # else found only when read
    assert code == 0 and len(info["damaged"]) == named and (
        not named or info["damaged"][0].startswith(f"{chunk} {said}")), info["damaged"]
    assert (f"warning: {damaged}: {chunk} {said}" in err) == named, err
    assert truth["info"]["damaged"] == []
    nan_w, code_w = truth["nan"]
    nan_g, _, code_g = cli_json("nan", damaged, "--format", "json")
    assert code_g == code_w == 1
    assert {k: v for k, v in nan_g.items() if k != "history"} == \
        {k: v for k, v in nan_w.items() if k != "history"}
    for kind in want["kinds"]:                              # damage is no divergence
        cmp, err, code = cli_json("compare", damaged, pristine, "--kind", kind, "--format", "json")
        assert code == 0 and cmp["first_divergence"] is None, (kind, cmp["first_divergence"])

    # the served map, one step a column: every readable cell as the pristine run's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TensortapeWarning)      # said above
        served_map(truth["maps"], damaged, want["kinds"], lost,
                   section[:2] == ["stats", "activations"] and column == "stats")


MAPS = [("abs_max", 4096), ("nonfinite", 4096), ("abs_max", 32)]   # (stat, width) served


def served_map(pristine_maps, damaged, kinds, lost, stats_lost):
    """/api/map of the damaged run against the pristine run's (``pristine_maps``), one
    step a column: each readable cell is the pristine run's; where the activations'
    statistics are lost (``stats_lost``), no value."""
    b = Served(damaged)
    try:
        for kind in kinds:
            for stat in ("abs_max", "nonfinite"):
                mw = pristine_maps[(kind, stat, 4096)]
                mg = b.get("map", kind=kind, stat=stat, width=4096)[1]
                keep = [i for i, s in enumerate(mw["step_lo"]) if s in set(mg["step_lo"])]
                assert mg["step_lo"] == [mw["step_lo"][i] for i in keep]
                assert mg["layers"] == mw["layers"]
                rows = stats_lost and kind == "activations"
                for vw, vg, fw, fg in zip(mw["values"], mg["values"], mw["nonfinite"],
                                          mg["nonfinite"]):
                    for j, i in enumerate(keep):
                        if rows and mw["step_lo"][i] in lost:
                            assert vg[j] == "nan" and fg[j] is False
                        else:
                            assert (vg[j], fg[j]) == (vw[i], fw[i])
            # columns of whole grains (the stored pyramid, or the rows): a column
            # of no lost step is the pristine run's
            mw = pristine_maps[(kind, "abs_max", 32)]
            mg = b.get("map", kind=kind, stat="abs_max", width=32)[1]
            if (mg["step_lo"], mg["step_hi"]) != (mw["step_lo"], mw["step_hi"]):
                continue                                    # steps lost: other columns
            gone = lost if rows else set()
            clean = [i for i, (lo, hi) in enumerate(zip(mw["step_lo"], mw["step_hi"]))
                     if not any(lo <= s <= hi for s in gone)]
            assert clean
            for vw, vg in zip(mw["values"], mg["values"]):
                assert [vg[i] for i in clean] == [vw[i] for i in clean]
    finally:
        b.close()


def test_a_full_tensor_lost_to_damage_says_so(pristine, tmp_path):
    damaged = str(tmp_path / "damaged.zarr")
    shutil.copytree(pristine, damaged)
    os.remove(os.path.join(damaged, "rank0/tensors/activations/fc1/data/c/0/0/0"))
    with pytest.warns(TensortapeWarning, match="fc1/data/c/0/0/0 is missing"):
        run = open_run(damaged)
        steps = run.steps("activations", tensors=True, layer="fc1")
    assert 0 not in steps.tolist() and 1088 in steps.tolist()
    with pytest.raises(RecorderError, match="step 0 .*its chunk is missing"):
        run.tensor("fc1", "activations", step=0)


def test_a_chunk_missing_in_a_live_run_is_looked_for_again_first(pristine, tmp_path, monkeypatch):
    """A run still recording may show a chunk late: it is looked for again, a few
    times further apart, before it counts as missing."""
    from tensortape.analysis import _source
    damaged = str(tmp_path / "live.zarr")
    shutil.copytree(pristine, damaged)
    root = Path(damaged, "zarr.json")
    meta = json.loads(root.read_text())
    meta["attributes"]["status"] = "recording"
    root.write_text(json.dumps(meta))
    chunk = Path(damaged, "rank0/stats/activations/hist/c/1/0/0")
    kept = chunk.read_bytes()
    os.remove(chunk)
    slept = []

    def sleep(s):                               # the chunk appears after the second look
        slept.append(s)
        if len(slept) == 2:
            chunk.write_bytes(kept)
    monkeypatch.setattr(_source.time, "sleep", sleep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no damage reported
        got = open_run(damaged).histogram("fc1", "activations").compute()
    assert slept == [0.05, 0.1]
    same(got.values, open_run(pristine).histogram("fc1", "activations").values)
    os.remove(chunk)
    slept.clear()
    monkeypatch.setattr(_source.time, "sleep", slept.append)
    with pytest.warns(TensortapeWarning, match="hist/c/1/0/0 is missing"):
        open_run(damaged).histogram("fc1", "activations")
    assert slept == [0.05, 0.1, 0.2, 0.4, 0.8]  # 1.55 s in all, then damage


def test_the_hdf5_export_refuses_a_damaged_run_in_one_line(pristine, tmp_path):
    """The export copies chunks as stored: it would write the lost rows as fill
    values that read as recorded, so it refuses, naming the chunk."""
    damaged = str(tmp_path / "damaged.zarr")
    shutil.copytree(pristine, damaged)
    os.remove(os.path.join(damaged, "rank0/stats/activations/hist/c/1/0/0"))
    r = CliRunner().invoke(cli.cli, ["export", damaged, str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and not (tmp_path / "x.h5").exists()
    err = r.stderr.splitlines()
    assert err[-1].startswith("Error: ") and "hist/c/1/0/0 is missing" in err[-1]
    assert "refuses a damaged run" in err[-1]
    assert err[0].startswith("warning: ") and len(err) == 2


def test_rows_of_a_data_set_never_come_from_an_undecodable_chunk(pristine, tmp_path):
    """``run.rows`` (a data set to train on) leaves out the rows of a full-tensor chunk
    that cannot be decoded, as every other reader does: before, they came out as the
    chunk's fill (NaN) with their step and position, as if recorded."""
    damaged = str(tmp_path / "damaged.zarr")
    shutil.copytree(pristine, damaged)
    HOW["corrupt"](os.path.join(damaged, "rank0/tensors/activations/fc1/data/c/0/0/0"))

    def rows(path):
        got = {}
        for r in open_run(path).rows("fc1", shuffle=False):
            got[(r["step"], r["micro"], r["sequence"], r["position"])] = r["x"]
        return got

    truth = rows(pristine)
    with pytest.warns(TensortapeWarning, match="cannot be read|damaged"):
        got = rows(damaged)
    assert got and len(got) < len(truth)
    assert not any(np.isnan(x).any() for x in got.values())
    assert all(np.array_equal(x, truth[k]) for k, x in got.items())


@pytest.mark.parametrize("array", ["tensors/activations/fc1/data", "tensors/activations/fc1/step",
                                   "tensors/activations/fc1/extent", "stats/gradients/step"])
def test_an_array_missing_whole_is_named_and_the_rest_reads_as_recorded(tmp_path, array):
    """A table's whole array gone (its folder deleted): its rows are damage, named in a
    warning and by ``info``; ``repr`` never raises, and every other table reads as the
    model's own forward hooks saw it."""
    path = str(tmp_path / "run.zarr")
    torch.manual_seed(0)
    model, seen = Net(), {}
    for name in ("fc1", "fc2"):
        getattr(model, name).register_forward_hook(
            lambda m, a, out, name=name: seen.setdefault(name, []).append(out.detach().clone()))
    with Recorder(model, path, layers=["fc1", "fc2"], tensors_every=1, max_bytes=None,
                  stats_every=1) as rec:
        for step in range(5):
            with rec.step(step):
                model(torch.randn(3, 4)).pow(2).mean().backward()
    shutil.rmtree(os.path.join(path, "rank0", array))
    with pytest.warns(TensortapeWarning, match=f"rank0/{array} is missing: rows 0-4"):
        run = open_run(path)
        text = repr(run)
    assert "activations" in text
    assert any(f"rank0/{array} is missing" in d for d in run.summary()["damaged"])
    lost = "fc1" if array.startswith("tensors") else None
    assert run.tensor_layers("activations") == [n for n in ("fc1", "fc2") if n != lost]
    for name in run.tensor_layers("activations"):
        got = run.tensor(name, "activations")
        assert got.step.values.tolist() == list(range(5))
        same(got.values, torch.stack(seen[name]).numpy())
    kinds = ["activations"] if array.startswith("stats") else ["activations", "gradients"]
    for kind in kinds:                                   # statistics of the other tables
        ds = run.stats(kind).compute()
        assert ds.step.values.tolist() == list(range(5))
        want = [[t.double().abs().max().item() for t in seen[n]] for n in ("fc1", "fc2")] \
            if kind == "activations" else None
        if want is not None:
            same(ds["abs_max"].sel(layer=["fc1", "fc2"]).values.T, want)
    if array.startswith("stats"):
        assert run.steps("gradients").tolist() == []
