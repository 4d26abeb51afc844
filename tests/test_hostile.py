"""Hostile stores: refused with one line, by open_run and by every command.  A
damaged one (a chunk missing, corrupt or truncated) is not refused: its damage is
local (tests/test_damage.py), here too."""
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensortape.analysis import open_run
from tensortape.recorder import Recorder, RecorderError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("good") / "run.zarr")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with Recorder(model, store, layers=["0", "2"], tensors_every=1, stats_every=1) as rec:
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


def _chunk_of(store, array):
    d = os.path.join(store, "rank0", *array.split("/"), "c")
    for base, _, files in os.walk(d):
        for f in files:
            return os.path.join(base, f)


def _data_chunk(store):
    return _chunk_of(store, "tensors/activations/0/data")


def _symlink_to_dev_zero(store):
    chunk = _data_chunk(store)
    os.remove(chunk)
    os.symlink("/dev/zero", chunk)


def _extent(store, value):
    import zarr
    zarr.open_array(os.path.join(store, "rank0", "tensors", "activations", "0", "extent"),
                    mode="r+")[0] = value


def _zarr_v2_asking_for_pickle(store):
    """A Zarr v2 store with tensortape's attributes whose ``step`` array is Python
    objects behind the pickle codec; unpickling it would create ``store + '.pwned'``."""
    root = json.loads(Path(store, "zarr.json").read_text())["attributes"]
    rank = json.loads(Path(store, "rank0", "zarr.json").read_text())["attributes"]
    rank["committed"] = {"rank0/stats/activations": 3}
    shutil.rmtree(store)
    step = os.path.join(store, "rank0", "stats", "activations", "step")
    os.makedirs(step)
    for d, attrs in ((store, root), (os.path.join(store, "rank0"), rank),
                     (os.path.join(store, "rank0", "stats"), {}), (os.path.dirname(step), {})):
        Path(d, ".zgroup").write_text(json.dumps({"zarr_format": 2}))
        Path(d, ".zattrs").write_text(json.dumps(attrs))
    Path(step, ".zarray").write_text(json.dumps(
        {"zarr_format": 2, "shape": [3], "chunks": [3], "dtype": "|O", "compressor": None,
         "fill_value": None, "filters": [{"id": "pickle"}], "order": "C"}))

    class Payload:
        def __reduce__(self):
            return open, (store + ".pwned", "w")
    Path(step, "0").write_bytes(pickle.dumps([Payload()] * 3))


