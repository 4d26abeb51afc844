"""The histogram picture: one layer's counts at some steps, drawn so that its
shape is the data's.

The stored bins are the recorder's codes: four per power of two on each side of
zero (``recorder.format.bin_edges``), narrow near zero and wide far from it.
Bars of counts per such bin invent a shape (a Gaussian drawn as two humps), so
each bar is a density in the drawn coordinate, and its area is its share of
the step's finite values:

- ``scale="linear"`` (the default): a linear value axis, count / (total x width),
  the density per unit of value; a Gaussian is one bell.
- ``scale="symlog"``: a symmetric-log value axis (linear within +-``linthresh``),
  the density per decade of |value|, for heavy tails; a log-normal is one bell.

Neighbouring bins narrower than 1/``RESOLUTION`` of the drawn range are summed
into one bar, so that no bar is thinner than the eye sees.  Values that have
no density (exact zeros; a step whose values are all one number) are point
masses, drawn as labelled vertical lines; NaN, +Inf and -Inf as bars of counts
in a panel beside, never as values.
"""

from __future__ import annotations

import math

import numpy as np

from ._axes import NONFINITE, decade_ticks, last_finite_step, value_text, wrap

__all__ = ["SCALES", "histogram", "layout"]

SCALES = ("linear", "symlog")
RESOLUTION = 120                 # the narrowest bar: this fraction of the drawn range
LINSCALE = 0.5                   # matplotlib's linscale of the symmetric-log axis
_LINADJ = LINSCALE / (1 - 1 / 10)  # the width (in decades) of [0, linthresh] on that axis


def to_axis(x, lt):
    """The drawn coordinate of values ``x``: the value itself (``lt`` None), or on the
    symmetric-log axis, in decades (matplotlib's transform divided by ``lt``)."""
    x = np.asarray(x, float)
    if lt is None:
        return x
    a = np.abs(x)
    return np.where(a > lt, np.sign(x) * (_LINADJ + np.log10(np.maximum(a, lt) / lt)),
                    x / lt * _LINADJ)


def _t_inv(t, lt):
    t = np.asarray(t, float)
    if lt is None:
        return t
    a = np.abs(t)
    return np.where(a > _LINADJ, np.sign(t) * lt * 10.0 ** (a - _LINADJ), t * lt / _LINADJ)


def linthresh_of(counts: np.ndarray, mid: np.ndarray) -> float:
    """A power of ten at or below the 5th percentile of the nonzero magnitudes
    (weighted by their counts), so that the bulk sits on the log part."""
    keep = (counts > 0) & (mid != 0) & np.isfinite(mid)
    if not keep.any():
        return 1.0
    mags, w = np.abs(mid[keep]), counts[keep]
    order = np.argsort(mags)
    q = mags[order][np.searchsorted(np.cumsum(w[order]), 0.05 * w.sum())]
    return float(10.0 ** np.floor(np.log10(q)))


def edges_closed(h):
    """The bins' edges, an open-ended tail bin closed at twice its finite edge (the
    step's true min and max clip it when ``h`` carries them)."""
    lo, hi = h.bin_lo.values.astype(float), h.bin_hi.values.astype(float)
    return np.where(np.isfinite(lo), lo, 2 * hi), np.where(np.isfinite(hi), hi, 2 * lo)


def bin_groups(lo, hi, used, lt, range_):
    """Sums of neighbouring bins: an index (into the groups) per bin in the span of
    the ``used`` bins (-1 for the zero-width ones and those outside), and each
    group's (lo, hi).  A bin narrower than the finest bar joins the bins whose edge
    nearer zero falls in the same slot of that width."""
    span = np.zeros(lo.size, bool)
    span[used.min():used.max() + 1] = True
    span &= (hi > lo) & (hi > range_[0]) & (lo < range_[1])
    t_lo, t_hi = to_axis(range_, lt)
    step = max((t_hi - t_lo) / RESOLUTION, np.finfo(float).tiny)
    lo_s, hi_s = lo[span], hi[span]
    inner = np.where(lo_s >= 0, lo_s, hi_s)
    with np.errstate(over="ignore"):
        key = np.where(lo_s >= 0, 1, -1) * (np.floor(np.abs(to_axis(inner, lt)) / step) + 1)
    keys, index = np.unique(key, return_inverse=True)           # in value order
    group = np.full(lo.size, -1)
    group[span] = index
    g_lo, g_hi = np.full(keys.size, np.inf), np.full(keys.size, -np.inf)
    np.minimum.at(g_lo, index, lo_s)
    np.maximum.at(g_hi, index, hi_s)
    return group, g_lo, g_hi, step


def _read(h, steps):
    """Per step: counts (the layer did not run: none), NaN/Inf counts, true range."""
    out = []
    for s in steps:
        at = h.sel(step=s)
        c = np.maximum(at.values.astype(np.int64), 0)
        bad = {k: max(int(at[k]), 0) for k in NONFINITE if k in h.coords}
        rng = ((float(at["min"]), float(at["max"])) if "min" in h.coords else (math.nan,) * 2)
        out.append((s, c, bad, rng))
    return out


