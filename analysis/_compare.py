"""Two runs compared layer by layer, step by step."""

from __future__ import annotations

import numpy as np
import xarray as xr

from recorder import format as fmt

from ._run import Run, open_run

__all__ = ["compare_runs", "first_divergence", "plot_comparison", "tensor_metrics"]

_METRICS = ("rel_l2", "cosine", "max_abs", "sqnr_db")


def tensor_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """rel_l2, cosine, max_abs and SQNR (dB) of ``b`` against ``a`` (NaN-padding ignored)."""
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    na, nd = np.linalg.norm(a), np.linalg.norm(b - a)
    nb = np.linalg.norm(b)
    return {
        "rel_l2": nd / na if na else (0.0 if nd == 0 else np.inf),
        "cosine": float(a @ b / (na * nb)) if na and nb else float(na == nb),
        "max_abs": float(np.max(np.abs(b - a))) if a.size else 0.0,
        "sqnr_db": float(20 * np.log10(na / nd)) if nd else np.inf,
    }


def _common(a: Run, b: Run, kind: str, layers) -> tuple[list[str], np.ndarray]:
    la = set(a.stats(kind, layers).layer.values.tolist())
    names = [n for n in b.stats(kind, layers).layer.values.tolist() if n in la]
    steps = np.intersect1d(a.steps(kind), b.steps(kind))
    return names, steps


def compare_runs(a, b, kind: str = "activations", layers=None, progress=None) -> xr.Dataset:
    """An ``xr.Dataset`` (step, layer) over the steps and layers both runs hold.

    Where both hold full tensors: ``rel_l2``, ``cosine``, ``max_abs``,
    ``sqnr_db``; otherwise ``delta_<stat>`` (b - a) of the statistics.
    ``progress`` wraps the iterable of layers whose full tensors are scanned
    (for example ``click.progressbar`` or ``tqdm.tqdm``).
    """
    a, b = open_run(a), open_run(b)
    names, steps = _common(a, b, kind, layers)
    sa = a.stats(kind, names).sel(step=steps).compute()
    sb = b.stats(kind, names).sel(step=steps).compute()
    out = xr.Dataset({f"delta_{s}": sb[s] - sa[s] for s in fmt.STATS})
    ta, tb = set(a.tensor_layers(kind)), set(b.tensor_layers(kind))
    both = [n for n in names if n in ta and n in tb]
    if both:
        tsteps = np.intersect1d(a.steps(kind, tensors=True), b.steps(kind, tensors=True))
        tsteps = np.intersect1d(tsteps, steps)
        vals = {m: np.full((len(steps), len(names)), np.nan) for m in _METRICS}
        column = {n: j for j, n in enumerate(names)}
        for layer in (progress(both) if progress else both):
            j = column[layer]
            sa_t = a.steps(kind, tensors=True, layer=layer)
            sb_t = b.steps(kind, tensors=True, layer=layer)
            for s in np.intersect1d(np.intersect1d(sa_t, sb_t), tsteps):
                i = int(np.nonzero(steps == s)[0][0])
                m = tensor_metrics(a.tensor(layer, kind, step=int(s)).values,
                                   b.tensor(layer, kind, step=int(s)).values)
                for k, v in m.items():
                    vals[k][i, j] = v
        for k in _METRICS:
            out[k] = (("step", "layer"), vals[k])
    out.attrs.update(kind=kind, a=a.path, b=b.path)
    return out


def _stat_differs(x: float, y: float, rtol: float) -> bool:
    if np.isnan(x) and np.isnan(y):
        return False
    return not abs(x - y) <= rtol * max(abs(x), abs(y), 1e-30)


