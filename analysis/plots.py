"""Plots of a run. Each returns a matplotlib Figure; none calls ``plt.show()``."""

from __future__ import annotations

import numpy as np

__all__ = ["plot_histogram", "plot_evolution", "plot_distribution", "plot_comparison"]


def _figure(figsize=(7, 4)):
    from matplotlib.figure import Figure      # no pyplot: headless, no global state
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _centers(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A plotting position per bin on a symlog axis (tails at their finite edge)."""
    c = np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, np.where(np.isfinite(lo), lo, hi))
    return c


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


def plot_histogram(run, layer, kind="activations", steps=None, ax=None):
    """Histogram of one layer at one or more steps: log counts, NaN/Inf marked."""
    h = run.histogram(layer, kind).compute()
    all_steps = h.step.values
    if steps is None:
        steps = [int(all_steps[-1])] if len(all_steps) else []
    elif np.isscalar(steps):
        steps = [int(steps)]
    fig, ax = _figure() if ax is None else (ax.figure, ax)
    lo, hi = h.bin_lo.values, h.bin_hi.values
    x = _centers(lo, hi)
    nz_any = np.zeros(len(x), bool)
    for s in steps:
        row = h.sel(step=s)
        counts = row.values.astype(float)
        nz_any |= counts > 0
        bad = {k: int(row[k]) for k in ("nan", "posinf", "neginf")}
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


def plot_evolution(run, layers=None, kind="activations", stat="std", ax=None, max_legend=12):
    """One statistic over steps, one line per layer (log scale where it fits)."""
    ds = run.stats(kind, layers)
    if stat not in ds:
        from recorder.errors import ConfigError
        raise ConfigError(f"stat {stat!r} is not recorded; use one of {', '.join(ds.data_vars)}")
    da = ds[stat].compute()
    fig, ax = _figure((8, 4.5)) if ax is None else (ax.figure, ax)
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


def plot_distribution(run, layer, kind="activations", ax=None):
    """Step x value heat map of the histogram over time, with percentile bands."""
    from matplotlib.colors import LogNorm
    h = run.histogram(layer, kind).compute()
    counts = h.values.astype(float)
    lo, hi = h.bin_lo.values, h.bin_hi.values
    fig, ax = _figure((8, 4.5)) if ax is None else (ax.figure, ax)
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


def plot_comparison(a, b, layer, kind="activations", stat="std", ax=None):
    """A statistic of one layer in two runs, side by side over the steps."""
    from .compare import _as_run
    a, b = _as_run(a), _as_run(b)
    fig, ax = _figure() if ax is None else (ax.figure, ax)
    for run, style in ((a, "-"), (b, "--")):
        da = run.stats(kind, [layer])[stat].isel(layer=0).compute()
        ax.plot(da.step.values, da.values, style, lw=1.4, label=_short(run.path, 40))
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(f"{_short(layer, 50)} · {kind} · {stat}: run A vs run B")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig
