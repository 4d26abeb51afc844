"""Pure tensor -> summary functions, no I/O.

``reduce(x)`` turns a tensor into one small float64 vector on the tensor's
own device (no host sync), holding the raw reductions and the raw histogram
codes.  Many such vectors are concatenated and moved to the host once per
step; ``finalize`` then turns each into the statistics of the store.

The reductions are NaN-safe: NaN and +/-Inf are counted and excluded from
every other statistic.  They run as one fused kernel through
``torch.compile`` when it works on this machine, and eagerly otherwise.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from .format import STATS, bins_from_codes

__all__ = ["is_float", "reduce", "split", "finalize", "summarize"]

# Layout of the reduction vector (before the histogram codes).
_FIELDS = ("count", "finite", "sum", "m2", "min", "max", "zeros", "negzeros",
           "nan", "posinf", "neginf", "sumsq")
_NF = len(_FIELDS)
_F32_CODES = 1 << 11
_F64_CODES = 1 << 14


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def _reductions(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1)
    fin = torch.isfinite(x)
    n = fin.sum().to(torch.float64)
    xd = torch.where(fin, x, 0).to(torch.float64)
    s = xd.sum()
    mean = s / n.clamp(min=1)
    d = torch.where(fin, xd - mean, 0)
    zero = x == 0
    inf = float("inf")
    return torch.stack([
        torch.full((), x.numel(), dtype=torch.float64, device=x.device),
        n,
        s,
        (d * d).sum(),
        torch.where(fin, x, inf).min().to(torch.float64),
        torch.where(fin, x, -inf).max().to(torch.float64),
        zero.sum().to(torch.float64),
        (zero & torch.signbit(x)).sum().to(torch.float64),
        torch.isnan(x).sum().to(torch.float64),
        (x == inf).sum().to(torch.float64),
        (x == -inf).sum().to(torch.float64),
        (xd * xd).sum(),
    ])


_compiled = None
_compile_lock = threading.Lock()


def _use_compile() -> bool:
    return os.environ.get("TENSORTAPE_COMPILE", "1") not in ("0", "false", "no")


def _fused(x: torch.Tensor) -> torch.Tensor:
    """The reductions, compiled once per process when possible."""
    global _compiled
    if _compiled is None:
        with _compile_lock:
            if _compiled is None:
                _compiled = False
                if _use_compile():
                    try:
                        fn = torch.compile(_reductions, dynamic=True)
                        probe = torch.tensor([1.0, float("nan"), 0.0], device=x.device)
                        torch.testing.assert_close(fn(probe), _reductions(probe), equal_nan=True)
                        _compiled = fn
                    except Exception:  # no compiler here: the eager path is exact too
                        _compiled = False
    if _compiled is not False:
        try:
            with torch.no_grad():    # one grad mode, so no recompiles between forward and backward
                return _compiled(x)
        except Exception:
            pass
    return _reductions(x)


def _codes(x: torch.Tensor) -> torch.Tensor:
    """Raw histogram codes ``sign | exponent | top 2 mantissa bits``, counted."""
    x = x.reshape(-1)
    if x.dtype == torch.float64:
        codes = (x.view(torch.int64) >> 50) & (_F64_CODES - 1)
        return torch.bincount(codes, minlength=_F64_CODES)
    if x.dtype != torch.float32:
        x = x.float()  # float16 and bfloat16 are exact in float32
    codes = (x.view(torch.int32) >> 21) & (_F32_CODES - 1)
    return torch.bincount(codes, minlength=_F32_CODES)


@torch.compiler.disable
def reduce(x: torch.Tensor) -> torch.Tensor:
    """One float64 vector (on ``x``'s device) summarising ``x``; no sync."""
    x = x.detach()
    if x.is_complex() or not x.is_floating_point():
        vec = torch.full((_NF,), float("nan"), dtype=torch.float64, device=x.device)
        vec[0] = x.numel()
        vec[8:11] = 0       # an integer or bool tensor holds no NaN or Inf
        return vec
    return torch.cat([_fused(x), _codes(x).to(torch.float64)])


def split(flat: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """Cut the host copy of concatenated ``reduce`` vectors apart again."""
    return np.split(flat, np.cumsum(lengths)[:-1]) if lengths else []


def finalize(vec: np.ndarray) -> tuple[dict[str, float], np.ndarray | None]:
    """Statistics (the store's names) and global histogram of one vector."""
    f = dict(zip(_FIELDS, vec[:_NF].tolist()))
    if vec.size == _NF:  # integer or bool tensor: a count and nothing else
        exact = {"count": f["count"], "nan": 0.0, "posinf": 0.0, "neginf": 0.0}
        return {k: exact.get(k, float("nan")) for k in STATS}, None
    n = f["finite"]
    mean = f["sum"] / n if n else float("nan")
    lo, hi = (f["min"], f["max"]) if n else (float("nan"), float("nan"))
    stats = {
        "count": f["count"],
        "mean": mean,
        "std": float(np.sqrt(max(f["m2"], 0.0) / n)) if n else float("nan"),
        "min": lo,
        "max": hi,
        "abs_max": max(abs(lo), abs(hi)) if n else float("nan"),
        "norm": float(np.sqrt(f["sumsq"])),
        "zero_frac": f["zeros"] / n if n else float("nan"),
        "nan": f["nan"],
        "posinf": f["posinf"],
        "neginf": f["neginf"],
    }
    hist = bins_from_codes(vec[_NF:], int(f["zeros"]), int(f["negzeros"]))
    return stats, hist


def summarize(x: torch.Tensor) -> tuple[dict[str, float], np.ndarray | None]:
    """Statistics and histogram of one tensor, on the host (syncs)."""
    return finalize(reduce(x).cpu().numpy())