def first_divergence(a, b, rtol: float = 1e-3, kinds=None, layers=None) -> tuple[int, str] | None:
    """The first (step, layer) where the runs differ, or None.

    Steps in order; within a step, forward kinds before gradients, each in
    execution order.  ``rel_l2 > rtol`` decides where both runs hold the full
    tensor; otherwise any statistic differing by more than ``rtol`` relatively.
    ``kinds`` and ``layers`` (glob patterns) narrow the search.
    """
    a, b = open_run(a), open_run(b)
    order = {n: i for i, n in enumerate(a.layers)}
    kinds = [k for k in (kinds or fmt.FORWARD_KINDS + fmt.BACKWARD_KINDS) if k in a.kinds and k in b.kinds]
    per_kind = {}
    for kind in kinds:
        names, steps = _common(a, b, kind, layers)
        if names and len(steps):
            sa = a.stats(kind, names).sel(step=steps).compute()
            sb = b.stats(kind, names).sel(step=steps).compute()
            per_kind[kind] = (sorted(names, key=lambda n: order.get(n, 1 << 30)), steps, sa, sb,
                              set(a.tensor_layers(kind)), set(b.tensor_layers(kind)))
    all_steps = sorted({int(s) for v in per_kind.values() for s in v[1]})
    tensor_steps: dict = {}

    def has_tensor(r, kind, layer, step) -> bool:
        key = (id(r), kind, layer)
        if key not in tensor_steps:
            tensor_steps[key] = set(r.steps(kind, True, layer=layer).tolist())
        return step in tensor_steps[key]

    for step in all_steps:
        for kind in kinds:
            if kind not in per_kind:
                continue
            names, steps, sa, sb, ta, tb = per_kind[kind]
            if step not in steps:
                continue
            for layer in names:
                if layer in ta and layer in tb and has_tensor(a, kind, layer, step) \
                        and has_tensor(b, kind, layer, step):
                    m = tensor_metrics(a.tensor(layer, kind, step=step).values,
                                       b.tensor(layer, kind, step=step).values)
                    if not m["rel_l2"] <= rtol:
                        return step, layer
                    continue
                xa, xb = sa.sel(step=step, layer=layer), sb.sel(step=step, layer=layer)
                if any(_stat_differs(float(xa[s]), float(xb[s]), rtol) for s in fmt.STATS):
                    return step, layer
    return None


_LOWEST_IS_WORST = ("cosine", "sqnr_db")


def summarize(ds: xr.Dataset) -> xr.Dataset:
    """``compare_runs``'s result per layer, each metric at its worst step: the
    largest ``rel_l2``, ``max_abs`` and ``|delta_<stat>|``, the smallest ``cosine``
    and ``sqnr_db``."""
    cols = [c for c in ("rel_l2", "cosine", "max_abs", "sqnr_db", "delta_mean", "delta_std",
                        "delta_abs_max", "delta_nan") if c in ds]
    return xr.Dataset({c: ds[c].min("step") if c in _LOWEST_IS_WORST else
                       (abs(ds[c]) if c.startswith("delta_") else ds[c]).max("step")
                       for c in cols})


def difference_map(a, b, kind: str = "activations", stat: str = "std", layers=None,
                   ds: xr.Dataset | None = None) -> xr.DataArray:
    """How much two runs differ, layer x step: ``rel_l2`` when both runs hold every
    full tensor compared, else (one metric for the whole map) the relative
    difference of ``stat``, |b - a| / max(|a|, |b|)."""
    a, b = open_run(a), open_run(b)
    ds = compare_runs(a, b, kind, layers) if ds is None else ds
    names, steps = list(ds.layer.values), ds.step.values
    sa = a.stats(kind, names)[stat].sel(step=steps).compute()
    sb = b.stats(kind, names)[stat].sel(step=steps).compute()
    rel = abs(sb - sa) / np.maximum(np.maximum(abs(sa), abs(sb)), 1e-30)
    full = "rel_l2" in ds and bool(ds["rel_l2"].notnull().all())
    out = ds["rel_l2"] if full else rel
    metric = "rel_l2" if full else f"relative difference of {stat}"
    return out.transpose("layer", "step").rename(metric)


def plot_comparison(a, b, layer, kind="activations", stat="std", rtol: float = 1e-3):
    """Where two runs part -> Figure: a layer x step heat map of their difference
    (``rel_l2`` where both hold full tensors, else the relative difference of
    ``stat``) with the first divergence marked, beside ``stat`` of ``layer`` in both."""
    import os
    from . import _plots
    a, b = open_run(a), open_run(b)
    lines = [r.stats(kind, [layer])[stat].isel(layer=0).compute().assign_attrs(layer=layer, kind=kind)
             for r in (a, b)]
    diff = difference_map(a, b, kind, stat)
    first = first_divergence(a, b, rtol=rtol, kinds=[kind])
    names = [os.path.basename(r.path.rstrip("/")) or r.path for r in (a, b)]
    if names[0] == names[1]:
        names = [_short_path(r.path) for r in (a, b)]
    return _plots.comparison(diff, *lines, labels=names, first=first)


def _short_path(path: str) -> str:
    parts = path.rstrip("/").split("/")
    return "/".join(parts[-2:])
