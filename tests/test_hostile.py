"""Damaged and hostile stores: refused with one line, by open_run and by every command."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from analysis import open_run
from recorder import Recorder, RecorderError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("good") / "run.zarr")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with Recorder(model, store, layers=["0", "2"]) as rec:
        for _ in range(3):
            with rec.step():
                model(torch.randn(5, 4)).sum().backward()
    return store


def _edit_json(path, fn):
    with open(path) as f:
        meta = json.load(f)
    fn(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def _rank_attrs(store, fn):
    _edit_json(os.path.join(store, "rank0", "zarr.json"), lambda m: fn(m["attributes"]))


def _data_chunk(store):
    d = os.path.join(store, "rank0", "tensors", "activations", "0", "data", "c")
    for base, _, files in os.walk(d):
        for f in files:
            return os.path.join(base, f)


HOSTILE = {
    "root zarr.json is not JSON": lambda s: open(os.path.join(s, "zarr.json"), "w").write("{oops"),
    "root zarr.json is a list": lambda s: open(os.path.join(s, "zarr.json"), "w").write("[1, 2]"),
    "committed is a string": lambda s: _rank_attrs(s, lambda a: a.update(committed="many")),
    "layers is an int": lambda s: _rank_attrs(s, lambda a: a.update(layers=7)),
    "committed path escapes": lambda s: _rank_attrs(
        s, lambda a: a["committed"].update({"rank0/tensors/activations/../../x": 3})),
    "more committed rows than stored": lambda s: _rank_attrs(
        s, lambda a: a["committed"].update({"rank0/stats/activations": 10 ** 6})),
    "stats_layers longer than the arrays": lambda s: _rank_attrs(
        s, lambda a: a["stats_layers"].update(activations=[f"l{i}" for i in range(500)])),
    "a 10^12 x 10^12 tensor": lambda s: _edit_json(
        os.path.join(s, "rank0", "tensors", "activations", "0", "data", "zarr.json"),
        lambda m: m.update(shape=[m["shape"][0], 10 ** 12, 10 ** 12])),
    "a corrupt chunk": lambda s: open(_data_chunk(s), "wb").write(b"\x28\xb5\x2f\xfdgarbage"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_stores_are_refused_in_one_line(good, tmp_path, case):
    store = str(tmp_path / "bad.zarr")
    shutil.copytree(good, store)
    HOSTILE[case](store)
    with pytest.raises(RecorderError):            # opening, or reading what it claims
        run = open_run(store)
        run.stats().compute()
        for kind in run.kinds:
            for layer in run.tensor_layers(kind):
                run.tensor(layer, kind).compute()
    out = str(tmp_path / "x.h5")
    for args in (["info", store], ["stats", store], ["nan", store], ["export", store, out],
                 ["plot", store, "--layer", "0", "-o", str(tmp_path / "p.png")]):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        if p.returncode == 2:
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in p.stderr, (args, p.stderr[-800:])
        else:                                     # a command that never reads the bad part
            assert p.returncode in (0, 1) and "Traceback" not in p.stderr, (args, p.stderr[-800:])


def test_an_hdf5_header_on_garbage_is_refused(tmp_path):
    f = tmp_path / "fake.h5"
    f.write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(256))
    with pytest.raises(RecorderError):
        open_run(str(f))
