"""The house rules, measured on the tree with ``ast`` (the package's modules: the root's
``__init__``/``__main__``/``cli``, ``recorder/``, ``analysis/``, ``sample_runs/``):

- no folder holds over 20 modules (``__init__.py`` counted);
- no module is over 400 lines (``cli.py`` up to 1,000), no class over 250;
- no import cycle among the package's modules: the graph of the imports run when a
  module is imported (module level, ``if TYPE_CHECKING:`` left out; an import inside a
  function runs at its call, after every module is loaded, and is left out);
- no two classes of one name in ``recorder`` (its subpackages included), nor in ``analysis``;
- ``recorder`` never imports ``analysis``, xarray, matplotlib or click, anywhere;
  ``analysis`` and ``cli`` never import torch at module level.

Where the tree breaks a rule today, ``EXCEPTIONS`` names the place and why: a listed
exception that no longer breaks the rule fails too, so the list only shrinks.
"""
import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULES, MAX_LINES, MAX_CLI_LINES, MAX_CLASS_LINES = 20, 400, 1000, 250

# (rule, place) -> why it is allowed for now
EXCEPTIONS = {
    ("lines", "recorder/format.py"): "the whole on-disk schema in one public module",
    ("lines", "recorder/hooks/_hooks.py"): "HookSet and the hook classes it alone registers",
    ("lines", "recorder/capture/_summary.py"): "the summary kernels and their host-side "
                                                "statistics: one pure vector layout",
    ("lines", "recorder/capture/_nbkernels.py"): "numba's kernels compile as one cached module",
    ("class", "recorder/_recorder.py:Recorder"): "the user's handle; 63 lines are its "
                                                  "parameters' docstring",
    ("class", "recorder/store/_ranklog.py:RankLog"): "the one owner of a rank's durable state: "
                                                     "open, bookkeeping, journal, fenced commit",
    ("class", "analysis/_index.py:RunIndex"): "a run's attributes, ranks' committed state and "
                                             "tables' checks, read once and cached together",
    ("class", "analysis/_run.py:Run"): "the facade: one short method per read, over the rooms",
}


def package_files(root: str = ROOT) -> list[str]:
    """The package's modules, as paths relative to ``root``."""
    found = [n for n in ("__init__.py", "__main__.py", "cli.py")
             if os.path.isfile(os.path.join(root, n))]
    for top in ("recorder", "analysis", "sample_runs"):
        for folder, subdirs, names in os.walk(os.path.join(root, top)):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            found += sorted(os.path.relpath(os.path.join(folder, n), root)
                            for n in names if n.endswith(".py"))
    return found


def parse(relpath: str, root: str = ROOT) -> ast.Module:
    with open(os.path.join(root, relpath), encoding="utf-8") as f:
        return ast.parse(f.read(), relpath)


def module_name(relpath: str) -> str:
    parts = relpath[:-3].split(os.sep)
    return ".".join(["tensortape", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def module_level(tree: ast.AST):
    """The nodes run when the module is imported: not inside a function, nor under
    ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for node in child.orelse:
                yield node
                yield from module_level(node)
            continue
        yield child
        yield from module_level(child)


def imported(relpath: str, tree: ast.AST, nodes) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of each import among ``nodes``: relative ones resolved
    (``from .x import y`` in ``tensortape.recorder`` is ``tensortape.recorder.x``, ``y``)."""
    package = module_name(relpath) if relpath.endswith("__init__.py") else \
        module_name(relpath).rpartition(".")[0]
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, base, a.name) for a in node.names]
    return found


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports when it is imported."""
    files = package_files(root)
    modules = {module_name(f) for f in files}
    graph = {}
    for f in files:
        tree = parse(f, root)
        edges = set()
        for _, base, name in imported(f, tree, module_level(tree)):
            target = f"{base}.{name}" if name and f"{base}.{name}" in modules else base
            if target in modules and target != module_name(f):
                edges.add(target)
        graph[module_name(f)] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@functools.lru_cache(maxsize=None)
def broken(root: str = ROOT) -> dict[tuple[str, str], str]:
    """(rule, place) -> what breaks it, for every house rule."""
    found = {}
    files = package_files(root)
    folders = {}
    for f in files:
        folders.setdefault(os.path.dirname(f) or ".", []).append(f)
    for folder, members in folders.items():
        if len(members) > MAX_MODULES:
            found[("folder", folder)] = f"{len(members)} modules (at most {MAX_MODULES})"
    classes = {}
    for f in files:
        tree = parse(f, root)
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            lines = len(fh.read().splitlines())
        limit = MAX_CLI_LINES if f == "cli.py" else MAX_LINES
        if lines > limit:
            found[("lines", f)] = f"{lines} lines (at most {limit})"
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found[("class", f"{f}:{node.name}")] = f"{size} lines (at most {MAX_CLASS_LINES})"
                classes.setdefault((f.split(os.sep)[0], node.name), []).append(f)
        top = f.split(os.sep)[0]
        everywhere = imported(f, tree, ast.walk(tree))
        at_import = imported(f, tree, module_level(tree))
        for line, base, name in everywhere:
            full = f"{base}.{name}" if name else base
            if top == "recorder" and (base.split(".")[0] in ("xarray", "matplotlib", "click")
                                      or full.startswith("tensortape.analysis")):
                found[("layer", f"{f}:{line}")] = f"the recorder imports {full}"
        for line, base, name in at_import:
            if (top == "analysis" or f == "cli.py") and base.split(".")[0] == "torch":
                found[("layer", f"{f}:{line}")] = "torch imported at module level"
    for (top, name), where in classes.items():
        if len(where) > 1 and top in ("recorder", "analysis"):
            found[("class name", f"{top}:{name}")] = f"defined in {', '.join(sorted(where))}"
    for part in cycles(import_graph(root)):
        found[("cycle", " ".join(part))] = "these modules import each other when imported"
    return found


def test_the_tree_keeps_the_house_rules():
    found = broken()
    new = {k: v for k, v in found.items() if k not in EXCEPTIONS}
    assert not new, "\n".join(f"{rule}: {place}: {why}" for (rule, place), why in new.items())


@pytest.mark.parametrize("key", sorted(EXCEPTIONS))
def test_every_exception_is_still_needed(key):
    assert key in broken(), f"{key} keeps the rule now: remove it from EXCEPTIONS"
