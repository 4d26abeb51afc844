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

from ._axes import NONFINITE, decade_ticks, last_finite_step, value_text, wrap

__all__ = ["comparison", "distribution", "evolution", "histogram", "last_finite_step", "wrap"]

PERCENTILES = (0.0, 0.0668, 0.3085, 0.5, 0.6915, 0.9332, 1.0)   # TensorBoard's bands
LOG_STATS = ("std", "abs_max", "norm", "count")                  # positive: log scale
SYMLOG_STATS = ("mean", "min", "max")


def _short(name: str, width: int = 28) -> str:
    name = str(name)
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _linthresh(values: np.ndarray) -> float:
    """The linear region of a symmetric-log axis: a power of ten at or below the
    5th percentile of the nonzero magnitudes (so the bulk sits on the log part)."""
    mags = np.abs(values[np.isfinite(values) & (values != 0)])
    if not mags.size:
        return 1.0
    return float(10.0 ** np.floor(np.log10(np.quantile(mags, 0.05))))


def histogram(h, steps=None, ax=None, density: bool = True, scale: str = "linear"):
    """A layer's histogram at some steps over values -> Figure (``_plot_histogram``)."""
    from ._plot_histogram import histogram
    return histogram(h, steps, ax, density=density, scale=scale)


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
    """A log axis (symmetric-log for signed statistics) where the values span decades;
    within one, a linear axis (its ticks short, an offset above where they share digits)."""
    vals = vals[np.isfinite(vals)]
    if vals.size and stat in LOG_STATS and (vals > 0).all() and vals.max() > 10 * vals.min():
        ax.set_yscale("log")
    elif vals.size and stat in SYMLOG_STATS and np.abs(vals).max() > 10 * _linthresh(vals):
        ax.set_yscale("symlog", linthresh=_linthresh(vals))


