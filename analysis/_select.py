"""Choosing what to read: steps by a half-open slice, layer columns by patterns
(``tensortape.recorder.patterns``: a layer's own name, else a glob) or, for
tensortape's own readers, by exact names (``Names``), and the words for what is
not there.  Layer names as a coordinate (``layer_coord``) are Python strings, so any
name (a trailing NUL too) reads back equal."""

from __future__ import annotations

import numpy as np

from tensortape.recorder.errors import ConfigError, LayerNotFoundError
from tensortape.recorder.format import KINDS
from tensortape.recorder.patterns import closest, match_layers

__all__ = ["Names", "chosen", "columns_of", "layer_coord", "missing", "one_layer", "steps_text",
           "within"]


class Names(tuple):
    """Layer names, each meant exactly, never as a pattern: how tensortape's own
    readers ask for the layers they name (``run.stats(kind, Names([layer]))``)."""


def layer_coord(layers) -> np.ndarray:
    """Layer names as a ``layer`` coordinate: an object array of the strings
    themselves (numpy's fixed-width strings drop a trailing NUL)."""
    out = np.empty(len(layers), object)
    out[:] = list(layers)
    return out


def one_layer(ds):
    """``ds`` of one layer without its ``layer`` dimension, the scalar ``layer``
    coordinate the name itself (xarray's ``isel`` makes it a fixed-width string)."""
    name = np.empty((), object)
    name[()] = ds.layer.values[0]
    return ds.isel(layer=0).assign_coords(layer=name)


def within(obj, steps: slice | None):
    """``obj`` at the steps of the half-open slice ``steps`` (None: all)."""
    if steps is None:
        return obj
    have = obj.step.values
    keep = np.ones(len(have), bool)
    if steps.start is not None:
        keep &= have >= steps.start
    if steps.stop is not None:
        keep &= have < steps.stop
    if not keep.any():
        raise ConfigError(f"no steps in {steps.start}:{steps.stop}; the run has {steps_text(have)}")
    return obj.isel(step=np.nonzero(keep)[0])


def steps_text(steps) -> str:
    """Steps in words: ``steps 0-39 (40)``, ``4 steps (0, 10, 20, 30)``, ``no steps``."""
    steps = [int(x) for x in steps]
    if not steps:
        return "no steps"
    if len(steps) > 2 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]} ({len(steps)})"
    shown = ", ".join(map(str, steps[:6])) + (f", ..., {steps[-1]}" if len(steps) > 6 else "")
    return f"{len(steps)} step{'s' if len(steps) > 1 else ''} ({shown})"


def chosen(held: list[str], layers, what: str = "layer with statistics") -> Names:
    """The names of ``held`` that ``layers`` selects, in their order: ``Names`` as
    they are (each must be held), else patterns (``match_layers``: each must
    select one)."""
    if isinstance(layers, Names):
        for n in layers:
            if n not in held:
                raise LayerNotFoundError(missing(n, held, "statistics"))
        return Names(n for n in held if n in set(layers))
    return Names(match_layers(held, layers, what=what))


def columns_of(held: list[str], layers, strict: bool = True) -> list[int]:
    """The columns of ``held`` that ``layers`` selects (``chosen``); not ``strict``
    (``Names`` of one rank of several, which may be another rank's layers: a
    pipeline stage elsewhere), those of them it holds."""
    if layers is None:
        return list(range(len(held)))
    keep = set(chosen(held, layers) if strict else layers)
    return [i for i, n in enumerate(held) if n in keep]


def missing(layer: str, names: list[str], what: str) -> str:
    """The words for a layer that has no ``what``: the closest names it has (and,
    for a kind passed where a layer goes, how to pass it)."""
    hint = (f" ({layer!r} is a kind: pass the layer first and kind={layer!r}, e.g. "
            f"histogram({(names or ['layer'])[0]!r}, kind={layer!r}))" if layer in KINDS else "")
    return f"layer {layer!r} has no {what} in this run; closest: {closest(layer, names)}{hint}"
