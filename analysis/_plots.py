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


def _value_axis(ax, axis: str, centers: np.ndarray, n_ticks: int = 9) -> None:
    """Ticks at a few occupied bins (zero's among them), labelled with their values."""
    k = len(centers)
    pos = set(np.linspace(0, k - 1, min(n_ticks, k)).round().astype(int).tolist())
    zero = np.nonzero(centers == 0)[0]
    if zero.size:                       # zero gets a tick; none crowd it
        pos = {p for p in pos if abs(p - zero[0]) >= k / (2 * n_ticks)} | {int(zero[0])}
    pos = sorted(pos)
    labels = [_value(centers[p]) for p in pos]
    (ax.set_yticks if axis == "y" else ax.set_xticks)(pos, labels)


def last_finite_step(h) -> int | None:
    """The last step of a histogram (``Run.histogram``) that holds finite values."""
    finite = h.sum("bin").values > 0
    steps = h.step.values[finite]
    return int(steps[-1]) if len(steps) else None


def histogram(h, steps=None, ax=None):
    """Counts of one layer at one or more steps (default: the last with finite
    values), over the occupied bins; NaN/Inf counts in the legend."""
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    if steps is None:
        last = last_finite_step(h)
        steps = [] if last is None else [last]
    elif np.isscalar(steps):
        steps = [int(steps)]
    fig, ax = _figure(ax=ax)
    counts = np.stack([h.sel(step=s).values for s in steps]).astype(float) if steps else \
        np.zeros((0, h.sizes["bin"]))
    used = np.nonzero(counts.sum(0))[0]
    centers = h.bin.values[used]
    x = np.arange(len(used))
    for s, c in zip(steps, counts):
        bad = {k: int(h.sel(step=s)[k]) for k in NONFINITE if k in h.coords}
        label = f"step {s}" + ("" if not any(bad.values()) else "   " + ", ".join(
            f"{k} {v}" for k, v in bad.items() if v))
        ax.step(x, np.where(c[used] > 0, c[used], np.nan), where="mid", label=label)
    if len(used):
        _value_axis(ax, "x", centers)
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no finite values at these steps", ha="center", transform=ax.transAxes)
    ax.set_xlabel("value (occupied bins: sign, exponent, 2 mantissa bits)")
    ax.set_ylabel("count")
    ax.set_title(f"{_short(layer, 50)} · {kind}")
    if steps:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
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


