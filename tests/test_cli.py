"""The command line, in-process (CliRunner) and as the installed script."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import cli
from analysis import open_run
from sample_runs.task import record

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
    return CliRunner().invoke(cli.cli, list(args))


def script(*args):
    exe = shutil.which("tensortape")
    cmd = [exe, *args] if exe else [sys.executable, os.path.join(ROOT, "cli.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_info_stats_and_json(runs):
    r = invoke("info", runs["stable"])
    assert r.exit_code == 0 and "status   complete" in r.output and "encoder.layers.0.linear1" in r.output
    run = open_run(runs["stable"])
    layer = "encoder.layers.0.linear1"
    decoded = run.tensor(layer).nbytes          # every stored step, as decoded
    row = next(line for line in r.output.splitlines() if line.startswith(layer + " "))
    assert f"T {decoded / 1e6:.1f}MB" in row or f"T {decoded / 1e3:.0f}kB" in row
    r = invoke("stats", runs["stable"], "--layer", "encoder.*", "--format", "json", "--step", "5")
    rows = json.loads(r.output)
    assert rows and all(row["step"] == 5 and row["layer"].startswith("encoder.") for row in rows)
    r = invoke("stats", runs["stable"], "--kind", "gradients", "--format", "csv")
    assert r.exit_code == 0 and r.output.splitlines()[0].startswith("step,layer,count,mean")


def test_nan_exit_codes(runs):
    bad = invoke("nan", runs["diverge"])
    assert bad.exit_code == 1 and "first non-finite: step" in bad.output
    assert invoke("nan", runs["stable"]).exit_code == 0
    p = script("nan", runs["diverge"])
    assert p.returncode == 1 and "first non-finite" in p.stdout


@pytest.mark.parametrize("kind", ["histogram", "evolution", "distribution"])
def test_plots_are_nonempty_pngs(runs, tmp_path, kind):
    out = tmp_path / f"{kind}.png"
    layer = "encoder.*" if kind == "evolution" else "encoder.layers.0.linear1"
    r = invoke("plot", runs["diverge"], "--layer", layer, "--type", kind, "-o", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_compare_and_export(runs, tmp_path):
    r = invoke("compare", runs["stable"], runs["other"], "-o", str(tmp_path / "c.png"))
    assert r.exit_code == 0 and "first divergence: step 0" in r.output
    assert invoke("compare", runs["stable"], runs["stable"]).output.startswith("no divergence")
    p = script("export", runs["stable"], str(tmp_path / "s.h5"))
    assert p.returncode == 0 and script("info", str(tmp_path / "s.h5")).returncode == 0


@pytest.mark.parametrize("args,needle", [
    (("info", "/nonexistent/run.zarr"), "no run at"),
    (("info", "NOTASTORE"), "not a"),
    (("plot", "STABLE", "--layer", "nope", "-o", "x.png"), "'nope'"),
    (("stats", "STABLE", "--format", "xml"), "--format"),
    (("stats", "STABLE", "--kind", "inputs"), "not recorded"),
])
def test_user_errors_are_one_line_exit_2(runs, tmp_path, args, needle):
    os.makedirs(tmp_path / "plain", exist_ok=True)
    args = [runs["stable"] if a == "STABLE" else str(tmp_path / "plain") if a == "NOTASTORE" else a
            for a in args]
    p = script(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr


def test_demo_and_sample_scripts(tmp_path):
    p = script("demo", str(tmp_path / "demo.zarr"), "--steps", "5")
    assert p.returncode == 0 and "tensortape nan" in p.stdout
    q = subprocess.run([sys.executable, os.path.join(ROOT, "sample_runs", "seeds.py"), str(tmp_path / "s")],
                       capture_output=True, text=True)
    assert q.returncode == 0 and os.path.isdir(tmp_path / "s" / "seed1.zarr")


def test_readme_python_snippet_runs(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
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
