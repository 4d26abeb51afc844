"""Installed, tensortape is one package: the wheel holds ``tensortape`` and its
dist-info and nothing else, and a user's project with its own ``analysis.py``,
``recorder.py`` and ``cli.py`` records and reads a run through it."""
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    # a copy of the tracked tree, so the build leaves nothing in the checkout
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(src / os.path.dirname(f), exist_ok=True)
            with open(os.path.join(ROOT, f), "rb") as a, open(src / f, "wb") as b:
                b.write(a.read())
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = [out / n for n in os.listdir(out) if n.endswith(".whl")]
    return whl


def test_the_wheel_installs_one_top_level_name(wheel):
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tensortape"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    for part in ("tensortape/__main__.py", "tensortape/cli.py", "tensortape/recorder/__init__.py",
                 "tensortape/analysis/__init__.py", "tensortape/analysis/browser/static/index.html",
                 "tensortape/sample_runs/task.py", "tensortape/analysis/browser/static/vendor/uPlot.iife.min.js",
                 "tensortape/analysis/browser/static/vendor/uPlot.min.css",
                 "tensortape/analysis/browser/static/vendor/uPlot.LICENSE"):
        assert part in names


def test_the_wheel_holds_every_module_of_every_subpackage(wheel):
    """Each folder of the package (``recorder/store``, ``analysis/browser``, ...) is
    listed in ``pyproject.toml``: a folder left out would install without its modules."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "recorder", "analysis", "sample_runs"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    modules = {f"tensortape/{f}" for f in tracked if f.endswith(".py")
               and os.path.isfile(os.path.join(ROOT, f))}
    assert any(m.count("/") > 2 for m in modules)       # the subpackages are there to check
    missing = modules - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, sorted(missing)


USER_SCRIPT = textwrap.dedent("""
    import sys, torch
    import analysis, recorder, cli                      # the user's own modules
    assert (analysis.MINE, recorder.MINE, cli.MINE) == ("analysis", "recorder", "cli")
    import tensortape
    assert tensortape.__file__.startswith(sys.argv[2]), tensortape.__file__
    from tensortape import Recorder, open_run
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with Recorder(model, sys.argv[1], capture="activations", stats_every=1) as rec:
        for i in range(3):
            with rec.step(i):
                model(torch.full((2, 4), float(i)))
    run = open_run(sys.argv[1])
    assert run.steps().tolist() == [0, 1, 2], run.steps()
    print("recorded", run.layers)
""")


def test_a_project_with_its_own_analysis_py_records_and_reads_through_the_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    py = str(venv / "bin" / "python")
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not {"recorder", "analysis", "cli", "cli.py", "sample_runs"} & set(os.listdir(site))
    project = tmp_path / "project"
    project.mkdir()
    for name in ("analysis", "recorder", "cli"):
        (project / f"{name}.py").write_text(f"MINE = {name!r}\n")
    (project / "train.py").write_text(USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = str(project / "run.zarr")
    p = subprocess.run([py, "train.py", run, site], cwd=project, capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "recorded" in p.stdout
    for cmd in ([py, "-m", "tensortape", "info", run], [str(venv / "bin" / "tensortape"), "info", run]):
        p = subprocess.run(cmd, cwd=project, capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "complete" in p.stdout, p.stdout