def _bars_of(c, rng, group, g_lo, g_hi, lt, step):
    """One step's bars: (lo, hi, count) of each occupied group, its edges clipped to
    the step's true range, but no thinner than the finest bar (none when every
    value is one number: a point mass)."""
    if np.isfinite(rng[0]) and rng[0] == rng[1]:
        return np.zeros(0), np.zeros(0), np.zeros(0, np.int64)
    n = np.bincount(group[group >= 0], weights=c[group >= 0], minlength=g_lo.size)
    keep = n > 0
    lo, hi, n = g_lo[keep], g_hi[keep], n[keep].astype(np.int64)
    if np.isfinite(rng[0]):
        t_lo, t_hi = to_axis(lo, lt), to_axis(hi, lt)
        lo = np.maximum(lo, np.minimum(rng[0], _t_inv(t_hi - step, lt)))
        hi = np.minimum(hi, np.maximum(rng[1], _t_inv(t_lo + step, lt)))
    return lo, hi, n


def _masses(c, lo, hi, rng):
    """Point masses: exact zeros, or every finite value of a step whose min is its max."""
    if np.isfinite(rng[0]) and rng[0] == rng[1] and c.sum():
        return [(rng[0], int(c.sum()))]
    zero = int(c[(lo == 0) & (hi == 0)].sum())
    return [(0.0, zero)] if zero else []


