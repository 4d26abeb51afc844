"""Plot functions: xarray objects in, a matplotlib Figure out.

They know nothing of runs or stores (``Run`` and ``plot_comparison`` hand them
the data); none calls ``plt.show()``.

The shared histogram bins are log-spaced by magnitude on each side of zero, so
a histogram's value axis shows only the *occupied* bins, one slot each, in
value order (no band of empty bins between -1e-5 and +1e-5), labelled with the
bins' own values.  A distribution over steps uses a value axis, as TensorBoard
does, over the occupied range.
"""

from __future__ import annotations

import numpy as np

__all__ = ["comparison", "distribution", "evolution", "histogram", "last_finite_step"]

NONFINITE = ("nan", "posinf", "neginf")
PERCENTILES = (0.0, 0.0668, 0.3085, 0.5, 0.6915, 0.9332, 1.0)   # TensorBoard's bands
LOG_STATS = ("std", "abs_max", "norm", "count")                  # positive: log scale
SYMLOG_STATS = ("mean", "min", "max")


def _figure(figsize=(7, 4), ax=None):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure      # no pyplot: headless, no global state
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _short(name: str, width: int = 28) -> str:
    name = str(name)
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _value(v: float) -> str:
    return "0" if v == 0 else f"{v:.1e}".replace("e-0", "e-").replace("e+0", "e")


def _decade_ticks(linthresh: float, lo: float, hi: float, most: int = 9) -> list[float]:
    """0 and clean powers of ten on each occupied side of a symmetric-log axis,
    thinned to at most ``most`` ticks, none inside the linear region."""
    top = np.log10(max(abs(lo), abs(hi), linthresh))
    decades = np.arange(np.ceil(np.log10(linthresh)), np.floor(top) + 1)
    sides = [s for s, ok in ((1, hi > 0), (-1, lo < 0)) if ok]
    step = max(1, int(np.ceil(len(decades) * len(sides) / max(most - 1, 1))))
    decades = decades[::-1][::step][::-1]                       # keep the largest decade
    return sorted({0.0} | {s * 10.0 ** d for d in decades for s in sides})


def _linthresh(values: np.ndarray) -> float:
    """The linear region of a symmetric-log axis: a power of ten at or below the
    5th percentile of the nonzero magnitudes (so the bulk sits on the log part)."""
    mags = np.abs(values[np.isfinite(values) & (values != 0)])
    if not mags.size:
        return 1.0
    return float(10.0 ** np.floor(np.log10(np.quantile(mags, 0.05))))


def _nonfinite_bars(ax, counts: dict) -> None:
    """NaN, +Inf and -Inf counts as their own red bars, labelled with the count."""
    names = list(counts)
    vals = [counts[k] for k in names]
    bars = ax.bar(range(len(names)), vals, color="tab:red", hatch="//", edgecolor="darkred")
    for bar, v in zip(bars, vals):
        if v:
            ax.annotate(f"{v:,}", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom", fontsize="x-small", color="darkred")
    ax.set_xticks(range(len(names)), [{"nan": "NaN", "posinf": "+Inf", "neginf": "-Inf"}[k]
                                      for k in names])
    ax.set_title("non-finite", fontsize="small")
    ax.tick_params(axis="y", labelsize="x-small")
    if any(vals):
        ax.set_yscale("log")
        ax.set_ylim(0.5, max(vals) * 3)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes,
                fontsize="small")


def last_finite_step(h) -> int | None:
    """The last step of a histogram (``Run.histogram``) that holds finite values (a
    step where the layer did not run holds -1 in every bin)."""
    finite = h.clip(min=0).sum("bin").values > 0
    steps = h.step.values[finite]
    return int(steps[-1]) if len(steps) else None


def histogram(h, steps=None, ax=None, density: bool = False):
    """Counts of one layer at one or more steps (default: the last with finite
    values) drawn over values: each bin a bar of its true width (clipped to the
    step's true min and max when ``h`` carries them), on a symmetric-log value
    axis with a 0 tick and decade ticks; NaN/+Inf/-Inf counts as their own red
    bars beside it.  ``density``: counts per unit of value, over all counts."""
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    if steps is None:
        last = last_finite_step(h)
        steps = [] if last is None else [last]
    elif np.isscalar(steps):
        steps = [int(steps)]
    if ax is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(8, 4), layout="constrained")
        ax, side = fig.subplots(1, 2, width_ratios=(6, 1))
    else:
        fig, side = ax.figure, None
    lo_e, hi_e = h.bin_lo.values.astype(float), h.bin_hi.values.astype(float)
    occupied = []
    bad = {k: 0 for k in NONFINITE}
    for n, s in enumerate(steps):
        at = h.sel(step=s)
        c = np.maximum(at.values.astype(np.int64), 0)      # -1: the layer did not run
        used = np.nonzero(c)[0]
        for k in NONFINITE:
            if k in h.coords:
                bad[k] += max(int(at[k]), 0)
        if not used.size:
            continue
        lo, hi = lo_e[used].copy(), hi_e[used].copy()
        if "min" in h.coords and np.isfinite(float(at["min"])):
            lo, hi = np.clip(lo, float(at["min"]), None), np.clip(hi, None, float(at["max"]))
            hi = np.maximum(hi, lo)
        width = hi - lo
        y = c[used] / np.where(width > 0, width, 1) / c.sum() if density else c[used]
        ax.bar(lo, y, width=np.where(width > 0, width, 0), align="edge", alpha=0.6,
               color=f"C{n}", edgecolor=f"C{n}", lw=0.6, label=f"step {s}")
        occupied.append((lo.min(), hi.max(), np.concatenate([lo, hi])))
    if occupied:
        lo_v, hi_v = min(o[0] for o in occupied), max(o[1] for o in occupied)
        lt = _linthresh(np.concatenate([o[2] for o in occupied]))
        ax.set_xscale("symlog", linthresh=lt, linscale=0.5)
        ticks = _decade_ticks(lt, lo_v, hi_v)
        ax.set_xticks(ticks, [_value(t) for t in ticks])
        ax.set_xlim(min(lo_v, 0.0), max(hi_v, 0.0))
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no finite values at these steps", ha="center", transform=ax.transAxes)
    ax.set_xlabel("value (symmetric log; bars are the bins' true widths)")
    ax.set_ylabel("density" if density else "count per bin")
    ax.set_title(f"{_short(layer, 50)} · {kind}" + (f" · step {steps[0]}" if len(steps) == 1 else ""))
    ax.grid(alpha=0.3)
    if side is not None:
        _nonfinite_bars(side, bad)
    return fig


def _nonfinite_spans(ax, steps: np.ndarray, bad: np.ndarray, label: bool = True) -> None:
    """A red band over every step that holds NaN or Inf, with its count."""
    if not bad.any():
        return
    gap = np.min(np.diff(steps)) if len(steps) > 1 else 1
    for i in np.nonzero(bad)[0]:
        ax.axvspan(steps[i] - gap / 2, steps[i] + gap / 2, color="red", alpha=0.15, lw=0,
                   label="NaN/Inf present" if label and i == np.nonzero(bad)[0][0] else None)
    first = np.nonzero(bad)[0][0]
    ax.annotate(f"first NaN/Inf: step {steps[first]}\n({int(bad[first])} values)",
                (steps[first], 1), xycoords=("data", "axes fraction"), xytext=(4, -4),
                textcoords="offset points", va="top", fontsize="x-small", color="darkred")


def _scale(ax, stat: str, vals: np.ndarray) -> None:
    vals = vals[np.isfinite(vals)]
    if vals.size and stat in LOG_STATS and (vals > 0).all():
        ax.set_yscale("log")
    elif vals.size and stat in SYMLOG_STATS and np.abs(vals).max() > 0:
        ax.set_yscale("symlog", linthresh=_linthresh(vals))


SMALL_MULTIPLES = 6         # more layers than this: a panel per layer


def evolution(ds, stat: str = "std", ax=None, max_legend: int = 12):
    """One statistic of ``Run.stats`` over the steps, a line per layer; past
    ``SMALL_MULTIPLES`` layers, a small panel per layer (at most 24).  Steps where
    a layer held NaN/Inf are left out of its line (its statistics cover only its
    finite values there), marked with an x on the line's colour at the top, and
    the layer's first such step and count are in its label.  The run is named in
    the title (``ds.attrs["run"]``)."""
    kind, run = ds.attrs.get("kind", ""), ds.attrs.get("run", "")
    da = ds[stat]
    bad = sum(ds[k].astype(np.int64).clip(min=0) for k in NONFINITE)   # -1: did not run
    shown = da.where(bad == 0)
    steps = da.step.values
    names = [str(x) for x in da.layer.values]
    many = len(names) > SMALL_MULTIPLES and ax is None
    if many:
        from matplotlib.figure import Figure
        names = names[:24]
        cols = 4
        rows = -(-len(names) // cols)
        fig = Figure(figsize=(12, 1.9 * rows + 0.8), layout="constrained")
        axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, squeeze=False).ravel())
        for extra in axes[len(names):]:
            extra.set_visible(False)
    else:
        fig, one = _figure((8, 4.5), ax)
        axes = [one] * len(names)
    for i, name in enumerate(names):
        a = axes[i]
        y = shown.isel(layer=i).values
        b = bad.isel(layer=i).values
        hit = np.nonzero(b)[0]
        label = _short(name) + (f"  NaN/Inf from step {steps[hit[0]]} ({int(b[hit[0]]):,} values, "
                                f"{len(hit)} steps)" if hit.size else "")
        color = "C0" if many else f"C{i % 10}"
        line, = a.plot(steps, y, lw=1.2, color=color,
                       label=label if (many or i < max_legend) else None)
        if hit.size:
            row = 0.98 if many else 0.98 - 0.03 * (i % 12)     # a row of marks per layer
            a.plot(steps[hit], np.full(hit.size, row), "x", color=color, ms=5, mew=1.4,
                   transform=a.get_xaxis_transform(), clip_on=False)
            if many:
                for j in hit:
                    a.axvspan(steps[j] - 0.5, steps[j] + 0.5, color="red", alpha=0.15, lw=0)
        if many:
            _scale(a, stat, y)
            a.set_title(label, fontsize="x-small", color="darkred" if hit.size else "black")
            a.grid(alpha=0.3)
            a.tick_params(labelsize="x-small")
    if many:
        fig.suptitle(f"{stat} of {kind} over training · {run}" +
                     (f" (first {len(names)} of {da.sizes['layer']} layers)"
                      if da.sizes["layer"] > len(names) else ""), fontsize="small")
        fig.supxlabel("step", fontsize="small")
        return fig
    ax = axes[0] if names else _figure((8, 4.5), ax)[1]
    _scale(ax, stat, shown.values.ravel())
    if len(steps):
        ax.set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(f"{stat} of {kind} over training" + (f" · {run}" if run else "") +
                 ("\nx: a step where that layer held NaN/Inf (left out of its line)"
                  if int(bad.sum()) else ""), fontsize="small")
    if da.sizes["layer"] > max_legend:
        ax.plot([], [], " ", label=f"+{da.sizes['layer'] - max_legend} more layers")
    ax.legend(fontsize="x-small", loc="best")
    ax.grid(alpha=0.3)
    return fig


def _percentile_values(counts: np.ndarray, lo: np.ndarray, hi: np.ndarray, qs,
                       vmin=None, vmax=None) -> np.ndarray:
    """Percentiles of binned distributions, a row per step: linear within the bin
    where the cumulative count reaches each quantile, every bin's edges clipped
    to that step's true min and max (``vmin``/``vmax``), which are the 0th and
    100th percentiles.  Steps without finite values give NaN."""
    out = np.full((counts.shape[0], len(qs)), np.nan)
    qs = np.asarray(qs, float)
    for i, c in enumerate(counts):
        total = c.sum()
        if not total:
            continue
        l, h = lo.copy(), hi.copy()
        if vmin is not None and np.isfinite(vmin[i]):
            l, h = np.clip(l, vmin[i], vmax[i]), np.clip(h, vmin[i], vmax[i])
        used = np.nonzero(c)[0]
        cum = np.cumsum(c[used])
        target = qs * total
        j = np.minimum(np.searchsorted(cum, target, side="left"), len(used) - 1)
        before = np.where(j > 0, cum[np.maximum(j - 1, 0)], 0)
        frac = np.clip((target - before) / c[used][j], 0, 1)
        out[i] = l[used][j] + frac * (h[used][j] - l[used][j])
        if vmin is not None and np.isfinite(vmin[i]):
            out[i, qs == 0], out[i, qs == 1] = vmin[i], vmax[i]
    return out


