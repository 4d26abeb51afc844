"""Plot functions: xarray objects in, a matplotlib Figure out.

They know nothing of runs or stores (``Run`` and ``plot_comparison`` hand them
the data); none calls ``plt.show()``, and each takes ``ax=None``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["comparison", "distribution", "evolution", "histogram"]


def _figure(figsize=(7, 4), ax=None):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure      # no pyplot: headless, no global state
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _centers(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A plotting position per bin on a symlog axis (tails at their finite edge)."""
    c = np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, np.where(np.isfinite(lo), lo, hi))
    return c


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


def histogram(h, steps=None, ax=None):
    """Histogram (an ``xr.DataArray`` (step, bin) as ``Run.histogram`` gives) at one
    or more steps (default: the last): log counts, NaN/Inf counts in the legend."""
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    all_steps = h.step.values
    if steps is None:
        steps = [int(all_steps[-1])] if len(all_steps) else []
    elif np.isscalar(steps):
        steps = [int(steps)]
    fig, ax = _figure(ax=ax)
    lo, hi = h.bin_lo.values, h.bin_hi.values
    x = _centers(lo, hi)
    nz_any = np.zeros(len(x), bool)
    for s in steps:
        row = h.sel(step=s)
        counts = row.values.astype(float)
        nz_any |= counts > 0
        bad = {k: int(row[k]) for k in ("nan", "posinf", "neginf") if k in row.coords}
        label = f"step {s}" + ("" if not any(bad.values()) else
                               "  (" + ", ".join(f"{k} {v}" for k, v in bad.items() if v) + ")")
        ax.step(x, np.where(counts > 0, counts, np.nan), where="mid", label=label)
    if nz_any.any():
        idx = np.nonzero(nz_any)[0]
        span = max(abs(x[idx[0]]), abs(x[idx[-1]]), 1e-30)
        ax.set_xscale("symlog", linthresh=max(span * 1e-6, 1e-30))
    ax.set_yscale("log")
    ax.set_xlabel("value (symmetric log scale; bins share sign, exponent and 2 mantissa bits)")
    ax.set_ylabel("count")
    ax.set_title(f"{_short(layer, 50)} · {kind}")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def evolution(da, ax=None, max_legend=12):
    """One statistic (an ``xr.DataArray`` (step, layer) named after it) over steps,
    one line per layer (log scale where it fits)."""
    stat, kind = da.name, da.attrs.get("kind", "")
    fig, ax = _figure((8, 4.5), ax)
    steps = da.step.values
    for i, layer in enumerate(da.layer.values):
        ax.plot(steps, da.isel(layer=i).values, lw=1.2,
                label=_short(str(layer)) if i < max_legend else None)
    vals = da.values[np.isfinite(da.values)]
    if vals.size and (vals > 0).all() and vals.max() / max(vals.min(), 1e-300) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(f"{stat} of {kind} over training")
    if da.sizes["layer"] > max_legend:
        ax.plot([], [], " ", label=f"+{da.sizes['layer'] - max_legend} more layers")
    ax.legend(fontsize="x-small", loc="best", ncol=1 + da.sizes["layer"] // 8)
    ax.grid(alpha=0.3)
    return fig


def _percentiles(counts: np.ndarray, lo: np.ndarray, hi: np.ndarray, qs) -> np.ndarray:
    """Percentile values of a binned distribution (bin-edge accuracy), one row per step."""
    out = np.full((counts.shape[0], len(qs)), np.nan)
    x = _centers(lo, hi)
    for i, c in enumerate(counts):
        total = c.sum()
        if total:
            cdf = np.cumsum(c) / total
            out[i] = x[np.minimum(np.searchsorted(cdf, qs), len(x) - 1)]
    return out


def distribution(h, ax=None):
    """Step x value heat map of a histogram over time (``Run.histogram``), with
    percentile bands."""
    from matplotlib.colors import LogNorm
    layer, kind = h.attrs.get("layer", h.name), h.attrs.get("kind", "")
    counts = h.values.astype(float)
    lo, hi = h.bin_lo.values, h.bin_hi.values
    fig, ax = _figure((8, 4.5), ax)
    used = np.nonzero(counts.sum(0))[0]
    steps = h.step.values
    if used.size:
        sl = slice(used[0], used[-1] + 1)
        y = np.arange(sl.start, sl.stop)
        c = counts[:, sl].T
        mesh = ax.pcolormesh(steps, y, np.where(c > 0, c, np.nan), shading="nearest",
                             norm=LogNorm(vmin=1, vmax=max(c.max(), 2)), cmap="viridis")
        fig.colorbar(mesh, ax=ax, label="count")
        qs = np.array([0.0, 0.0668, 0.3085, 0.5, 0.6915, 0.9332, 1.0])
        pct = _percentiles(counts, lo, hi, qs)
        centers = _centers(lo, hi)
        pos = np.interp(pct, centers[sl], y) if sl.stop - sl.start > 1 else np.full_like(pct, y[0])
        for j, q in enumerate(qs):
            ax.plot(steps, pos[:, j], color="white", lw=0.8 if q != 0.5 else 1.6,
                    alpha=0.5 if q in (0.0, 1.0) else 0.9)
        ticks = np.linspace(y[0], y[-1], min(9, len(y))).astype(int)
        ax.set_yticks(ticks, [f"{centers[t]:.2g}" for t in ticks])
    bad = h.nan.values + h.posinf.values + h.neginf.values
    if bad.any():
        ax.scatter(steps[bad > 0], np.full((bad > 0).sum(), ax.get_ylim()[1]), marker="v",
                   color="red", label="NaN/Inf present", zorder=3, clip_on=False)
        ax.legend(fontsize="small", loc="lower left")
    ax.set_xlabel("step")
    ax.set_ylabel("value (log-spaced bins)")
    ax.set_title(f"{_short(layer, 50)} · {kind}: distribution over steps (lines: min, ±1σ, ±2σ "
                 f"percentiles, median, max)", fontsize="small")
    return fig


def comparison(da_a, da_b, labels=("run A", "run B"), ax=None):
    """One statistic of one layer in two runs (1-d ``xr.DataArray``s over step),
    side by side."""
    layer, kind, stat = da_a.attrs.get("layer", ""), da_a.attrs.get("kind", ""), da_a.name
    fig, ax = _figure(ax=ax)
    for da, style, name in ((da_a, "-", labels[0]), (da_b, "--", labels[1])):
        ax.plot(da.step.values, da.values, style, lw=1.4, label=_short(name, 40))
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(f"{_short(layer, 50)} · {kind} · {stat}: run A vs run B")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig
