"""The package surface: exported names, torch-free reading, and the recorder's lifecycle."""
import gc
import warnings
import threading
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tensortape
from tensortape import analysis, recorder
from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from conftest import InplaceMLP, has_hooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exported_names_are_exactly_the_documented_ones():
    assert recorder.__all__ == sorted([
        "Recorder", "select_layers", "RecorderError", "ConfigError", "LayerNotFoundError", "InspectionError",
        "NonFiniteError", "StoreExistsError", "StoreNotFoundError", "StoreFormatError",
        "TensortapeWarning"])
    assert analysis.__all__ == sorted([
        "open_run", "Run", "NonFiniteEvent", "FirstNonFinite", "compare_runs",
        "first_divergence", "plot_comparison", "Inspector"])
    for pkg in (recorder, analysis):
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None
        public = {n for n in os.listdir(os.path.dirname(pkg.__file__))
                  if n.endswith(".py") and not n.startswith("_")}
        # the recorder's public modules for the reader and the CLI: the schema (format),
        # its codecs (histogram, dtypes), pattern matching (patterns) and the summary
        # pyramid's arithmetic (pyramid: the writer and the map share it); replay and
        # inspection (torch), migrate (the one writer of the layout), script (record),
        # liveness (whether a live job holds a run), quiet (the dependencies' warnings)
        assert public <= {"errors.py", "format.py", "histogram.py", "dtypes.py", "patterns.py",
                          "pyramid.py", "integrations.py", "inspection.py", "migrate.py", "script.py",
                          "liveness.py", "quiet.py", "replay.py"}, public


def test_the_package_exports_the_names_a_user_starts_with():
    assert tensortape.__all__ == sorted([
        "Recorder", "select_layers", "RecorderError", "open_run", "compare_runs",
        "first_divergence", "plot_comparison", "Inspector"])
    assert tensortape.Recorder is recorder.Recorder and tensortape.open_run is analysis.open_run
    for name in tensortape.__all__:
        assert getattr(tensortape, name) is not None


def test_every_error_is_also_the_matching_builtin():
    from tensortape.recorder import errors
    assert issubclass(errors.LayerNotFoundError, LookupError)
    assert issubclass(errors.StoreExistsError, FileExistsError)
    assert issubclass(errors.StoreNotFoundError, FileNotFoundError)
    assert issubclass(errors.NonFiniteError, FloatingPointError)
    assert issubclass(errors.ConfigError, ValueError)
    for cls in (errors.LayerNotFoundError, errors.StoreFormatError, errors.InspectionError):
        assert issubclass(cls, errors.RecorderError)


DRIVER = textwrap.dedent("""
    import sys
    from tensortape import cli
    try:
        cli.main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    heavy = [m for m in ("torch", "torch._dynamo") if m in sys.modules]
    print("HEAVY", heavy, "EXIT", code)
""")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = InplaceMLP(seed)
        path = str(d / f"r{seed}.zarr")
        with Recorder(model, path, layers="fc*", tensors_every=1, stats_every=1) as rec:
            for _ in range(3):
                with rec.step():
                    model(torch.randn(2, 8)).sum().backward()
        paths.append(path)
    return paths, d


@pytest.mark.parametrize("args", [
    ["--help"], ["info", "A"], ["stats", "A", "--format", "json"], ["nan", "A"],
    ["plot", "A", "--layer", "fc1", "-o", "OUT/p.png"], ["compare", "A", "B"],
    ["export", "A", "OUT/a.h5"], ["watch", "A", "--interval", "0.1"], ["migrate", "H5", "OUT/m.zarr"],
])
def test_reading_commands_never_import_torch(two_runs, args):
    (a, b), out = two_runs
    if "H5" in args:                                 # migrate reads an older store: an export
        h5 = str(out / "for-migrate.h5")
        if not os.path.exists(h5):
            open_run(a).to_hdf5(h5)
        args = [h5 if x == "H5" else x for x in args]
    args = [a if x == "A" else b if x == "B" else x.replace("OUT", str(out)) for x in args]
    p = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True,
                       cwd=ROOT)
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("HEAVY []"), (last, p.stderr[-2000:])
    assert not last.endswith("EXIT 2"), p.stderr


def test_importing_the_packages_leaves_torch_out():
    code = ("import sys, analysis, recorder, recorder.format, recorder.errors; "
            "print([m for m in ('torch', 'xarray', 'matplotlib') if m in sys.modules])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       check=True)
    assert json.loads(p.stdout.replace("'", '"')) == ["xarray"]      # analysis needs xarray


def test_an_unclosed_recorder_is_closed_as_interrupted_on_collection(tmp_store):
    model = InplaceMLP()
    rec = Recorder(model, tmp_store, layers="fc1", tensors_every=1, stats_every=1).attach()
    with rec.step(0):
        model(torch.randn(2, 8)).sum().backward()
    rec.step(1)
    model(torch.randn(2, 8)).sum().backward()
    with warnings.catch_warnings():       # other tests' garbage first (an S3 test's client
        warnings.simplefilter("ignore")   # session in this worker), so only ours is seen
        gc.collect()
    with pytest.warns(ResourceWarning, match="never closed"):
        del rec
        gc.collect()
    for t in threading.enumerate():       # the finaliser waits for nothing: the test does
        if t.name == "tensortape-writer":
            t.join(30)
    assert not has_hooks(model)
    run = open_run(tmp_store)
    assert run.status == "interrupted" and run.steps().tolist() == [0, 1]
