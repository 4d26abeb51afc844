"""The command line, in-process (CliRunner) and as the installed script."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tensortape import cli
from tensortape.analysis import open_run
from tensortape.sample_runs.task import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    quiet = lambda s: None  # noqa: E731
    return {
        "stable": record(str(d / "stable.zarr"), steps=30, log=quiet),
        "other": record(str(d / "other.zarr"), steps=30, seed=1, log=quiet),
        "diverge": record(str(d / "diverge.zarr"), steps=15, diverge=True, log=quiet),
        "dir": str(d),
    }


def invoke(*args):
    return CliRunner().invoke(cli.cli, list(args), prog_name="tensortape")


def tensortape():
    """The installed script, or cli.py where it is not installed."""
    exe = shutil.which("tensortape")
    return [exe] if exe else [sys.executable, os.path.join(ROOT, "cli.py")]


def script(*args, cwd=ROOT):
    return subprocess.run([*tensortape(), *args], capture_output=True, text=True, cwd=cwd)


def test_info_text_and_json(runs):
    from dask.utils import format_bytes
    r = invoke("info", runs["stable"])
    assert r.exit_code == 0 and "status   complete" in r.output
    run = open_run(runs["stable"])
    layer = "encoder.layers.0.linear1"
    row = next(line for line in r.output.splitlines() if line.startswith(layer + " "))
    assert f"ST {format_bytes(run.tensor(layer).nbytes)}" in row      # decoded size, every step
    j = json.loads(invoke("info", runs["stable"], "--format", "json").output)
    assert j["status"] == "complete" and j["layers"][layer]["activations"]["stats"] is True
    assert j["layers"][layer]["activations"]["tensor_bytes"] == run.tensor(layer).nbytes
    assert j["steps"]["gradients"] == {
        "count": 30, "first": 0, "last": 29,
        "tensor_steps": len(run.steps("gradients", tensors=True))}
    assert isinstance(j["disk_bytes"], int) and j["disk_bytes"] > 0


def test_stats_json_keeps_integer_counts_and_full_precision(runs):
    r = invoke("stats", runs["stable"], "--layer", "encoder.*", "--format", "json", "--step", "5")
    rows = json.loads(r.output)
    assert rows and all(row["step"] == 5 and row["layer"].startswith("encoder.") for row in rows)
    assert all(type(row["count"]) is int and type(row["nan"]) is int for row in rows)
    ds = open_run(runs["stable"]).stats(layers="encoder.*").sel(step=5).compute()
    for row in rows:
        assert row["std"] == float(ds["std"].sel(layer=row["layer"]))      # not rounded
    r = invoke("stats", runs["stable"], "--kind", "gradients", "--format", "csv")
    assert r.exit_code == 0 and r.output.splitlines()[0].startswith("step,layer,count,mean")


def test_nan_exit_codes_and_json(runs):
    bad = invoke("nan", runs["diverge"])
    assert bad.exit_code == 1 and "first non-finite: step" in bad.output
    assert "e+" not in bad.output.splitlines()[0]                     # counts as integers
    j = json.loads(invoke("nan", runs["diverge"], "--format", "json").output)
    first = open_run(runs["diverge"]).first_nonfinite()
    assert (j["step"], j["layer"], j["kind"], j["nan"]) == (first.step, first.layer, first.kind,
                                                             first.nan)
    assert all(type(h["nan"]) is int for h in j["history"])
    assert invoke("nan", runs["stable"]).exit_code == 0
    assert json.loads(invoke("nan", runs["stable"], "--format", "json").output) is None
    p = script("nan", runs["diverge"])
    assert p.returncode == 1 and "first non-finite" in p.stdout


@pytest.mark.parametrize("kind", ["histogram", "evolution", "distribution"])
def test_plots_are_nonempty_pngs(runs, tmp_path, kind):
    out = tmp_path / f"{kind}.png"
    layer = "encoder.*" if kind == "evolution" else "encoder.layers.0.linear1"
    r = invoke("plot", runs["diverge"], "--layer", layer, "--type", kind, "-o", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_compare_exit_codes_json_and_aggregation(runs, tmp_path):
    r = invoke("compare", runs["stable"], runs["other"], "-o", str(tmp_path / "c.png"))
    assert r.exit_code == 1 and "first divergence: step 0" in r.output
    same = invoke("compare", runs["stable"], runs["stable"])
    assert same.exit_code == 0 and same.output.startswith("no divergence")
    j = json.loads(invoke("compare", runs["stable"], runs["other"], "--format", "json",
                          "--kind", "gradients", "--layer", "encoder.layers.1.*").output)
    assert j["first_divergence"]["kind"] == "gradients"
    assert j["first_divergence"]["layer"].startswith("encoder.layers.1.")
    assert set(j["layers"]) == {n for n in open_run(runs["stable"]).stats("gradients").layer.values
                               if n.startswith("encoder.layers.1.")}
    from tensortape.analysis import compare_runs
    ds = compare_runs(runs["stable"], runs["other"], kind="gradients", layers="encoder.layers.1.*")
    for layer, m in j["layers"].items():        # worst step of each: max rel_l2, min cosine
        assert m["rel_l2"] == float(ds["rel_l2"].sel(layer=layer).max())
        assert m["cosine"] == float(ds["cosine"].sel(layer=layer).min())
    p = script("export", runs["stable"], str(tmp_path / "s.h5"))
    assert p.returncode == 0 and script("info", str(tmp_path / "s.h5")).returncode == 0


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and r.output.startswith("tensortape, version ")


@pytest.mark.parametrize("args,needle", [
    (("info", "/nonexistent/run.zarr"), "no run at '/nonexistent/run.zarr'"),
    (("info", "NOTASTORE"), "is not a Zarr store"),
    (("plot", "STABLE", "--layer", "nope", "-o", "OUT/x.png"), "'nope'"),
    (("plot", "STABLE", "--layer", "encoder.*", "-o", "OUT/x.png"), "shows one layer"),
    (("plot", "STABLE", "--layer", "encoder.layers.0.linear1", "-o", "OUT/nodir/x.png"),
     "nodir/x.png'"),
    (("stats", "STABLE", "--format", "xml"), "--format"),
    (("stats", "STABLE", "--kind", "inputs"), "not recorded"),
    (("stats", "STABLE", "--kind", "activation"), "'activation' is not one of"),
    (("plot", "STABLE", "--layer", "x", "--stat", "sdt", "-o", "OUT/x.png"), "'sdt' is not one of"),
])
def test_user_errors_are_one_line_exit_2(runs, tmp_path, args, needle):
    os.makedirs(tmp_path / "plain", exist_ok=True)
    (tmp_path / "plain" / "notes.txt").write_text("not a run")
    args = [runs["stable"] if a == "STABLE" else str(tmp_path / "plain") if a == "NOTASTORE"
            else a.replace("OUT", str(tmp_path)) for a in args]
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    p = script(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_debug_shows_the_traceback(tmp_path):
    p = script("--debug", "info", str(tmp_path / "missing.zarr"))
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_demo_and_sample_scripts(tmp_path):
    p = script("demo", str(tmp_path / "demo.zarr"), "--steps", "5")
    assert p.returncode == 0 and "tensortape nan" in p.stdout
    q = subprocess.run([sys.executable, os.path.join(ROOT, "sample_runs", "seeds.py"),
                        str(tmp_path / "s"), "5"], capture_output=True, text=True)
    assert q.returncode == 0, q.stderr
    assert [open_run(str(tmp_path / "s" / f"seed{i}.zarr")).steps().tolist() for i in (0, 1)] \
        == [list(range(5))] * 2


def test_readme_python_snippet_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README must hold a Python snippet"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for code in blocks:
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    finally:
        os.chdir(cwd)
    assert os.path.isdir(tmp_path / "runs" / "exp1.zarr")


def test_export_refuses_an_existing_file_unless_forced(runs, tmp_path):
    out = tmp_path / "run.h5"
    out.write_bytes(b"precious")
    p = script("export", runs["stable"], str(out))
    assert p.returncode == 2 and "--force" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert out.read_bytes() == b"precious"
    p = script("export", runs["stable"], str(tmp_path / "nodir" / "run.h5"))
    assert p.returncode == 2 and "does not exist" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    p = script("export", runs["stable"], str(out), "--force")
    assert p.returncode == 0 and open_run(str(out)).layers == open_run(runs["stable"]).layers
    assert [f.name for f in tmp_path.iterdir()] == ["run.h5"]       # no partial file left


@pytest.mark.parametrize("args,code", [(("nan", "DIVERGE"), 1), (("nan", "STABLE"), 0),
                                       (("stats", "STABLE"), 0), (("info", "STABLE"), 0),
                                       (("--help",), 0), (("info", "--help"), 0),
                                       (("--version",), 0)])
def test_a_closed_stdout_keeps_the_exit_status(runs, args, code):
    """`tensortape nan RUN | head -1`: the reader goes away, the status stays."""
    args = [runs["diverge"] if a == "DIVERGE" else runs["stable"] if a == "STABLE" else a
            for a in args]
    p = subprocess.Popen([*tensortape(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT)
    p.stdout.close()             # like `| head -1`, and before anything is written
    with p.stderr:
        err = p.stderr.read().decode()
    assert p.wait(60) == code and "Broken pipe" not in err and "Error" not in err, err


PRINTS = """import torch
m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(3):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    print("step", i, flush=FLUSH)
"""


@pytest.mark.parametrize("flush,code,status", [(False, 0, "complete"), (True, 1, "interrupted")])
def test_a_closed_stdout_under_record_is_the_scripts_own(tmp_path, flush, code, status):
    """`tensortape record ... | head -1`: the script's prints meet the closed pipe as under
    python (sys.stdout is python's own): buffered ones are dropped at exit, a flushed one
    raises in the script; either way the status is the script's (never 120, a failed flush
    at exit) and the run is closed."""
    (tmp_path / "train.py").write_text(PRINTS.replace("FLUSH", str(flush)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    store = str(tmp_path / "run.zarr")
    p = subprocess.Popen([*tensortape(), "record", "-o", store, "--", "python", "train.py"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                         env=dict(env, TENSORTAPE_COMPILE="0"))
    p.stdout.close()
    with p.stderr:
        err = p.stderr.read().decode()
    assert p.wait(120) == code, err
    assert ("BrokenPipeError" in err) == flush and "Exception ignored" not in err, err
    assert open_run(store).status == status


def test_the_cli_imports_no_torch_unless_a_command_needs_it(runs):
    """`import cli`, the readers' --help and the readers themselves leave torch unloaded
    (only record, demo and replay need it); the CLI's names are the format's."""
    code = ("import sys, cli\n"
            "assert 'torch' not in sys.modules, 'import cli'\n"
            "stable, diverge = sys.argv[1:]\n"
            "for args, status in [(['info', '--help'], 0), (['stats', '--help'], 0),\n"
            "                     (['nan', '--help'], 0), (['info', stable], 0),\n"
            "                     (['stats', stable], 0), (['nan', diverge], 1)]:\n"
            "    try:\n"
            "        cli.main(args)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == status, (args, e.code)\n"
            "    assert 'torch' not in sys.modules, args\n")
    p = subprocess.run([sys.executable, "-c", code, runs["stable"], runs["diverge"]], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    from tensortape.recorder import format as fmt
    assert (cli.KINDS, cli.STATS) == (fmt.KINDS, fmt.STATS)
    assert set(fmt.COUNT_STATS) <= set(cli.INTEGERS)


def test_replay_imports_the_model_from_the_working_directory_and_leaves_sys_path(
        runs, tmp_path, monkeypatch):
    """--model pkg.module:factory is found in the working directory (as python -m finds
    it) while the command runs; sys.path is as it was after it."""
    (tmp_path / "tt_factory.py").write_text(
        "import os, pathlib, sys\n"
        "def build():\n"
        "    pathlib.Path('built').write_text(str(os.getcwd() in sys.path))\n")
    p = script("replay", runs["stable"], "--model", "tt_factory:build", cwd=tmp_path)
    assert p.returncode == 2 and "holds no replay bundle" in p.stderr, p.stderr  # built first
    assert (tmp_path / "built").read_text() == "True"
    (tmp_path / "built").unlink()
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    r = invoke("replay", runs["stable"], "--model", "tt_factory:build")
    assert r.exit_code == 2 and "holds no replay bundle" in r.output
    assert (tmp_path / "built").read_text() == "True" and sys.path == path
    sys.modules.pop("tt_factory", None)