SMALL_MULTIPLES = 6         # more layers than this: a panel per layer
MAX_PANELS, COLS = 40, 4    # at most this many panels, in this many columns
TITLE_WIDTH = 46            # characters on a line of a panel's title


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) indices of each run of True in ``mask``."""
    d = np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]]))
    return list(zip(np.nonzero(d == 1)[0], np.nonzero(d == -1)[0]))


def _shade(ax, steps: np.ndarray, mask: np.ndarray) -> None:
    """A red band over each run of steps where ``mask`` holds (NaN/Inf: not a value)."""
    gap = np.min(np.diff(steps)) if len(steps) > 1 else 1
    for a, b in _runs(mask):
        ax.axvspan(steps[a] - gap / 2, steps[b - 1] + gap / 2, color="red", alpha=0.15, lw=0)


def _note(steps: np.ndarray, bad: np.ndarray) -> str:
    hit = np.nonzero(bad)[0]
    return (f"NaN/Inf from step {steps[hit[0]]} ({int(bad[hit[0]]):,} values, {len(hit)} steps)"
            if hit.size else "")


def evolution(ds, stat: str = "std", ax=None, max_legend: int = 12):
    """One statistic of ``Run.stats`` over the steps, a line per layer, named in full
    in the legend; past ``SMALL_MULTIPLES`` layers, a panel per layer (at most
    ``MAX_PANELS``), its full name wrapped in its title.  Steps where a layer held
    NaN/Inf are left out of its line (its statistics cover only its finite values
    there), never drawn as values: they are marked on a strip below the lines
    (shaded, in a panel or in an ``ax`` given), and the layer's first such step
    and count are in its label.  The run is named in the title (``ds.attrs["run"]``)."""
    kind, run = ds.attrs.get("kind", ""), ds.attrs.get("run", "")
    da = ds[stat]
    bad = sum(ds[k].astype(np.int64).clip(min=0) for k in NONFINITE)   # -1: did not run
    shown = da.where(bad == 0)
    title = f"{stat} of {kind} over training" + (f" · {run}" if run else "")
    if da.sizes["layer"] > SMALL_MULTIPLES and ax is None:
        return _small_multiples(shown, bad, stat, title)
    steps = da.step.values
    names = [str(x) for x in da.layer.values]
    hit = [i for i in range(len(names)) if bad.isel(layer=i).values.any()]
    if ax is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(10, 4.5 + (0.3 + 0.2 * len(hit) if hit else 0)),
                     layout="constrained")
        ax, strip = (fig.subplots(2, 1, sharex=True, height_ratios=(5, 0.4 + 0.3 * len(hit)))
                     if hit else (fig.add_subplot(), None))
        legend = {"loc": "upper left", "bbox_to_anchor": (1.01, 1), "borderaxespad": 0}
    else:
        fig, strip, legend = ax.figure, None, {"loc": "best"}
    for i, name in enumerate(names):
        note = _note(steps, bad.isel(layer=i).values)
        ax.plot(steps, shown.isel(layer=i).values, lw=1.2, color=f"C{i % 10}",
                label=name + (f"\n  {note}" if note else "") if i < max_legend else None)
    if hit and strip is None:
        _shade(ax, steps, bad.values.any(axis=list(bad.dims).index("layer")))
    elif hit:
        _strip(strip, steps, bad, hit, names)
    _scale(ax, stat, shown.values.ravel())
    if len(steps):
        ax.set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    (strip or ax).set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(title + ("\nsteps where a layer held NaN/Inf are left out of its line, and "
                          + ("marked below" if strip else "shaded") if hit else ""),
                 fontsize="small")
    if da.sizes["layer"] > max_legend:
        ax.plot([], [], " ", label=f"+{da.sizes['layer'] - max_legend} more layers")
    ax.legend(fontsize="x-small", **legend)
    ax.grid(alpha=0.3)
    return fig


def _strip(strip, steps, bad, hit, names) -> None:
    """A row per layer that held NaN/Inf, a mark at each such step, in its line's colour."""
    for row, i in enumerate(hit):
        at = bad.isel(layer=i).values > 0
        strip.plot(steps[at], np.full(int(at.sum()), row), "|", color=f"C{i % 10}", ms=9,
                   mew=1.5, ls="")
    strip.set_yticks(range(len(hit)), [_short(names[i], 24) for i in hit], fontsize="x-small")
    for label, i in zip(strip.get_yticklabels(), hit):
        label.set_color(f"C{i % 10}")
    strip.set_ylim(len(hit) - 0.5, -0.5)
    strip.set_ylabel("NaN/Inf", fontsize="small")
    strip.grid(alpha=0.3, axis="x")


