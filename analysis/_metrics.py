"""How two full tensors differ: ``rel_l2``, ``cosine``, ``max_abs`` and
``sqnr_db``, of one tensor (``tensor_metrics``) or of one step's micro-batches
together (``step_metrics``), and what each gives where NaN or Inf is there."""

from __future__ import annotations

import numpy as np

__all__ = ["rows_metrics", "step_metrics", "steps_metrics", "tensor_metrics"]

_APART = {"rel_l2": np.inf, "cosine": np.nan, "max_abs": np.inf, "sqnr_db": -np.inf}


def _exact(x) -> np.ndarray:
    """``x`` as float64 (complex128 where complex), every value kept: a signalling
    NaN (float8's, as torch widens it) becomes a quiet one, as the cast's
    "invalid value" says, and is no news."""
    x = np.asarray(x)
    with np.errstate(invalid="ignore"):
        return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64, copy=False)


def _ldexp(x: np.ndarray, e) -> np.ndarray:
    """``x`` times 2**e (a row's ``e`` a row), exactly where the result is normal
    (complex: each part)."""
    f = x.view(np.float64)
    e = np.asarray(e)
    with np.errstate(under="ignore", over="ignore"):
        return np.ldexp(f, e.reshape(e.shape + (1,) * (f.ndim - e.ndim))).view(x.dtype)


def _unit(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of ``x`` scaled by a power of two so that its largest magnitude lies
    in [0.5, 1), and the exponent it was scaled by (0 for zeros)."""
    m = np.max(np.abs(x.view(np.float64)), axis=-1, initial=0.0)
    e = np.where(m > 0, np.frexp(m)[1], 0)
    return _ldexp(x, -e), e


def _dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each row's real dot product (``np.vdot(x, y).real``, as BLAS sums it)."""
    x, y = x.view(np.float64), y.view(np.float64)
    return np.matmul(x[:, None, :], y[:, :, None])[:, 0, 0]


def _metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """``tensor_metrics`` of each row of ``a`` and ``b`` (float64 or complex128,
    every value finite), as arrays."""
    (ua, ea), (ub, eb) = _unit(a), _unit(b)
    with np.errstate(over="ignore", invalid="ignore"):
        d = b - a                          # rounded once; inf only where it passes float64:
    past = ~np.isfinite(d.view(np.float64)).all(axis=-1)
    if past.any():                         # then, of halves (exact at that size)
        d[past] = _ldexp(b[past], -1) - _ldexp(a[past], -1)
    ud, ed = _unit(d)
    ed = ed + past
    na, nb, nd = (np.sqrt(_dot(x, x)) for x in (ua, ub, ud))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):   # past float64: inf
        rel = np.where(na > 0, np.ldexp(nd / na, ed - ea), np.where(nd == 0, 0.0, np.inf))
        biggest = np.ldexp(np.max(np.abs(ud), axis=-1, initial=0.0), ed)
        both = (na > 0) & (nb > 0)
        cosine = np.where(both, np.clip(_dot(ua, ub) / na / nb, -1, 1), (na == nb) * 1.0)
        sqnr = np.where(nd > 0, 20 * (np.log10(na / nd) + (ea - ed) * np.log10(2)), np.inf)
    return {"rel_l2": rel, "cosine": cosine, "max_abs": biggest, "sqnr_db": sqnr}


def _prepared(a, b):
    """``a`` and ``b`` flat, exact, and of the elements finite in both; or None
    where they are as different as can be (another shape, a non-finite element
    the other does not share)."""
    a, b = _exact(a), _exact(b)
    if a.shape != b.shape:                 # not the same tensor
        return None
    a, b = a.ravel(), b.ravel()
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.all():
        same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
        if not (same | finite).all():
            return None
        a, b = a[finite], b[finite]
    return a, b


def tensor_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """rel_l2, cosine, max_abs and SQNR (dB) of ``b`` against ``a``, over the
    elements finite in both.  The same NaN or Inf in both (NaN padding too) is
    the same and left out.  A non-finite element the other run does not share,
    or another shape, makes them as different as can be: ``rel_l2`` and
    ``max_abs`` inf, ``sqnr_db`` -inf, and ``cosine`` NaN (no angle between
    them).  Where either is all zeros (or nothing is left), ``cosine`` is 1
    when both are, else 0.

    Each of ``a``, ``b`` and their difference is scaled by a power of two
    (exact) to a largest magnitude near 1 before its norm, so the metrics are
    right for any finite values (no square overflows or underflows); a metric
    is inf only where its value passes float64."""
    got = _prepared(a, b)
    if got is None:
        return dict(_APART)
    return {k: float(v[0]) for k, v in _metrics(got[0][None], got[1][None]).items()}


def rows_metrics(a: np.ndarray, b: np.ndarray) -> list[dict[str, float]]:
    """``tensor_metrics`` of each row of ``a`` and ``b`` (two arrays of one shape,
    a row a tensor), the rows finite in both at once."""
    a, b = _exact(a).reshape(len(a), -1), _exact(b).reshape(len(b), -1)
    finite = np.isfinite(a.view(np.float64)).all(axis=-1) & np.isfinite(b.view(np.float64)).all(axis=-1)
    out = [None] * len(a)
    if finite.any():
        got = _metrics(a[finite], b[finite])
        for j, i in enumerate(np.flatnonzero(finite)):
            out[i] = {k: float(v[j]) for k, v in got.items()}
    for i in np.flatnonzero(~finite):
        out[i] = tensor_metrics(a[i], b[i])
    return out


def step_metrics(a: dict, b: dict) -> dict[str, float] | None:
    """``tensor_metrics`` of one step's full tensors in two runs (micro-batch ->
    array, as ``Run.micro_batches`` gives them), every micro-batch both hold
    together, as one batch (as the statistics are): a micro-batch of another
    shape makes them as different as can be.  None where they hold no
    micro-batch in common."""
    return steps_metrics([(a, b)])[0]


def steps_metrics(pairs) -> list[dict[str, float] | None]:
    """``step_metrics`` of each ``(a, b)`` of ``pairs``; the steps whose common
    micro-batches have the same shapes computed together, as rows of one array."""
    out: list = [None] * len(pairs)
    alike: dict = {}
    for i, (a, b) in enumerate(pairs):
        common = tuple(sorted(set(a) & set(b)))
        shapes = tuple(np.shape(a[k]) for k in common)
        if not common:
            continue
        if shapes != tuple(np.shape(b[k]) for k in common):
            out[i] = dict(_APART)
        else:
            alike.setdefault((common, shapes), []).append(i)
    for (common, _), at in alike.items():
        x, y = (np.stack([np.concatenate([np.ravel(pairs[i][side][k]) for k in common])
                          for i in at]) for side in (0, 1))
        for i, m in zip(at, rows_metrics(x, y)):
            out[i] = m
    return out
