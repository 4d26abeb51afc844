"""What two runs share (layers, steps, statistics) and whether they are alike
enough to compare: model classes, recorded layers, each shared layer's shape."""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import ConfigError
from tensortape.recorder.patterns import match_layers

from ._run import Run, open_run
from ._select import Names, chosen, layer_coord

__all__ = ["absent", "apart", "no_common", "runs", "say", "shared", "unlike"]


def runs(a, b, rank: int | None) -> tuple[Run, Run]:
    """The two runs, each narrowed to one rank: ``rank``, or each run's first."""
    out = []
    for r in (open_run(a), open_run(b)):
        if rank is not None or len(r.ranks) > 1:
            r = r.only(r.ranks[0] if rank is None else rank)
        out.append(r)
    return out[0], out[1]


def shared(a: Run, b: Run, kind: str, layers, strict: bool, shapes: bool = True):
    """What both runs hold of ``kind``, each run's statistics read once: the shared
    layers (in ``a``'s order) alike in shape and the common steps, what makes the
    runs unlike (short clauses), and, where they share any, both runs' statistics
    there (``_both_stats``; else None).  ``shapes``: the full tensors' shapes are
    checked too (else only the element counts of the statistics: no tensor table
    is read; ``apart`` checks them later).  ``strict``: unlike runs raise
    ``ConfigError``."""
    full = [r.stats(kind, lazy=False) if kind in r.kinds else None for r in (a, b)]
    names, steps = _common(a, b, kind, layers, full)
    notes = _held(a, b, layers, full)
    bad = _counts(names, steps, full)
    if shapes:
        bad.update(apart(a, b, kind, [n for n in names if n not in bad]))
    if bad:
        bad = {n: bad[n] for n in names if n in bad}
        notes.append(shape_note(bad))
    if notes and strict:
        raise ConfigError(f"{unlike(a, b, notes)}; refused (strict)")
    names = [n for n in names if n not in bad]
    both = _both_stats(a, b, kind, names, steps, full) if names and len(steps) else None
    return names, steps, notes, both


def _names(st: xr.Dataset | None) -> list[str]:
    return [] if st is None else st.layer.values.tolist()


def _common(a: Run, b: Run, kind: str, layers, full) -> tuple[list[str], np.ndarray]:
    """The layers (in ``a``'s order) and steps of ``kind`` that both runs hold (of
    their statistics, ``full``).  The roots of two different model classes are
    not the same layer."""
    named = [_names(f) if layers is None or f is None else list(chosen(_names(f), layers))
             for f in full]
    names = [n for n in named[0] if n in set(named[1])]
    if a.attrs.get("model_class") != b.attrs.get("model_class"):
        names = [n for n in names if n != fmt.ROOT_LABEL]
    steps = np.intersect1d(a.steps(kind), b.steps(kind)) if names else np.zeros(0, np.int64)
    return names, steps


def _some(names, most: int = 2, sep: str = ", ") -> str:
    """A few example names and how many more: ``a, b and 5 more``."""
    names = list(names)
    head = sep.join(names[:most])
    return head + (f" and {len(names) - most} more" if len(names) > most else "")


def _held(a: Run, b: Run, layers, full) -> list[str]:
    """What differs of the model classes and the recorded layer sets (those
    ``layers`` matches), in short clauses."""
    notes = []
    ca, cb = a.attrs.get("model_class"), b.attrs.get("model_class")
    if ca != cb:
        notes.append(f"model classes differ ({ca} vs {cb})")
    held = [_names(f) for f in full]
    if layers is not None:
        held = [match_layers(h, layers, strict=False) for h in held]
    only = [[n for n in held[i] if n not in set(held[1 - i])] for i in (0, 1)]
    if only[0] or only[1]:
        notes.append("recorded layers differ (" + "; ".join(
            f"{len(o)} only in {r.name}: {_some(o)}" for r, o in zip((a, b), only) if o) + ")")
    return notes


def _counts(names: list[str], steps, full) -> dict[str, str]:
    """The shared layers whose element counts differ at a common step where both
    ran: name -> what differs."""
    bad = {}
    if names and len(steps):
        ca, cb = (f["count"].sel(step=steps, layer=layer_coord(names)).values for f in full)
        differ = (ca >= 0) & (cb >= 0) & (ca != cb)
        for j in np.flatnonzero(differ.any(axis=0)):
            i = int(np.flatnonzero(differ[:, j])[0])
            bad[names[j]] = (f"{names[j]}: {int(ca[i, j])} and {int(cb[i, j])} elements at "
                             f"step {int(steps[i])}")
    return bad


def apart(a: Run, b: Run, kind: str, names: list[str]) -> dict[str, str]:
    """Of ``names``, those whose full tensors both runs hold in other shapes (past
    the step, the largest recorded): name -> what differs."""
    held = [set(r.tensor_layers(kind)) for r in (a, b)]
    bad = {}
    for n in names:
        if n in held[0] and n in held[1]:
            sa, sb = a.tensor_shape(n, kind), b.tensor_shape(n, kind)
            if sa != sb:
                bad[n] = f"{n}: shapes {sa} and {sb}"
    return bad


def shape_note(bad: dict[str, str]) -> str:
    """The clause of the shared layers that differ in shape."""
    return (f"{len(bad)} shared layer{'s differ' if len(bad) > 1 else ' differs'} in shape "
            f"({_some(bad.values(), sep='; ')})")


def unlike(a: Run, b: Run, notes: list[str]) -> str | None:
    return f"{a.name} and {b.name} are not alike: {'; '.join(notes)}" if notes else None


def say(text: str | None, stacklevel: int = 3) -> None:
    """What makes two runs unlike, once, where something is still compared (a
    warning of the caller ``stacklevel`` frames up)."""
    if text:
        import warnings
        from tensortape.recorder.errors import TensortapeWarning
        warnings.warn(f"tensortape: {text}; comparing only the shared layers whose shapes "
                      f"agree", TensortapeWarning, stacklevel=stacklevel)


def no_common(a: Run, b: Run, kinds, layers, notes=()) -> ConfigError:
    """Why two runs cannot be compared, in one short line: what differs (``notes``,
    from ``shared``), else a few of the layers each run holds."""
    where = f" matching {layers!r}" if layers else ""
    if notes:
        why = "; ".join(notes)
    else:
        why = "; ".join(f"{r.name} has {len(r.layers)} layers ({_some(r.layers) or 'none'})"
                        for r in (a, b))
    shape = " of the same shape" if any("in shape" in n for n in notes) else ""
    return ConfigError(f"{a.name} and {b.name} are not comparable: {why}; they share no recorded "
                       f"layer of {', '.join(kinds)}{where}{shape} with common steps (pick "
                       f"--kind/--layer that both hold)")


def absent(st: xr.Dataset) -> xr.DataArray:
    """Where a layer did not run (an expert with no tokens): its count is -1."""
    return st["count"] < 0


def _both_stats(a: Run, b: Run, kind: str, names: list[str], steps, full):
    """Both runs' statistics (of ``full``) of ``names`` at ``steps``, and where
    either reads them as missing because their chunk is missing from its store
    (``Run.damaged``): damage is no difference, and is not compared."""
    sa, sb = (f.sel(step=steps, layer=layer_coord(names)) for f in full)
    names = Names(names)
    unread = a.damaged(kind, names).sel(step=steps) | b.damaged(kind, names).sel(step=steps)
    return sa, sb, unread
