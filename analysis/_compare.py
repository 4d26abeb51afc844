"""Two runs compared layer by layer, step by step."""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt

from ._alike import absent, apart, no_common, runs, say, shape_note, shared, unlike
from ._metrics import step_metrics, steps_metrics, tensor_metrics
from ._run import Run
from ._select import Names, layer_coord, one_layer, steps_text

__all__ = ["compare_runs", "divergence", "first_divergence", "plot_comparison", "step_metrics",
           "tensor_metrics"]

_METRICS = ("rel_l2", "cosine", "max_abs", "sqnr_db")


def _tensor_metrics(a: Run, b: Run, layer: str, kind: str, steps):
    """``(step, step_metrics)`` of (``layer``, ``kind``) at each of ``steps`` that
    both runs hold full tensors of (in order; the metrics None where the runs
    share no micro-batch), a block of steps read at once from each run and
    compared together (``steps_metrics``)."""
    held = [r.steps(kind, tensors=True, layer=layer) for r in (a, b)]
    steps = np.intersect1d(np.intersect1d(*held), steps)
    for asked, got_a in a.tensor_blocks(layer, kind, steps):
        got_b = {}
        for _, part in b.tensor_blocks(layer, kind, asked):
            got_b.update(part)
        pairs = [(got_a.get(int(s), {}), got_b.get(int(s), {})) for s in asked]
        yield from zip((int(s) for s in asked), steps_metrics(pairs))


def _relative(sa: xr.Dataset, sb: xr.Dataset) -> xr.DataArray:
    """Per (step, layer), the largest relative difference of any statistic, as
    ``first_divergence`` measures it: |b - a| / max(|a|, |b|); NaN against a
    number is infinite, NaN against NaN is 0.  A layer that ran in one run and
    not in the other at a step differs infinitely; one that ran in neither is
    not compared (NaN)."""
    out = None
    for s in fmt.STATS:
        x, y = sa[s].astype(float), sb[s].astype(float)
        d = abs(y - x) / np.maximum(np.maximum(abs(x), abs(y)), 1e-30)
        d = xr.where(x.isnull() & y.isnull(), 0.0, xr.where(x.isnull() | y.isnull(), np.inf, d))
        d = xr.where(x == y, 0.0, d)
        out = d if out is None else np.maximum(out, d)
    gone_a, gone_b = absent(sa), absent(sb)
    return xr.where(gone_a & gone_b, np.nan, xr.where(gone_a | gone_b, np.inf, out))


def compare_runs(a, b, kind: str = "activations", layers=None, progress=None, *,
                 rank: int | None = None, strict: bool = False,
                 tensors: bool = True) -> xr.Dataset:
    """An ``xr.Dataset`` (step, layer) over the steps and layers both runs hold.

    Where both hold full tensors: ``rel_l2``, ``cosine``, ``max_abs``,
    ``sqnr_db`` of the step's tensors, every micro-batch both runs hold together
    as one batch (``step_metrics``; NaN elsewhere; for NaN and Inf, see
    ``tensor_metrics``); at every common step: ``delta_<stat>`` (b - a) of the
    statistics (counts as int64), and ``stat_rel``, the largest relative
    difference of any statistic.  ``first_divergence`` tests both: ``stat_rel``
    at every step, ``rel_l2`` where it is a number.  Each variable's ``covers``
    attribute, and the dataset's ``tensor_steps``/``tensor_layers``, say which
    steps and layers it covers; its ``unlike``, what makes the runs not alike.

    A layer that did not run at a step (an expert with no tokens) is marked in
    ``absent_a``/``absent_b``; where either is set, ``delta_<stat>`` is no
    difference (NaN, and 0 for counts), and ``stat_rel`` is infinite where the
    layer ran in one run only (the runs differ) and NaN where it ran in neither
    (not compared, not a divergence).  Statistics that either run reads as
    missing because their chunk is missing from its store are marked in
    ``unreadable``: not compared (``delta_<stat>`` as above, ``stat_rel`` NaN).

    a, b: run paths, URLs or ``Run`` objects.  kind: the kind compared.
    layers: glob pattern(s) narrowing the layers (default: all both runs hold).
    progress: wraps the iterable of layers whose full tensors are scanned
    (for example ``tqdm.tqdm``).  rank: which rank of each run (default: each
    run's first).  Raises ``ConfigError`` when the runs share no (layer, kind)
    with common steps.  Runs that are not alike (model classes, recorded layers,
    a shared layer's shape) are compared on the shared layers whose shapes agree,
    with one ``TensortapeWarning`` that says what differs (``strict``: a
    ``ConfigError`` instead).  tensors: False compares the statistics alone (no
    full tensor is read; no ``rel_l2``, ``cosine``, ``max_abs``, ``sqnr_db``).
    """
    a, b = runs(a, b, rank)         # opened once: their reads of the tensor tables are kept
    out = statistics(a, b, kind, layers, strict=strict)
    return with_tensors(out, a, b, progress) if tensors else out