def layout(h, steps=None, density: bool = True, scale: str = "linear") -> dict:
    """What the histogram picture of ``h`` (``Run.histogram`` with each step's true
    ``min``/``max`` as coords) at ``steps`` draws, as numbers; the PNG and the browser
    view draw these.  ``steps``: the steps drawn; ``bars``: per step with finite
    values, its ``step``, ``total`` (finite values), and per bar ``lo``, ``hi`` (its
    value edges), ``t_lo``, ``t_hi`` (its edges in the drawn coordinate: the value, or
    on the symmetric-log axis its decades), ``count`` and ``height`` (the density in
    the drawn coordinate, or the count); ``masses``: point masses (``step``,
    ``value``, ``count``, ``total``); ``nonfinite``: NaN/+Inf/-Inf counts over the
    steps; ``linthresh`` (symlog), ``xlim``, ``ticks`` (symlog: the values ticked),
    ``xlabel``, ``ylabel``, ``bulk`` (most values in three bars of a linear axis)."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: use one of {', '.join(SCALES)}")
    steps = _steps_of(h, steps)
    lo_e, hi_e = edges_closed(h)
    data = _read(h, steps)
    occupied = [d for d in data if d[1].sum()]
    out = {"steps": steps, "scale": scale, "density": density, "bars": [], "masses": [],
           "nonfinite": {k: sum(d[2].get(k, 0) for d in data) for k in NONFINITE},
           "linthresh": None, "xlim": None, "ticks": None, "bulk": False,
           "xlabel": "value (linear axis)" if scale == "linear" else "value",
           "ylabel": ("density per unit of value" if scale == "linear" else
                      "density per decade of |value|") if density else
                     "count per bar (bars of unequal width)"}
    if not occupied:
        return out
    total = sum(d[1] for d in occupied)
    used = np.nonzero(total)[0]
    ranges = np.array([d[3] for d in occupied], float)
    lo_r = np.nanmin(ranges[:, 0]) if np.isfinite(ranges).any() else lo_e[used].min()
    hi_r = np.nanmax(ranges[:, 1]) if np.isfinite(ranges).any() else hi_e[used].max()
    mid = np.where(lo_e * hi_e > 0, np.sign(lo_e) * np.sqrt(np.abs(lo_e * hi_e)), 0.0)
    lt = linthresh_of(total, mid) if scale == "symlog" else None
    group, g_lo, g_hi, step = bin_groups(lo_e, hi_e, used, lt, (lo_r, hi_r))
    ends = []
    for s, c, _, rng in occupied:
        lo, hi, k = _bars_of(c, rng, group, g_lo, g_hi, lt, step)
        t_lo, t_hi = to_axis(lo, lt), to_axis(hi, lt)
        n = int(c.sum())
        out["bars"].append({"step": s, "total": n, "lo": lo, "hi": hi, "t_lo": t_lo,
                            "t_hi": t_hi, "count": k,
                            "height": k / (n * (t_hi - t_lo)) if density else k})
        if lo.size:
            ends += [lo.min(), hi.max()]
        for v, m in _masses(c, lo_e, hi_e, rng):
            out["masses"].append({"step": s, "value": v, "count": m, "total": n})
            ends += [v, v]
        out["bulk"] |= scale == "linear" and lo.size > 3 and np.sort(k)[-3:].sum() > 0.6 * n
    if not ends:                   # counts in bins that make no bar or mass: their edges
        ends = [float(lo_e[used].min()), float(hi_e[used].max())]
    lo_v, hi_v = min(ends), max(ends)
    if scale == "symlog":
        out["linthresh"] = lt
        out["ticks"] = decade_ticks(lt, lo_v, hi_v)
        out["xlabel"] = f"value (symmetric-log axis: linear within ±{value_text(lt)}, log beyond)"
        lo_v, hi_v = min(lo_v, 0.0), max(hi_v, 0.0)
    if hi_v == lo_v:                                       # one value: a window around it
        pad = abs(lo_v) * 0.5 or 1.0
        lo_v, hi_v = lo_v - pad, hi_v + pad
    pad = 0.02 * (hi_v - lo_v) if scale == "linear" else 0.0
    out["xlim"] = (lo_v - pad, hi_v + pad)
    if out["bulk"]:
        out["xlabel"] += ("\nmost values are in three bars: scale='symlog' (--scale symlog) "
                          "shows the bulk")
    return out


def histogram(h, steps=None, ax=None, density: bool = True, scale: str = "linear"):
    """One layer's histogram at one or more steps (default: the last with finite
    values) over values -> Figure, as ``layout`` says.  ``scale``: "linear" (density
    per unit of value) or "symlog" (symmetric-log axis, density per decade of
    |value|); ``density=False``: the count in each bar instead.  Exact zeros are
    marked lines; NaN/+Inf/-Inf counts are bars in a panel beside (``ax`` None)."""
    drawn = layout(h, steps, density, scale)
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    if ax is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(8, 4.2), layout="constrained")
        ax, side = fig.subplots(1, 2, width_ratios=(6, 1))
    else:
        fig, side = ax.figure, None
    if drawn["xlim"] is not None:
        _draw(ax, drawn)
    else:
        ax.text(0.5, 0.5, "no finite values at these steps", ha="center", transform=ax.transAxes)
        ax.set_yticks([])
    steps = drawn["steps"]
    ax.set_title(wrap(f"{layer} · {kind}" + (f" · step {steps[0]}" if len(steps) == 1 else ""),
                      80), fontsize="medium")
    ax.grid(alpha=0.3)
    if side is not None:
        _nonfinite_bars(side, drawn["nonfinite"])
    return fig


def _steps_of(h, steps):
    if steps is None:
        last = last_finite_step(h)
        return [] if last is None else [last]
    return [int(steps)] if np.isscalar(steps) else [int(s) for s in steps]


def _draw(ax, drawn: dict) -> None:
    one = len(drawn["bars"]) == 1
    for n, b in enumerate(drawn["bars"]):
        if b["lo"].size:
            ax.bar(b["lo"], b["height"], width=b["hi"] - b["lo"], align="edge", color=f"C{n}",
                   edgecolor=f"C{n}", alpha=0.7 if one else 0.45, lw=0.5,
                   label=f"step {b['step']} ({b['total']:,} finite values)")
        for m in (m for m in drawn["masses"] if m["step"] == b["step"]):
            ax.axvline(m["value"], color="black" if one else f"C{n}", lw=2, ls=(0, (4, 2)),
                       marker="v", markevery=[1], ms=8,
                       label=f"step {m['step']}: {m['count']:,} values "
                             f"({m['count'] / m['total']:.1%}) exactly {m['value']:g} "
                             f"(a point mass: no density)")
    if drawn["scale"] == "symlog":
        ax.set_xscale("symlog", linthresh=drawn["linthresh"], linscale=LINSCALE)
        ax.set_xticks(drawn["ticks"], [value_text(t) for t in drawn["ticks"]])
    ax.set_xlim(*drawn["xlim"])
    if not ax.containers:                                  # point masses only: no density
        ax.set_ylim(0, 1)
        ax.set_yticks([])
    ax.set_xlabel(drawn["xlabel"])
    ax.set_ylabel(drawn["ylabel"])
    ax.legend(fontsize="x-small", loc="best")


def _nonfinite_bars(ax, counts: dict) -> None:
    """NaN, +Inf and -Inf counts as their own red bars, labelled with the count; none:
    no bars at all (a bar of height 0 would strike its label through)."""
    names = list(counts)
    vals = [counts[k] for k in names]
    ax.set_xticks(range(len(names)), [{"nan": "NaN", "posinf": "+Inf", "neginf": "-Inf"}[k]
                                      for k in names])
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_title("NaN / Inf\n(counts)", fontsize="small")
    ax.tick_params(labelsize="x-small")
    if any(vals):
        bars = ax.bar(range(len(names)), vals, color="tab:red", hatch="//", edgecolor="darkred")
        for bar, v in zip(bars, vals):
            if v:
                ax.annotate(f"{v:,}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                            va="bottom", fontsize="x-small", color="darkred")
        ax.set_yscale("log")
        ax.set_ylim(0.5, max(vals) * 3)
    else:
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.text(0.5, 0.6, "none", ha="center", va="center", transform=ax.transAxes,
                fontsize="small", color="dimgray")
