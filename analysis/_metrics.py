"""How two full tensors differ: ``rel_l2``, ``cosine``, ``max_abs`` and
``sqnr_db``, of one tensor (``tensor_metrics``) or of one step's micro-batches
together (``step_metrics``), and what each gives where NaN or Inf is there."""

from __future__ import annotations

import numpy as np

__all__ = ["step_metrics", "tensor_metrics"]

_APART = {"rel_l2": np.inf, "cosine": np.nan, "max_abs": np.inf, "sqnr_db": -np.inf}


def tensor_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """rel_l2, cosine, max_abs and SQNR (dB) of ``b`` against ``a``, over the
    elements finite in both.  The same NaN or Inf in both (NaN padding too) is
    the same and left out.  A non-finite element the other run does not share,
    or another shape, makes them as different as can be: ``rel_l2`` and
    ``max_abs`` inf, ``sqnr_db`` -inf, and ``cosine`` NaN (no angle between
    them).  Where either is all zeros (or nothing is left), ``cosine`` is 1
    when both are, else 0."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:                 # not the same tensor
        return dict(_APART)
    a, b = a.ravel(), b.ravel()
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.all():
        same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
        if not (same | finite).all():
            return dict(_APART)
        a, b = a[finite], b[finite]
    na, nd = np.linalg.norm(a), np.linalg.norm(b - a)
    nb = np.linalg.norm(b)
    return {
        "rel_l2": nd / na if na else (0.0 if nd == 0 else np.inf),
        "cosine": float(a @ b / (na * nb)) if na and nb else float(na == nb),
        "max_abs": float(np.max(np.abs(b - a))) if a.size else 0.0,
        "sqnr_db": float(20 * np.log10(na / nd)) if nd else np.inf,
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
    flat = [np.concatenate([np.ravel(x[k]) for k in common]) for x in (a, b)]
    return tensor_metrics(*flat)
