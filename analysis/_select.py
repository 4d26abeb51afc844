"""Choosing what to read: steps by a half-open slice, layer columns by glob
patterns, and the words for what is not there."""

from __future__ import annotations

import fnmatch

import numpy as np

from tensortape.recorder.errors import ConfigError
from tensortape.recorder.format import KINDS
from tensortape.recorder.patterns import closest, match_layers

__all__ = ["columns_of", "missing", "steps_text", "within"]


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


def columns_of(names: list[str], layers, strict: bool = True) -> list[int]:
    """The columns of ``names`` that ``layers`` (glob patterns) match; ``strict``:
    each pattern must match one of them (not so for one rank of several, whose
    patterns may match another rank's layers: a pipeline stage elsewhere)."""
    if layers is None:
        return list(range(len(names)))
    if strict:
        chosen = set(match_layers(names, layers, what="layer with statistics"))
    else:
        patterns = [layers] if isinstance(layers, str) else list(layers)
        chosen = {n for n in names if any(n == p or fnmatch.fnmatchcase(n, p)
                                          for p in patterns)}
    return [i for i, n in enumerate(names) if n in chosen]


def missing(layer: str, names: list[str], what: str) -> str:
    """The words for a layer that has no ``what``: the closest names it has (and,
    for a kind passed where a layer goes, how to pass it)."""
    hint = (f" ({layer!r} is a kind: pass the layer first and kind={layer!r}, e.g. "
            f"histogram({(names or ['layer'])[0]!r}, kind={layer!r}))" if layer in KINDS else "")
    return f"layer {layer!r} has no {what} in this run; closest: {closest(layer, names)}{hint}"
