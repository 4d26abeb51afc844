"""Pure tensor -> summary functions: no I/O, no caches, no device policy.

A tensor's *summary vector* is one float64 vector on the tensor's own device:
the NaN-safe reductions (``FIELDS``), then the counts of its histogram codes
(``format.code_width(exp_bits)`` of them; see ``format.encode``).  Integer,
bool, complex and empty tensors get a vector holding only their element count
(``exp_bits == 0``).  A statistics engine (``_engines``) computes vectors on
the device with the kernels below; ``finalize`` turns a batch of them, on the
host, into the statistics and histograms of the store in vectorised passes.

Sums accumulate in float64 around a shift taken from the tensor itself, so
the variance does not cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import format as fmt

__all__ = ["COUNTS", "FIELDS", "LANES", "NARROW", "Summaries", "codes", "exp_bits_of", "finalize",
           "lane_codes", "memory_order", "merge", "nonfinite_counts", "reductions",
           "segment_reductions", "widened"]

FIELDS = ("count", "shift", "dsum", "dsq", "min", "max")
COUNTS = ("nan", "posinf", "neginf")     # the vector of ``nonfinite_counts``
LANES = 4   # interleaved sub-histograms: a run of one code does not serialise counting

# floats whose values float32 holds exactly, and whose kernels torch may lack: they are
# summarised as float32 (``widened``)
NARROW = frozenset(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n))


def exp_bits_of(x: torch.Tensor) -> int:
    """The code width a tensor's summary uses: 11 (float64), 8 (other floats),
    or 0 (integer, bool, complex or empty: a count only)."""
    if x.is_complex() or not x.is_floating_point() or x.numel() == 0:
        return 0
    return 11 if x.dtype == torch.float64 else 8


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x``, or float32 for the 8-bit floats (an exact conversion)."""
    return x.float() if x.dtype in NARROW else x


def nonfinite_counts(x: torch.Tensor) -> torch.Tensor:
    """NaN, +Inf and -Inf counts of a float tensor, as float64 (``COUNTS``): the
    exact check of a step without statistics, taken at capture time (a later
    in-place op cannot hide a value from it)."""
    inf = float("inf")
    return torch.stack([torch.isnan(x).sum(), (x == inf).sum(), (x == -inf).sum()]).to(torch.float64)


def vector_length(exp_bits: int) -> int:
    return 1 if exp_bits == 0 else len(FIELDS) + fmt.code_width(exp_bits)


def memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dimensions in memory order, when that makes it contiguous
    (a transposed output, such as attention's): a summary ignores element order,
    and reading memory in order lets the kernels vectorise."""
    if x.dim() < 2 or x.is_contiguous():
        return x
    y = x.permute(sorted(range(x.dim()), key=x.stride, reverse=True))
    return y if y.is_contiguous() else x


def reductions(x: torch.Tensor) -> torch.Tensor:
    """The NaN-safe reductions of ``x`` (see ``FIELDS``), in float64."""
    inf = float("inf")
    fin = torch.isfinite(x)
    xd = x.to(torch.float64)
    first = (0,) * x.dim()            # no reshape: a transposed tensor is read in place
    c = torch.where(fin[first], xd[first], 0)
    d = torch.where(fin, xd - c, 0)
    return torch.stack([
        torch.full((), x.numel(), dtype=torch.float64, device=x.device),
        c, d.sum(), (d * d).sum(),
        torch.where(fin, x, inf).min().to(torch.float64),
        torch.where(fin, x, -inf).max().to(torch.float64),
    ])


def codes(x: torch.Tensor) -> torch.Tensor:
    """Per-element histogram codes of a float tensor, flattened (``format.encode``).

    The code stays in the bits' own integer type: a narrowing cast would stop
    the compiler from vectorising the kernel.
    """
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()                 # float16 and bfloat16 are exact in float32
    exp_bits = 11 if x.dtype == torch.float64 else 8
    bits = x.view(torch.int64 if exp_bits == 11 else torch.int32)   # same size: any strides
    n = fmt.raw_codes(exp_bits)
    code = (bits >> fmt.code_shift(exp_bits)) & (n - 1)
    code = torch.where(x == 0, n + (bits < 0).to(code.dtype), code)
    code = torch.where(x == float("inf"), n + 2, code)
    return torch.where(x == -float("inf"), n + 3, code).reshape(-1)


def lane_codes(x: torch.Tensor) -> torch.Tensor:
    """``codes`` spread over ``LANES`` sub-histograms by element position, so
    neighbouring elements land in different counters."""
    code = codes(x)
    lane = torch.arange(code.numel(), device=code.device, dtype=code.dtype) % LANES
    return code + lane * fmt.code_width(exp_bits_of(x))


def segment_reductions(flat: torch.Tensor, seg: torch.Tensor, starts: torch.Tensor,
                       lengths: torch.Tensor) -> torch.Tensor:
    """``reductions`` of each segment of ``flat`` at once: (segments, fields)."""
    inf = float("inf")
    k = len(lengths)
    fin = torch.isfinite(flat)
    xd = flat.to(torch.float64)
    c = torch.where(fin[starts], xd[starts], 0)
    d = torch.where(fin, xd - c[seg], 0)
    # sums by segment_reduce; min and max by scatter_reduce (the faster of the two for them)
    lo = torch.full((k,), inf, dtype=flat.dtype, device=flat.device)
    lo = lo.scatter_reduce_(0, seg, torch.where(fin, flat, inf), "amin")
    hi = torch.full((k,), -inf, dtype=flat.dtype, device=flat.device)
    hi = hi.scatter_reduce_(0, seg, torch.where(fin, flat, -inf), "amax")
    return torch.stack([lengths.to(torch.float64), c,
                        torch.segment_reduce(d, "sum", lengths=lengths),
                        torch.segment_reduce(d * d, "sum", lengths=lengths),
                        lo.to(torch.float64), hi.to(torch.float64)], 1)


def merge(vecs: list[np.ndarray], exp_bits: int) -> np.ndarray:
    """One host summary vector of several tensors taken together (a step's
    micro-batches): exactly the vector of their concatenation, but for the
    rounding of the float64 sums (moved to one shift)."""
    if len(vecs) == 1:
        return vecs[0]
    v = np.stack(vecs)
    if exp_bits == 0:
        return v.sum(axis=0)
    _, exact = fmt.decode(v[:, len(FIELDS):], exp_bits)
    n = v[:, 0] - exact["nan"] - exact["posinf"] - exact["neginf"]       # finite counts
    c, s1, s2 = v[:, 1], v[:, 2], v[:, 3]
    c0 = c[np.argmax(n > 0)]
    dc = c - c0
    out = v.sum(axis=0)
    out[1] = c0
    out[2] = np.sum(s1 + n * dc)
    out[3] = np.sum(s2 + 2 * dc * s1 + n * dc * dc)
    out[4], out[5] = v[:, 4].min(), v[:, 5].max()
    return out


@dataclass
class Summaries:
    """Statistics (one array per store name) and histograms of a batch of tensors."""
    stats: dict[str, np.ndarray]
    hist: np.ndarray                  # (n, NBINS)

    def nonfinite(self, i: int) -> tuple[int, int, int]:
        return tuple(int(self.stats[k][i]) for k in ("nan", "posinf", "neginf"))


def finalize(vecs: list[np.ndarray], exp_bits: list[int]) -> Summaries:
    """Host summary vectors (with their code widths) -> statistics and histograms.

    Vectors of one width are finalised together in one vectorised pass.
    """
    n = len(vecs)
    out = Summaries({s: np.full(n, np.nan) for s in fmt.STATS},
                    np.zeros((n, fmt.NBINS), dtype=np.int64))
    by_width: dict[int, list[int]] = {}
    for i, e in enumerate(exp_bits):
        by_width.setdefault(e, []).append(i)
    for e, rows in by_width.items():
        part, hist = _finalize_width(np.stack([vecs[i] for i in rows]), e)
        for s, v in part.items():
            out.stats[s][rows] = v
        if hist is not None:
            out.hist[rows] = hist
    return out


def _finalize_width(vecs: np.ndarray, exp_bits: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    count = vecs[:, 0]
    if exp_bits == 0:               # integer, bool or empty tensors: a count and nothing else
        stats = {k: np.full(len(vecs), np.nan) for k in fmt.STATS}
        stats.update(count=count, nan=0 * count, posinf=0 * count, neginf=0 * count)
        return stats, None
    c, s1, s2, lo, hi = (vecs[:, FIELDS.index(f)] for f in ("shift", "dsum", "dsq", "min", "max"))
    hist, exact = fmt.decode(vecs[:, len(FIELDS):], exp_bits)
    nan, posinf, neginf = exact["nan"], exact["posinf"], exact["neginf"]
    n = count - nan - posinf - neginf
    has = n > 0
    safe = np.where(has, n, 1.0)
    m2 = s2 - s1 * s1 / safe            # sums of (x - c) and (x - c)^2: no cancellation
    lo, hi = np.where(has, lo, np.nan), np.where(has, hi, np.nan)
    return {
        "count": count,
        "mean": np.where(has, c + s1 / safe, np.nan),
        "std": np.where(has, np.sqrt(np.maximum(m2, 0.0) / safe), np.nan),
        "min": lo,
        "max": hi,
        "abs_max": np.maximum(np.abs(lo), np.abs(hi)),
        "norm": np.sqrt(np.maximum(s2 + 2 * c * s1 + n * c * c, 0.0)),
        "zero_frac": np.where(has, exact["zeros"] / safe, np.nan),
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
    }, hist
