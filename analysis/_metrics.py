"""How two full tensors differ: ``rel_l2``, ``cosine``, ``max_abs`` and
``sqnr_db``, of one tensor (``tensor_metrics``) or of one step's micro-batches
together (``step_metrics``), and what each gives where NaN or Inf is there."""

from __future__ import annotations

import numpy as np

__all__ = ["step_metrics", "tensor_metrics"]

_APART = {"rel_l2": np.inf, "cosine": np.nan, "max_abs": np.inf, "sqnr_db": -np.inf}


def _exact(x) -> np.ndarray:
    """``x`` as float64 (complex128 where complex), every value kept: a signalling
    NaN (float8's, as torch widens it) becomes a quiet one, as the cast's
    "invalid value" says, and is no news."""
    x = np.asarray(x)
    with np.errstate(invalid="ignore"):
        return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64, copy=False)


def _ldexp(x: np.ndarray, e: int) -> np.ndarray:
    """``x`` times 2**e, exactly where the result is normal (complex: each part)."""
    with np.errstate(under="ignore", over="ignore"):
        return np.ldexp(x.view(np.float64), e).view(x.dtype)


def _unit(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x`` scaled by a power of two so that its largest magnitude lies in [0.5, 1),
    and the exponent it was scaled by (0 for zeros)."""
    m = float(np.max(np.abs(x.view(np.float64)))) if x.size else 0.0
    e = int(np.frexp(m)[1]) if m else 0
    return _ldexp(x, -e), e


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
    a, b = _exact(a), _exact(b)
    if a.shape != b.shape:                 # not the same tensor
        return dict(_APART)
    a, b = a.ravel(), b.ravel()
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.all():
        same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
        if not (same | finite).all():
            return dict(_APART)
        a, b = a[finite], b[finite]
    (ua, ea), (ub, eb) = _unit(a), _unit(b)
    with np.errstate(over="ignore"):
        d = b - a                          # rounded once; inf only where it passes float64:
    if np.isfinite(d).all():
        ud, ed = _unit(d)
    else:                                  # then, of halves (exact at that size)
        ud, ed = _unit(_ldexp(b, -1) - _ldexp(a, -1))
        ed += 1
    na, nb, nd = (float(np.linalg.norm(x)) for x in (ua, ub, ud))
    with np.errstate(over="ignore"):       # past float64: inf
        rel = float(np.ldexp(nd / na, ed - ea)) if na else (0.0 if nd == 0 else np.inf)
        biggest = float(np.ldexp(np.max(np.abs(ud)), ed)) if ud.size else 0.0
    return {
        "rel_l2": rel,
        "cosine": float(np.clip(np.vdot(ua, ub).real / na / nb, -1, 1)) if na and nb
        else float(na == nb),
        "max_abs": biggest,
        "sqnr_db": float(20 * (np.log10(na / nd) + (ea - ed) * np.log10(2))) if nd else np.inf,
    }


def step_metrics(a: dict, b: dict) -> dict[str, float] | None:
    """``tensor_metrics`` of one step's full tensors in two runs (micro-batch ->
    array, as ``Run.micro_batches`` gives them), every micro-batch both hold
    together, as one batch (as the statistics are): a micro-batch of another
    shape makes them as different as can be.  None where they hold no
    micro-batch in common."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    if any(np.shape(a[k]) != np.shape(b[k]) for k in common):
        return dict(_APART)
    flat = [np.concatenate([np.ravel(_exact(x[k])) for k in common]) for x in (a, b)]
    return tensor_metrics(*flat)
