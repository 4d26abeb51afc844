"""The helpers the pictures share (``_plots`` and ``_plot_histogram`` both import
them; neither imports the other at module level): tick values and labels of a
symmetric-log axis, wrapped titles, the non-finite counts' names, and the last
step of a histogram with finite values.  Runs on the caller's thread."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["NONFINITE", "decade_ticks", "last_finite_step", "value_text", "wrap"]

NONFINITE = ("nan", "posinf", "neginf")


def wrap(text: str, width: int) -> str:
    """``text`` on lines of at most ``width`` characters, broken after a ``.``, ``:``,
    ``_``, ``/``, ``-`` or space where it can be, mid-word where it must; every
    character kept (joining the lines gives ``text`` back)."""
    lines, line = [], ""
    for piece in re.split(r"(?<=[.:_/ -])", str(text)):
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
        while len(line) > width:
            lines.append(line[:width])
            line = line[width:]
    return "\n".join(lines + [line] if line or not lines else lines)


def value_text(v: float) -> str:
    """A tick's value, short: 0, 0.01, 1, 100, 1e-5, 1e6."""
    return "0" if v == 0 else f"{v:g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def decade_ticks(linthresh: float, lo: float, hi: float, most: int = 9) -> list[float]:
    """0 and clean powers of ten on each occupied side of a symmetric-log axis,
    thinned to at most ``most`` ticks, none inside the linear region nor at its
    edge (whose label would run into 0's)."""
    top = np.log10(max(abs(lo), abs(hi), linthresh))
    decades = np.arange(np.ceil(np.log10(linthresh)) + 1, np.floor(top) + 1)  # none at ±linthresh
    sides = [s for s, ok in ((1, hi > 0), (-1, lo < 0)) if ok]
    step = max(1, int(np.ceil(len(decades) * len(sides) / max(most - 1, 1))))
    decades = decades[::-1][::step][::-1]                       # keep the largest decade
    return sorted({0.0} | {s * 10.0 ** d for d in decades for s in sides})


def last_finite_step(h) -> int | None:
    """The last step of a histogram (``Run.histogram``) that holds finite values (a
    step where the layer did not run holds -1 in every bin)."""
    finite = h.clip(min=0).sum("bin").values > 0
    steps = h.step.values[finite]
    return int(steps[-1]) if len(steps) else None