def distribution(h, ax=None):
    """A layer's histogram over the steps, drawn as TensorBoard's Distributions tab
    draws it: bands between the min, ±2σ, ±1σ percentiles and the max, and the
    median.  The min and max are the true ones (``h``'s ``min``/``max`` coords,
    as ``Run.plot_distribution`` gives them), the percentiles interpolated in
    their bins.  A symmetric-log value axis (with a 0 tick) when the tails dwarf
    the bulk; each step's NaN/Inf count in a strip below, marked."""
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    counts = np.maximum(h.values.astype(np.int64), 0)     # -1: the layer did not run
    steps = h.step.values
    vmin = h["min"].values.astype(float) if "min" in h.coords else None
    vmax = h["max"].values.astype(float) if "max" in h.coords else None
    if ax is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(8, 5), layout="constrained")
        ax, strip = fig.subplots(2, 1, sharex=True, height_ratios=(5, 1))
    else:
        fig, strip = ax.figure, None
    pct = _percentile_values(counts, h.bin_lo.values.astype(float), h.bin_hi.values.astype(float),
                             PERCENTILES, vmin, vmax)
    if np.isfinite(pct).any():
        for a, b, alpha in ((0, 6, 0.15), (1, 5, 0.25), (2, 4, 0.35)):
            ax.fill_between(steps, pct[:, a], pct[:, b], color="tab:blue", alpha=alpha, lw=0,
                            label=("min-max", "±2σ", "±1σ")[a])
        ax.plot(steps, pct[:, 3], color="tab:red", lw=1.4, label="median")
        lo, hi = np.nanmin(pct[:, 0]), np.nanmax(pct[:, -1])
        width = pct[:, 4] - pct[:, 2]
        width = width[np.isfinite(width) & (width > 0)]
        bulk = float(np.median(width)) if width.size else 0.0
        if bulk == 0.0:                                 # no spread: the smallest magnitude
            bulk = _linthresh(pct[np.isfinite(pct)])
        if max(abs(lo), abs(hi)) / bulk > 1e3:
            lt = float(10.0 ** np.floor(np.log10(bulk)))
            ax.set_yscale("symlog", linthresh=lt, linscale=0.5)
            ticks = _decade_ticks(lt, lo, hi)
            ax.set_yticks(ticks, [_value(t) for t in ticks])
        pad = 0.02 * (hi - lo) if hi > lo else max(abs(hi), 1e-30)
        ax.set_ylim(lo - (pad if ax.get_yscale() == "linear" else 0),
                    hi + (pad if ax.get_yscale() == "linear" else 0))
        ax.legend(fontsize="x-small", loc="upper left")
    else:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("value")
    ax.grid(alpha=0.3)
    ax.set_title(f"{_short(layer, 50)} · {kind}: distribution over steps\n"
                 f"bands: true min-max, ±2σ and ±1σ percentiles; line: median", fontsize="small")
    bad = sum(np.maximum(h[k].values.astype(np.int64), 0) for k in NONFINITE if k in h.coords)
    bad = np.zeros(len(steps), np.int64) if np.isscalar(bad) else bad
    if strip is not None:
        gap = np.min(np.diff(steps)) if len(steps) > 1 else 1
        strip.bar(steps, bad, color="tab:red", width=max(0.8 * gap, 1e-9))
        hit = np.nonzero(bad)[0]
        strip.plot(steps[hit], bad[hit], "v", color="darkred", ms=5, ls="",
                   label=f"NaN/Inf ({len(hit)} steps)" if len(hit) else None)
        strip.set_ylabel("NaN/Inf", fontsize="small")
        if hit.size:
            strip.set_yscale("log")
            strip.set_ylim(0.5, bad.max() * 3)
            strip.legend(fontsize="x-small", loc="upper left")
        else:
            strip.text(0.5, 0.5, "no NaN or Inf", ha="center", va="center",
                       transform=strip.transAxes, fontsize="small")
            strip.set_yticks([])
        strip.set_xlabel("step")
    else:
        _nonfinite_spans(ax, steps, np.asarray(bad))
        ax.set_xlabel("step")
    return fig


