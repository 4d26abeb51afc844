"""The layers of the house, read from the import statements (``ast``):

- the reader (``analysis/``) and the command line (``cli.py``) import no private
  name of the recorder (``recorder._anything``, or a ``_name`` from a recorder
  module): what they use of it is public;
- the reader imports no torch when it is imported (no module-level ``import
  torch``, and none through what it imports: checked in a fresh interpreter);
- the recorder never imports the reader, xarray or matplotlib, anywhere.
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANALYSIS = sorted(f"analysis/{n}" for n in os.listdir(os.path.join(ROOT, "analysis"))
                  if n.endswith(".py"))
RECORDER = sorted(f"recorder/{n}" for n in os.listdir(os.path.join(ROOT, "recorder"))
                  if n.endswith(".py"))


def imports(relpath: str, module_level: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of each import in a file: ``import a.b`` gives ``a.b``,
    ``from a.b import c`` gives ``a.b.c``; relative imports are the package's own
    and are left out.  ``module_level``: only those run when the module is
    imported (not inside a function)."""
    with open(os.path.join(ROOT, relpath)) as f:
        tree = ast.parse(f.read(), relpath)
    found = []

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if module_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            walk(child)
    walk(tree)
    return found


def private_recorder(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "recorder" and any(p.startswith("_") for p in parts[1:])


def _where(relpath, hits):
    return [f"{relpath}:{line}: {name}" for line, name in hits]


@pytest.mark.parametrize("relpath", ANALYSIS)
def test_the_reader_imports_no_private_name_of_the_recorder(relpath):
    bad = [(line, n) for line, n in imports(relpath) if private_recorder(n)]
    assert not bad, _where(relpath, bad)


def test_the_command_line_imports_no_private_name_of_the_recorder():
    bad = [(line, n) for line, n in imports("cli.py") if private_recorder(n)]
    assert not bad, _where("cli.py", bad)


@pytest.mark.parametrize("relpath", ANALYSIS)
def test_the_reader_imports_no_torch_at_module_level(relpath):
    bad = [(line, n) for line, n in imports(relpath, module_level=True)
           if n.split(".")[0] == "torch"]
    assert not bad, _where(relpath, bad)


def test_importing_every_reader_module_imports_no_torch():
    modules = [p[:-3].replace("/", ".").removesuffix(".__init__") for p in ANALYSIS]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print([m for m in ('torch', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("relpath", RECORDER)
def test_the_recorder_never_imports_the_reader(relpath):
    bad = [(line, n) for line, n in imports(relpath)
           if n.split(".")[0] in ("analysis", "xarray", "matplotlib")]
    assert not bad, _where(relpath, bad)