HOSTILE = {
    # stores that are not what they claim
    "root zarr.json is not JSON": lambda s: Path(s, "zarr.json").write_text("{oops"),
    "root zarr.json is a list": lambda s: Path(s, "zarr.json").write_text("[1, 2]"),
    "a zarr v2 store asking for pickle": _zarr_v2_asking_for_pickle,
    # wrong-typed attributes
    "committed is a string": lambda s: _rank_attrs(s, lambda a: a.update(committed="many")),
    "layers is an int": lambda s: _rank_attrs(s, lambda a: a.update(layers=7)),
    "committed path escapes": lambda s: _rank_attrs(
        s, lambda a: a["committed"].update({"rank0/tensors/activations/../../x": 3})),
    "more committed rows than stored": lambda s: _rank_attrs(
        s, lambda a: a["committed"].update({"rank0/stats/activations": 10 ** 6})),
    "stats_layers longer than the arrays": lambda s: _rank_attrs(
        s, lambda a: a["stats_layers"].update(activations=[f"l{i}" for i in range(500)])),
    # unbounded reads
    "a 10^12 x 10^12 tensor": lambda s: _edit_json(
        os.path.join(s, "rank0", "tensors", "activations", "0", "data", "zarr.json"),
        lambda m: m.update(shape=[m["shape"][0], 10 ** 12, 10 ** 12])),
    "an extent of 10^12 x 10^12": lambda s: _extent(s, [10 ** 12, 10 ** 12]),
    "a chunk linked to /dev/zero": _symlink_to_dev_zero,
    "a 10 GB sparse chunk": lambda s: os.truncate(_data_chunk(s), 10 << 30),
}
# a chunk missing, corrupt or truncated is damage, read as missing where it lies
DAMAGED = {
    "a corrupt chunk": lambda s: Path(_data_chunk(s)).write_bytes(b"\x28\xb5\x2f\xfdgarbage"),
    "a truncated chunk": lambda s: os.truncate(_data_chunk(s), os.path.getsize(_data_chunk(s)) // 2),
}

# Every command on every hostile store, in one child process (under a 3 GiB address-space
# limit); each command's exit status and stderr come back as JSON.
DRIVER = """
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
from tensortape import cli
out = {}
for case, commands in json.loads(sys.argv[2]).items():
    out[case] = []
    for args in commands:
        err, code = io.StringIO(), 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                cli.main(args)
            except SystemExit as e:
                code = e.code
            except BaseException as e:
                code = repr(e)
        out[case].append([args, code, err.getvalue()])
print(json.dumps(out))
"""


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _hostile(good, where, case):
    store = os.path.join(where, "bad.zarr")
    shutil.copytree(good, store)
    {**HOSTILE, **DAMAGED}[case](store)
    return store


@pytest.fixture(scope="module")
def commands_on(good, tmp_path_factory):
    """Every reading command on every hostile store: case -> [(args, exit status, stderr)]."""
    stores, commands = {}, {}
    for case in sorted({**HOSTILE, **DAMAGED}):
        where = str(tmp_path_factory.mktemp("cli"))
        store = stores[case] = _hostile(good, where, case)
        commands[case] = [
            ["info", store], ["stats", store], ["nan", store],
            ["export", store, os.path.join(where, "x.h5")],
            ["plot", store, "--layer", "0", "-o", os.path.join(where, "p.png")],
            ["compare", store, good], ["watch", store, "--interval", "0.05"]]
    p = subprocess.run([sys.executable, "-c", DRIVER, ROOT, json.dumps(commands)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, preexec_fn=_limit_memory)
    assert p.returncode == 0, p.stderr[-2000:]
    return stores, json.loads(p.stdout)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_stores_are_refused_in_one_line(good, tmp_path, case, commands_on):
    store = _hostile(good, str(tmp_path), case)
    with pytest.raises(RecorderError):            # opening, or reading what it claims
        run = open_run(store)
        run.stats().compute()
        for kind in run.kinds:
            for layer in run.tensor_layers(kind):
                run.tensor(layer, kind).compute()
    stores, results = commands_on
    refused = 0
    for args, code, err in results[case]:
        assert "Traceback" not in err and "MemoryError" not in err, (args, err[-800:])
        if code == 2:
            refused += 1
            assert len(err.strip().splitlines()) == 1, (args, err)
        else:                                     # a command that never reads the bad part
            assert code in (0, 1), (args, code, err)
    assert refused >= 1                           # at least the commands that read it all
    assert not os.path.exists(store + ".pwned") and not os.path.exists(stores[case] + ".pwned")


def test_an_hdf5_header_on_garbage_is_refused(tmp_path):
    f = tmp_path / "fake.h5"
    f.write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(256))
    with pytest.raises(RecorderError):
        open_run(str(f))


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_corrupt_or_truncated_chunk_is_local_damage(good, tmp_path, case, commands_on):
    """Before: refused like a hostile store, by open_run and every command.  Now its
    rows read as missing, named in a warning, and the rest as recorded; only the
    HDF5 export (which copies chunks as stored) refuses, in one line."""
    import numpy as np
    from tensortape.recorder.errors import TensortapeWarning
    store = _hostile(good, str(tmp_path), case)
    chunk = os.path.relpath(_data_chunk(store), store)
    run, want = open_run(store), open_run(good)
    np.testing.assert_array_equal(run.stats().compute()["mean"], want.stats().compute()["mean"])
    with pytest.warns(TensortapeWarning, match=f"{chunk} cannot be read .* full tensors missing"):
        got = run.tensor("0", "activations").compute()
    lost = np.isnan(got.values).all(axis=tuple(range(1, got.ndim)))
    assert lost.any()
    np.testing.assert_array_equal(got.values[~lost], want.tensor("0").values[~lost])
    np.testing.assert_array_equal(run.tensor("2").values, want.tensor("2").values)
    stores, results = commands_on
    for args, code, err in results[case]:
        assert "Traceback" not in err and "MemoryError" not in err, (args, err[-800:])
        if args[0] == "export":                   # copies chunks as stored: refuses
            assert code == 2 and err.strip().splitlines()[-1].startswith("Error: "), (args, err)
            assert "refuses a damaged run" in err and chunk in err, err
        else:
            assert code in (0, 1), (args, code, err)