def statistics(a, b, kind: str = "activations", layers=None, *, rank: int | None = None,
               strict: bool = False, shapes: bool = True) -> xr.Dataset:
    """``compare_runs``' answer of the statistics alone (``tensors=False``).
    ``shapes``: False leaves the shared layers' full-tensor shapes unchecked (no
    tensor table is read; ``with_tensors`` checks them), and says nothing of
    what makes the runs unlike (the dataset's ``unlike`` attribute has it)."""
    a, b = runs(a, b, rank)
    names, steps, notes, both = shared(a, b, kind, layers, strict, shapes)
    if both is None:
        raise no_common(a, b, [kind], layers, notes)
    if shapes:
        say(unlike(a, b, notes), stacklevel=4)
    sa, sb, unread = both
    gone = absent(sa) | absent(sb) | unread      # not a difference of the statistics there
    out = xr.Dataset({f"delta_{s}": xr.where(gone, 0 if s in fmt.COUNT_STATS else np.nan,
                                             sb[s] - sa[s]) for s in fmt.STATS})
    out["stat_rel"] = _relative(sa, sb).where(~unread)
    out["nonfinite"] = (sum(sa[k].clip(min=0) for k in fmt.COUNT_STATS[1:]) > 0) | \
        (sum(sb[k].clip(min=0) for k in fmt.COUNT_STATS[1:]) > 0)
    out["absent_a"], out["absent_b"] = absent(sa), absent(sb)
    out["unreadable"] = unread
    out.attrs.update(kind=kind, a=a.path, b=b.path, tensor_steps=[], tensor_layers=[],
                     layers_compared=names, unlike=notes)
    return _covered(out)


def _covered(out: xr.Dataset) -> xr.Dataset:
    """``out`` with each statistic's ``covers``: the steps and layers compared."""
    unread = out["unreadable"]
    cover = f"statistics: {steps_text(out.step.values)} x {out.sizes['layer']} layers"
    if bool(unread.any()):
        cover += (f", less {int(unread.sum())} (step, layer) unreadable (a chunk missing "
                  f"from the store)")
    for v in out.data_vars:
        out[v].attrs["covers"] = cover
    return out