def evolution(ds, stat: str = "std", ax=None, max_legend: int = 12):
    """One statistic of ``Run.stats`` over all steps, a line per layer.  Steps
    where a layer held NaN/Inf are left out of its line (its statistics cover
    only its finite values there) and marked by a red band."""
    kind = ds.attrs.get("kind", "")
    da = ds[stat]
    bad_layer = sum(ds[k] for k in NONFINITE) > 0
    shown = da.where(~bad_layer)
    fig, ax = _figure((8, 4.5), ax)
    steps = da.step.values
    for i, layer in enumerate(da.layer.values):
        ax.plot(steps, shown.isel(layer=i).values, lw=1.2,
                label=_short(str(layer)) if i < max_legend else None)
    vals = shown.values[np.isfinite(shown.values)]
    if vals.size and stat in LOG_STATS and (vals > 0).all():
        ax.set_yscale("log")
    elif vals.size and stat in SYMLOG_STATS and np.abs(vals).max() > 0:
        nz = np.abs(vals[vals != 0])
        ax.set_yscale("symlog", linthresh=float(np.quantile(nz, 0.05)) if nz.size else 1e-12)
    _nonfinite_spans(ax, steps, sum(ds[k] for k in NONFINITE).sum("layer").values)
    if len(steps):
        ax.set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(f"{stat} of {kind} over training")
    if da.sizes["layer"] > max_legend:
        ax.plot([], [], " ", label=f"+{da.sizes['layer'] - max_legend} more layers")
    ax.legend(fontsize="x-small", loc="best", ncol=1 + min(da.sizes["layer"], max_legend) // 8)
    ax.grid(alpha=0.3)
    return fig


def _symlog_axis(ax, linthresh: float, lo: float, hi: float) -> None:
    """A symmetric-log value axis with a few decade ticks that never crowd zero."""
    ax.set_yscale("symlog", linthresh=linthresh, linscale=1)
    top = np.log10(max(abs(lo), abs(hi)))
    first = np.floor(np.log10(linthresh)) + 2                   # clear of the linear region
    decades = np.arange(first, np.ceil(top) + 1)
    decades = decades[:: max(1, int(np.ceil(len(decades) / 4)))]
    ticks = [0.0] + [s * 10.0 ** d for d in decades for s in (1, -1)
                     if (s > 0 and 10.0 ** d <= hi * 1.5) or (s < 0 and -(10.0 ** d) >= lo * 1.5)]
    ax.set_yticks(sorted(ticks), [_value(t) for t in sorted(ticks)])


def _edges(x: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres."""
    x = np.asarray(x, float)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    return np.concatenate([[2 * x[0] - mid[0]], mid, [2 * x[-1] - mid[-1]]])


def _percentile_values(counts: np.ndarray, centers: np.ndarray, qs) -> np.ndarray:
    """Percentiles of binned distributions (bin-centre accuracy), a row per step."""
    out = np.full((counts.shape[0], len(qs)), np.nan)
    for i, c in enumerate(counts):
        total = c.sum()
        if total:
            cdf = np.cumsum(c) / total
            out[i] = centers[np.minimum(np.searchsorted(cdf, qs), len(c) - 1)]
    return out


def distribution(h, ax=None):
    """A layer's histogram over the steps, drawn as TensorBoard's Distributions tab
    draws it: bands between the min, ±2σ, ±1σ percentiles and the max, and the
    median, over a faint heat map of the counts; value axis over the occupied range
    (symmetric-log when the tails dwarf the bulk); a strip of NaN/Inf counts below."""
    from matplotlib.colors import LogNorm
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    counts = h.values.astype(float)
    steps = h.step.values
    used = np.nonzero(counts.sum(0))[0]
    if ax is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(8, 5), layout="constrained")
        ax, strip = fig.subplots(2, 1, sharex=True, height_ratios=(5, 1))
    else:
        fig, strip = ax.figure, None
    if len(used):
        span = slice(used[0], used[-1] + 1)
        pct = _percentile_values(counts[:, span], h.bin.values[span], PERCENTILES)
        lo, hi = np.nanmin(pct[:, 0]), np.nanmax(pct[:, -1])
        edges = np.clip(np.append(h.bin_lo.values[span], h.bin_hi.values[span][-1]), lo, hi)
        c = counts[:, span].T
        mesh = ax.pcolormesh(_edges(steps), edges, np.where(c > 0, c, np.nan), cmap="Greys",
                             norm=LogNorm(vmin=0.3, vmax=max(c.max(), 2) * 3), alpha=0.45)
        fig.colorbar(mesh, ax=ax, label="count per bin", pad=0.01)
        for a, b, alpha in ((0, 6, 0.12), (1, 5, 0.22), (2, 4, 0.32)):
            ax.fill_between(steps, pct[:, a], pct[:, b], color="tab:blue", alpha=alpha, lw=0)
        ax.plot(steps, pct[:, 3], color="tab:red", lw=1.4, label="median")
        bulk = np.nanmedian(pct[:, 4] - pct[:, 2])
        if bulk > 0 and max(abs(lo), abs(hi)) / bulk > 1e3:
            _symlog_axis(ax, float(bulk), lo, hi)
        pad = 0.02 * (hi - lo) if hi > lo else max(abs(hi), 1e-30)
        ax.set_ylim(lo - pad, hi + pad)
        ax.legend(fontsize="x-small", loc="upper right")
    ax.set_ylabel("value")
    ax.grid(alpha=0.3)
    ax.set_title(f"{_short(layer, 50)} · {kind}: distribution over steps\n"
                 f"bands: min–max, ±2σ, ±1σ percentiles; line: median", fontsize="small")
    bad = sum(h[k].values for k in NONFINITE if k in h.coords)
    if strip is not None:
        strip.bar(steps, bad, color="red", width=0.8 * (np.min(np.diff(steps)) if len(steps) > 1 else 1))
        strip.set_ylabel("NaN/Inf", fontsize="small")
        if not np.any(bad):
            strip.text(0.5, 0.5, "no NaN or Inf", ha="center", va="center",
                       transform=strip.transAxes, fontsize="small")
            strip.set_yticks([])
        strip.set_xlabel("step")
    else:
        _nonfinite_spans(ax, steps, np.asarray(bad))
        ax.set_xlabel("step")
    return fig


def comparison(diff, line_a, line_b, labels=("run A", "run B"), first=None):
    """Where two runs differ: a layer x step heat map of ``diff`` (named after its
    metric) with the first divergence marked, beside the two runs' lines of one
    statistic of one layer (1-d over step)."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    heat, lines = fig.subplots(1, 2, width_ratios=(3, 2))
    vals = diff.values.astype(float)
    pos = vals[np.isfinite(vals) & (vals > 0)]
    norm = LogNorm(vmin=max(pos.min(), 1e-12), vmax=max(pos.max(), pos.min() * 10)) if pos.size \
        else None
    layers = [str(x) for x in diff.layer.values]
    mesh = heat.pcolormesh(diff.step.values, np.arange(len(layers)),
                           np.where(vals > 0, vals, np.nan), shading="nearest", cmap="magma_r",
                           norm=norm)
    fig.colorbar(mesh, ax=heat, label=diff.name, pad=0.01)
    heat.set_yticks(np.arange(len(layers)), [_short(n, 30) for n in layers], fontsize="x-small")
    heat.invert_yaxis()
    if first is not None:
        heat.plot([first[0]], [layers.index(first[1])], marker="o", ms=12, mfc="none",
                  mec="tab:cyan", mew=2, ls="", label=f"first divergence: step {first[0]}")
        heat.legend(fontsize="x-small", loc="lower right")
    heat.set_xlabel("step")
    heat.set_title(f"{diff.name} between the runs (layers in execution order)", fontsize="small")
    layer, kind, stat = line_a.attrs.get("layer", ""), line_a.attrs.get("kind", ""), line_a.name
    for da, style, name in ((line_a, "-", labels[0]), (line_b, "--", labels[1])):
        lines.plot(da.step.values, da.values, style, lw=1.4, label=_short(name, 30))
    if first is not None and first[1] == layer:
        lines.axvline(first[0], color="tab:cyan", lw=1, ls=":")
    lines.set_xlabel("step")
    lines.set_ylabel(stat)
    lines.set_title(f"{_short(layer, 40)} · {kind} · {stat}", fontsize="small")
    lines.legend(fontsize="small")
    lines.grid(alpha=0.3)
    return fig