def _small_multiples(shown, bad, stat: str, title: str):
    """A panel per layer: its line, its NaN/Inf steps shaded, its full name (wrapped)
    and its first NaN/Inf step in its title."""
    from matplotlib.figure import Figure
    names = [str(x) for x in shown.layer.values][:MAX_PANELS]
    steps = shown.step.values
    notes = [_note(steps, bad.isel(layer=i).values) for i in range(len(names))]
    titles = [wrap(n, TITLE_WIDTH) + (f"\n{wrap(t, TITLE_WIDTH)}" if t else "")
              for n, t in zip(names, notes)]
    rows = -(-len(names) // COLS)
    lines = max(t.count("\n") + 1 for t in titles)
    fig = Figure(figsize=(12, rows * (1.3 + 0.15 * lines) + 0.6), layout="constrained")
    axes = fig.subplots(rows, COLS, sharex=True, squeeze=False).ravel()
    for i, (a, text) in enumerate(zip(axes, titles)):
        y = shown.isel(layer=i).values
        a.plot(steps, y, lw=1.2, color="C0", label=names[i])
        _shade(a, steps, bad.isel(layer=i).values > 0)
        _scale(a, stat, y)
        a.set_title(text, fontsize="x-small", loc="left", color="darkred" if notes[i] else "black")
        a.grid(alpha=0.3)
        a.tick_params(labelsize="x-small")
        a.yaxis.get_offset_text().set_fontsize("x-small")
    for a in axes[len(names):]:
        a.set_visible(False)
    for a in axes[max(len(names) - COLS, 0):len(names)]:      # each column's last panel
        a.xaxis.set_tick_params(labelbottom=True)
    more = shown.sizes["layer"] - len(names)
    fig.suptitle(title + (f" (first {len(names)} of {shown.sizes['layer']} layers)" if more
                          else "") + ("\nred bands: steps where a layer held NaN/Inf (left out "
                                      "of its line)" if any(notes) else ""), fontsize="small")
    fig.supxlabel("step", fontsize="small")
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
            ticks = decade_ticks(lt, lo, hi)
            ax.set_yticks(ticks, [value_text(t) for t in ticks])
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


DIFF_FLOOR = 1e-7          # the comparison map's lowest coloured difference (about float32's eps)


def comparison(diff, line_a, line_b, labels=("run A", "run B"), first=None, nonfinite=None):
    """Where two runs differ: a layer x step heat map of ``diff`` (named after its
    metric) on a fixed log scale where darker means more different (white: 0,
    identical; 1 and above dark; grey: not compared), cells where either run held NaN/Inf (``nonfinite``, layer x
    step) marked with a cyan x and infinite differences drawn black, the
    first divergence circled; beside it the two runs' lines of one statistic of
    one layer, their NaN/Inf steps marked (a log axis where they span decades)."""
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    heat, lines = fig.subplots(1, 2, width_ratios=(3, 2))
    vals = diff.transpose("layer", "step").values.astype(float)
    finite = vals[np.isfinite(vals)]
    # a fixed scale, not the data's range: only 0 is white, 1 (as different as can be
    # for rel_l2) is dark whatever else is drawn, differences below the floor the palest
    top = max(1.0, finite.max() if finite.size else 1.0)
    norm = LogNorm(vmin=DIFF_FLOOR, vmax=top)
    reds = __import__("matplotlib").colormaps["Reds"]
    cmap = ListedColormap(reds(np.linspace(0.12, 1, 256))).with_extremes(
        under="white", over="black", bad="0.85")
    shown = np.where(np.isinf(vals), top * 10, np.where(
        vals > 0, np.maximum(vals, DIFF_FLOOR), np.where(vals == 0, DIFF_FLOOR / 10, np.nan)))
    layers = [str(x) for x in diff.layer.values]
    steps = diff.step.values
    mesh = heat.pcolormesh(steps, np.arange(len(layers)), shown, shading="nearest", cmap=cmap,
                           norm=norm)
    fig.colorbar(mesh, ax=heat, label=f"{diff.name} (white: 0, identical; black: infinite; grey: not compared)",
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
        if gone.size:                          # shaded, never drawn as values
            mask = np.zeros(da.sizes["step"], bool)
            mask[gone] = True
            lines.fill_between(da.step.values, 0, 1, where=mask, step="mid", color=f"C{n}",
                               alpha=0.15, lw=0, transform=lines.get_xaxis_transform(),
                               label=f"{_short(name, 20)}: NaN/Inf ({gone.size} steps)")
    if first is not None and first[1] == layer:
        lines.axvline(first[0], color="tab:blue", lw=1, ls=":")
    lines.set_xlabel("step")
    lines.set_ylabel(stat)
    drawn = np.concatenate([da.values.astype(float).ravel() for da in (line_a, line_b)])
    drawn = drawn[np.isfinite(drawn)]
    if drawn.size and (drawn > 0).all() and drawn.max() / drawn.min() > 1e3:
        lines.set_yscale("log")                  # over decades a linear axis is flat at 0
    lines.set_title(f"{_short(layer, 40)} · {kind} · {stat}", fontsize="small")
    lines.legend(fontsize="x-small")
    lines.grid(alpha=0.3)
    return fig