def with_tensors(out: xr.Dataset, a, b, progress=None, rank: int | None = None,
                 known: xr.Dataset | None = None) -> xr.Dataset:
    """``compare_runs``' answer of the statistics alone (``statistics``) with its
    full tensors' metrics added (a new dataset): of the layers it compared that
    both runs hold full tensors of in one shape (a layer they hold in other
    shapes is left out, and said in the ``unlike`` attribute).  a, b, rank: the
    runs and rank it compared.  known: an answer of these runs before their last
    commits (a live run): its metrics are kept at the steps it was over, and only
    the other steps' full tensors are read."""
    a, b = runs(a, b, rank)
    kind, names = out.attrs["kind"], list(out.attrs["layers_compared"])
    bad = apart(a, b, kind, names)
    if bad:
        names = [n for n in names if n not in bad]
        out = _covered(out.sel(layer=layer_coord(names)).assign_attrs(
            layers_compared=names, unlike=[*out.attrs["unlike"], shape_note(bad)]))
    steps = out.step.values
    out = carried(out, known)     # a step compared without full tensors is read again: the
    scan = np.setdiff1d(steps, out.attrs["tensor_steps"])   # ring's dump stores them later
    tensor_steps, tensor_layers = set(out.attrs["tensor_steps"]), list(out.attrs["tensor_layers"])
    ta, tb = (set(r.tensor_layers(kind)) for r in (a, b))
    both = [n for n in names if n in ta and n in tb]
    if both:
        vals = {m: out[m].values.copy() if m in out else np.full((len(steps), len(names)), np.nan)
                for m in _METRICS}
        column = {n: j for j, n in enumerate(names)}
        at = {int(s): i for i, s in enumerate(steps)}
        for layer in (progress(both) if progress else both):
            j = column[layer]
            for s, m in _tensor_metrics(a, b, layer, kind, scan):
                if m is None:
                    continue
                for k, v in m.items():
                    vals[k][at[s], j] = v
                tensor_steps.add(s)
                if layer not in tensor_layers:
                    tensor_layers.append(layer)
        for k in _METRICS:
            out[k] = (("step", "layer"), vals[k])
    return _tensors_covered(out, tensor_steps, tensor_layers)


def carried(out: xr.Dataset, known: xr.Dataset | None) -> xr.Dataset:
    """``out`` (``statistics``' answer) with ``known``'s full tensors' metrics (an
    answer of ``with_tensors`` over earlier steps of the same runs) at the steps and
    layers both are over, NaN elsewhere (a new dataset); ``covers`` and
    ``tensor_steps``/``tensor_layers`` say what they cover."""
    out = out.copy()
    if known is None or "rel_l2" not in known:
        return out.assign_attrs(tensor_steps=[], tensor_layers=[])
    steps, names = out.step.values, out.layer.values.tolist()
    i = np.flatnonzero(np.isin(steps, known.step.values))
    ki = np.searchsorted(known.step.values, steps[i])
    row = {n: j for j, n in enumerate(known.layer.values.tolist())}
    j = [c for c, n in enumerate(names) if n in row]
    kj = [row[names[c]] for c in j]
    for k in _METRICS:
        vals = np.full((len(steps), len(names)), np.nan)
        vals[np.ix_(i, j)] = known[k].transpose("step", "layer").values[np.ix_(ki, kj)]
        out[k] = (("step", "layer"), vals)
    held = set(int(s) for s in steps[i])
    return _tensors_covered(out, [s for s in known.attrs["tensor_steps"] if s in held],
                            [n for n in known.attrs["tensor_layers"] if n in set(names)])


def _tensors_covered(out: xr.Dataset, steps, layers) -> xr.Dataset:
    """``out`` with its full tensors' metrics' ``covers``: ``steps`` x ``layers``."""
    covers = f"full tensors: {steps_text(sorted(steps))} x {len(layers)} layers"
    for k in _METRICS:
        if k in out:
            out[k].attrs["covers"] = covers
    return out.assign_attrs(tensor_steps=sorted(int(s) for s in steps), tensor_layers=list(layers))


