"""Layer patterns: which names one glob pattern or a list of them selects
(``match_layers``), and the names most like one that matched nothing
(``closest``), for the error that says so.

A pattern that is one of the names selects that name alone: a layer named
``*``, ``a?`` or ``b[0]`` is selected by its name (and its glob reading,
``[*]``, selects it too); any other pattern follows ``fnmatch`` rules,
case-sensitive.

Public: the recorder selects modules with it (``_selection``), the reader the
layers of a run.  No torch, no state; any thread.
"""

from __future__ import annotations

import difflib
import fnmatch

from .errors import LayerNotFoundError

__all__ = ["closest", "match_layers"]


def closest(name: str, names: list[str]) -> str:
    """The few names most like ``name``, for error messages."""
    shown = [n if n else '"" (the root)'
             for n in difflib.get_close_matches(name, names, n=3, cutoff=0.3)]
    return ", ".join(shown or [n for n in names if n][:3]) or "none"


def match_layers(names: list[str], layers, what: str = "module", strict: bool = True) -> list[str]:
    """The names selected by one pattern or a list of them (a name itself, else a
    glob: see the module), in the order of ``names``.  ``strict``: every pattern
    must select something, or ``LayerNotFoundError`` names it and the closest
    names."""
    patterns = [layers] if isinstance(layers, str) else list(layers)
    held = set(names)
    chosen: set[str] = set()
    for p in patterns:
        if not isinstance(p, str):
            raise LayerNotFoundError(f"layer pattern {p!r} is not a string; pass glob patterns "
                                     f"like 'encoder.*'")
        hits = [p] if p in held else [n for n in names if fnmatch.fnmatchcase(n, p)]
        if not hits and strict:
            raise LayerNotFoundError(f"layer pattern {p!r} matches no {what}; closest names: "
                                     f"{closest(p, names)}")
        chosen.update(hits)
    return [n for n in names if n in chosen]