def comparison(diff, line_a, line_b, labels=("run A", "run B"), first=None, nonfinite=None):
    """Where two runs differ: a layer x step heat map of ``diff`` (named after its
    metric) on a sequential scale where darker means more different (white:
    identical), cells where either run held NaN/Inf (``nonfinite``, layer x
    step) marked with a cyan x and infinite differences drawn black, the
    first divergence circled; beside it the two runs' lines of one statistic of
    one layer, their NaN/Inf steps marked."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    heat, lines = fig.subplots(1, 2, width_ratios=(3, 2))
    vals = diff.transpose("layer", "step").values.astype(float)
    pos = vals[np.isfinite(vals) & (vals > 0)]
    top = pos.max() if pos.size else 1.0
    norm = LogNorm(vmin=max(pos.min(), top * 1e-6) if pos.size else 1e-6, vmax=top)
    cmap = __import__("matplotlib").colormaps["Reds"].with_extremes(under="white", over="black",
                                                                   bad="white")
    shown = np.where(np.isinf(vals), top * 10, np.where(vals > 0, vals, norm.vmin / 2))
    layers = [str(x) for x in diff.layer.values]
    steps = diff.step.values
    mesh = heat.pcolormesh(steps, np.arange(len(layers)), shown, shading="nearest", cmap=cmap,
                           norm=norm)
    fig.colorbar(mesh, ax=heat, label=f"{diff.name} (white: identical, black: infinite)",
                 pad=0.01, extend="both")
    if nonfinite is not None:
        nf = nonfinite.transpose("layer", "step").values.astype(bool)
        li, si = np.nonzero(nf)
        if li.size:
            heat.plot(steps[si], li, "x", color="tab:cyan", ms=5, mew=1.4, ls="",
                      label="NaN/Inf in a run")
    heat.set_yticks(np.arange(len(layers)), [_short(n, 30) for n in layers], fontsize="x-small")
    heat.invert_yaxis()
    if first is not None and first[1] in layers:
        heat.plot([first[0]], [layers.index(first[1])], marker="o", ms=12, mfc="none",
                  mec="tab:blue", mew=2, ls="", label=f"first divergence: step {first[0]}")
    if heat.get_legend_handles_labels()[0]:
        heat.legend(fontsize="x-small", loc="lower right")
    heat.set_xlabel("step")
    heat.set_title(f"{diff.name} between the runs (layers in execution order)", fontsize="small")
    layer, kind, stat = line_a.attrs.get("layer", ""), line_a.attrs.get("kind", ""), line_a.name
    for n, (da, style, name) in enumerate(((line_a, "-", labels[0]), (line_b, "--", labels[1]))):
        lines.plot(da.step.values, da.values, style, lw=1.4, color=f"C{n}", label=_short(name, 30))
        ran = ~da.coords["absent"].values if "absent" in da.coords else True
        gone = np.nonzero((~np.isfinite(da.values.astype(float)) & ran) |
                          (da.coords["nonfinite"].values > 0 if "nonfinite" in da.coords
                           else False))[0]
        if gone.size:
            lines.plot(da.step.values[gone], np.full(gone.size, 0.97 - 0.05 * n), "x",
                       color=f"C{n}", transform=lines.get_xaxis_transform(), ls="",
                       label=f"{_short(name, 20)}: NaN/Inf ({gone.size} steps)")
    if first is not None and first[1] == layer:
        lines.axvline(first[0], color="tab:blue", lw=1, ls=":")
    lines.set_xlabel("step")
    lines.set_ylabel(stat)
    lines.set_title(f"{_short(layer, 40)} · {kind} · {stat}", fontsize="small")
    lines.legend(fontsize="x-small")
    lines.grid(alpha=0.3)
    return fig