def first_divergence(a, b, rtol: float = 1e-3, kinds=None, layers=None, *,
                     rank: int | None = None, strict: bool = False) -> tuple[int, str] | None:
    """The first (step, layer) where the runs differ, or None.

    Steps in order; within a step, forward kinds before gradients, each in
    execution order.  A capture differs where any statistic differs by more
    than ``rtol`` relatively (``compare_runs``' ``stat_rel``), or, where both
    runs hold its full tensors, where their ``rel_l2`` over every micro-batch
    both hold is above ``rtol``: a full tensor never hides a difference of the
    statistics, which cover every micro-batch.  ``kinds`` and ``layers`` (glob
    patterns) narrow the search; ``rank`` picks the rank of each run (default:
    each run's first).  Raises ``ConfigError`` when the runs share no (layer,
    kind) with common steps.  Runs not alike: as in ``compare_runs`` (only the
    shared layers whose shapes agree; ``strict``).
    """
    a, b = runs(a, b, rank)
    order = {n: i for i, n in enumerate(a.layers)}
    asked = list(kinds or fmt.FORWARD_KINDS + fmt.BACKWARD_KINDS)
    kinds = [k for k in asked if k in a.kinds and k in b.kinds]
    per_kind, unlikes = {}, []
    for kind in kinds:
        names, steps, notes, both = shared(a, b, kind, layers, strict)
        unlikes.append(notes)
        if both is not None:
            sa, sb, unread = both
            names = sorted(names, key=lambda n: order.get(n, 1 << 30))
            held = [set(r.tensor_layers(kind)) for r in (a, b)]
            rel = _relative(sa, sb).where(~unread).sel(layer=layer_coord(names))
            per_kind[kind] = (names, steps, rel.transpose("step", "layer").values,
                              [n in held[0] and n in held[1] for n in names])
    if not per_kind:
        raise no_common(a, b, kinds or asked, layers, next((u for u in unlikes if u), ()))
    for text in dict.fromkeys(unlike(a, b, u) for u in unlikes if u):
        say(text)
    # the first (step, kind, layer) in that order where the statistics differ; then
    # each layer's full tensors, read in step order only up to the first found so far
    first = None
    for ki, (names, steps, rel, both) in per_kind.items():
        for i, j in np.argwhere(rel > rtol):
            hit = (int(steps[i]), kinds.index(ki), int(j))
            first = hit if first is None or hit < first else first
    for ki, (names, steps, rel, both) in per_kind.items():
        for j, layer in enumerate(names):
            if not both[j]:
                continue
            upto = steps if first is None else steps[steps <= first[0]]
            for s, m in _tensor_metrics(a, b, layer, ki, upto):
                if m is not None and not m["rel_l2"] <= rtol:
                    hit = (s, kinds.index(ki), j)
                    first = hit if first is None or hit < first else first
                    break
    if first is None:
        return None
    step, k, j = first
    return step, per_kind[kinds[k]][0][j]


def divergence(ds: xr.Dataset, rtol: float = 1e-3) -> tuple[int, str] | None:
    """``first_divergence`` of one kind, read from its ``compare_runs`` answer
    (which has scanned the full tensors already): the first (step, layer), in
    step order, then execution order, where ``stat_rel`` or ``rel_l2`` is above
    ``rtol``; or None."""
    differ = ds["stat_rel"] > rtol
    if "rel_l2" in ds:
        differ = differ | ~(ds["rel_l2"].isnull() | (ds["rel_l2"] <= rtol))
    hits = np.argwhere(differ.transpose("step", "layer").values)
    if not len(hits):
        return None
    i, j = hits[0]
    return int(ds.step.values[i]), str(ds.layer.values[j])


_LOWEST_IS_WORST = ("cosine", "sqnr_db")


