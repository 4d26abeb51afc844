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


def _modules(top: str) -> list[str]:
    """Every module under ``top``, its subpackages included."""
    return sorted(os.path.relpath(os.path.join(d, n), ROOT)
                  for d, _, names in os.walk(os.path.join(ROOT, top)) for n in names
                  if n.endswith(".py"))


ANALYSIS = _modules("analysis")
RECORDER = _modules("recorder")


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
    return parts[:2] == ["tensortape", "recorder"] and any(p.startswith("_") for p in parts[2:])


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
    modules = ["tensortape." + p[:-3].replace("/", ".").removesuffix(".__init__")
               for p in ANALYSIS]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print([m for m in ('torch', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("relpath", RECORDER)
def test_the_recorder_never_imports_the_reader(relpath):
    bad = [(line, n) for line, n in imports(relpath)
           if n.split(".")[0] in ("xarray", "matplotlib")
           or n.split(".")[:2] == ["tensortape", "analysis"]]
    assert not bad, _where(relpath, bad)


# --- privates stay in their module ---------------------------------------------------
# The private names of torch, zarr and the standard library that tensortape must use
# (no public spelling exists); each says why.
FOREIGN_PRIVATES = {
    "_C",                   # torch._C: the autograd engine's graph-task id, dispatch keys
    "_dynamo",              # torch._dynamo: telling Dynamo which code to recompile
    "_getframe",            # sys._getframe: the caller's frame (user code for replay)
    "_register_atexit",     # threading._register_atexit: before the interpreter joins threads
    "_replace", "_fields", "_asdict", "_make",     # namedtuple's public API
    "_current_graph_task_id", "_current_autograd_node",   # torch._C: the engine's state
    "_version",             # a tensor's version counter: in-place writes after a capture
    "_call_impl",           # nn.Module._call_impl: compiled code's guard on the hooks
    "_forward_hooks", "_forward_pre_hooks",                 # a module's hook dicts and
    "_global_forward_hooks", "_global_forward_pre_hooks",   # torch's global ones: who
    #                         registered a torch.distributed hook (_collectives)
    "_schema",              # an OpOverload's schema: the op's name (replay's dispatch mode)
    "_call_s3",             # s3fs: reading the lock object with the call the store makes
    "_cache",               # a numba dispatcher's disk cache: where its compiled kernels are
    "_nn",                  # torch._C._nn.flatten_dense_tensors: a step's tiny tensors made one
    #                         vector in one call (what DDP's buckets use), not a reshape each
    "_register_hook_dict",  # grad_fn's hook dict of a tensor: what Tensor.register_hook fills,
    #                         without the handle nobody removes (_hooks._hold)
    "_is_torch_function_mode_enabled",  # torch._C: a TorchFunctionMode is active, so a
    #                         gradient hook goes through Tensor.register_hook (_hooks._hold)
    "_cdata",               # a storage's handle: how many tensors share it, which torch says
    #                         (torch._C._storage_Use_Count), before a buffer is reused (_hostpool)
}


def _own_privates(tree) -> set[str]:
    """The private names a module defines: functions, classes, module-level names,
    and attributes it assigns (``self._x = ...``, ``obj._x = ...``)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return {n for n in own if n.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_privates(relpath: str) -> list[tuple[int, str]]:
    """(line, text) of each private name this module reads of another module or of an
    object another module defines: ``x._name`` (``x`` not ``self``/``cls``) where
    ``_name`` is not defined here, and ``from .m import _name`` of a name (not a
    private module).  Dunders and ``FOREIGN_PRIVATES`` are allowed."""
    with open(os.path.join(ROOT, relpath)) as f:
        tree = ast.parse(f.read(), relpath)
    own = _own_privates(tree)
    package = os.path.dirname(os.path.join(ROOT, relpath))
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if node.attr in own or node.attr in FOREIGN_PRIVATES:
                continue
            hits.append((node.lineno, f"{ast.unparse(base)}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom):
            folder = package
            for _ in range(node.level - 1):
                folder = os.path.dirname(folder)
            folder = folder if node.level else ROOT
            sub = (node.module or "").removeprefix("tensortape").lstrip(".").replace(".", os.sep)
            for a in node.names:
                if not _private(a.name) or a.name in FOREIGN_PRIVATES:
                    continue
                where = os.path.join(folder, sub, a.name)
                if os.path.exists(where + ".py") or os.path.exists(os.path.join(where, "__init__.py")):
                    continue                        # a private module (or package) of the package
                hits.append((node.lineno, f"from {'.' * node.level}{node.module or ''} "
                                          f"import {a.name}"))
    return hits


@pytest.mark.parametrize("relpath", ANALYSIS + RECORDER + ["cli.py"])
def test_no_module_reads_another_module_s_private_names(relpath):
    hits = foreign_privates(relpath)
    assert not hits, _where(relpath, hits)


# --- one installed name -----------------------------------------------------------------
SOURCES = sorted(os.path.relpath(os.path.join(d, n), ROOT)
                 for top in ("recorder", "analysis", "sample_runs", "tests", "bench")
                 for d, _, names in os.walk(os.path.join(ROOT, top)) for n in names
                 if n.endswith(".py")) + ["cli.py", "__init__.py", "__main__.py"]


@pytest.mark.parametrize("relpath", SOURCES)
def test_every_import_of_tensortape_names_the_one_installed_package(relpath):
    """Installed, the repository's folders are ``tensortape.recorder``,
    ``tensortape.analysis``, ``tensortape.cli`` and ``tensortape.sample_runs``: a
    bare ``import analysis`` would find a user's own ``analysis.py`` instead."""
    bare = [(line, n) for line, n in imports(relpath)
            if n.split(".")[0] in ("recorder", "analysis", "cli", "sample_runs")]
    assert not bare, _where(relpath, bare)