def summarize(ds: xr.Dataset) -> xr.Dataset:
    """``compare_runs``'s result per layer, each metric at its worst step: the
    largest ``rel_l2``, ``max_abs`` and ``|delta_<stat>|``, the smallest ``cosine``
    and ``sqnr_db`` (``cosine`` NaN where the tensors are apart at a step:
    ``tensor_metrics``); ``worst_step``, the step whose statistics differ most
    (``stat_rel``), and ``rel_l2_step``, the full-tensor step with the largest
    ``rel_l2``.  Steps are int64 (-1: none), counts int64."""
    cols = [c for c in ("rel_l2", "cosine", "max_abs", "sqnr_db", "delta_mean", "delta_std",
                        "delta_abs_max", "delta_nan") if c in ds]
    out = xr.Dataset({c: ds[c].min("step") if c in _LOWEST_IS_WORST else
                      (abs(ds[c]) if c.startswith("delta_") else ds[c]).max("step")
                      for c in cols})
    if "cosine" in out:      # NaN at a step compared (tensors apart) is the worst: no angle
        apart = (ds["rel_l2"].notnull() & ds["cosine"].isnull()).any("step")
        out["cosine"] = out["cosine"].where(~apart)
    out["stat_rel"] = ds["stat_rel"].max("step")
    out["worst_step"] = ("layer", _argmax_step(ds["stat_rel"]))
    if "rel_l2" in ds:
        out["rel_l2_step"] = ("layer", _argmax_step(ds["rel_l2"]))
    return out


def _argmax_step(da: xr.DataArray) -> np.ndarray:
    """Per layer, the first step where ``da`` is largest, or -1 where it holds
    no number."""
    v = da.transpose("layer", "step").values.astype(float)
    steps = da.step.values.astype(np.int64)
    out = np.full(v.shape[0], -1, np.int64)
    for j, row in enumerate(v):
        if not np.isnan(row).all():
            out[j] = steps[int(np.nanargmax(row))]
    return out


def difference_map(a, b, kind: str = "activations", layers=None,
                   ds: xr.Dataset | None = None) -> xr.DataArray:
    """How much two runs differ, layer x step, in the metric the ``compare``
    table uses: ``rel_l2`` when both runs hold every full tensor compared, else
    ``stat_rel`` (the largest relative difference of any statistic)."""
    ds = compare_runs(a, b, kind, layers) if ds is None else ds
    ran = ~(ds["absent_a"] | ds["absent_b"]) if "absent_a" in ds else True
    full = "rel_l2" in ds and bool((ds["rel_l2"].notnull() | ~ran).all())
    metric = "rel_l2" if full else "stat_rel"
    return ds[metric].transpose("layer", "step").rename(metric)


def plot_comparison(a, b, layer, kind="activations", stat="std", rtol: float = 1e-3, *,
                    ds: xr.Dataset | None = None, first=False, rank: int | None = None):
    """Where two runs part -> Figure: a layer x step map of their difference (the
    table's metric: ``rel_l2`` where both hold every full tensor, else
    ``stat_rel``), NaN/Inf cells marked, the first divergence circled; beside it
    ``stat`` of ``layer`` in both runs.

    a, b: run paths or ``Run`` objects.  layer: the layer whose lines are drawn.
    kind: the kind compared.  stat: the statistic of the lines.  rtol: as in
    ``first_divergence``.  ds, first: ``compare_runs``' and ``first_divergence``'s
    answers when the caller has them already (they scan full tensors).  rank:
    as in ``compare_runs``."""
    import os
    from .plots import _plots
    a, b = runs(a, b, rank)
    ds = compare_runs(a, b, kind) if ds is None else ds
    lines = []
    for r in (a, b):
        st = one_layer(r.stats(kind, Names([layer]))).compute()
        bad = sum(st[k].clip(min=0) for k in fmt.COUNT_STATS[1:])
        lines.append(st[stat].assign_coords(nonfinite=bad, absent=absent(st))
                     .assign_attrs(layer=layer, kind=kind))
    first = divergence(ds, rtol) if first is False else first
    names = [os.path.basename(r.path.rstrip("/")) or r.path for r in (a, b)]
    if names[0] == names[1]:
        names = [_short_path(r.path) for r in (a, b)]
    return _plots.comparison(difference_map(a, b, kind, ds=ds), *lines, labels=names, first=first,
                             nonfinite=ds["nonfinite"])


def _short_path(path: str) -> str:
    parts = path.rstrip("/").split("/")
    return "/".join(parts[-2:])
