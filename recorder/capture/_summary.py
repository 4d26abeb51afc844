"""Pure tensor -> summary functions: no I/O, no device policy, no cache but a
per-dtype table of exponent widths (``_EXP_BITS``).

A float tensor's *summary vector* is one float64 vector on the tensor's own
device: the NaN-safe reductions (``FIELDS``), then ``histogram.SLOTS`` counts: one
per histogram bin, then NaN, +Inf and -Inf.  The device counts the elements'
histogram codes (``codes``; see ``histogram.encode``) and maps them to slots
(``histogram.code_slots``), so every float dtype gives a vector of one width.
Integer, bool and complex tensors have no vector: their element count is all.
What a vector holds is said by its ``Holds``, never read from its width, and
what form a tensor's summary takes is decided in one place, ``form``.
A statistics engine (``_engines``) computes vectors on the device with the
kernels below; ``moments`` and ``combine`` turn blocks of them, on the host,
into the statistics and histograms of the store in vectorised passes.

Pure functions: they run on whichever thread calls them (the kernels on the
training thread, and on autograd's for gradients; ``moments``, ``combine`` and
``finalize`` on the writer thread).

Sums accumulate in float64 around a shift taken from the tensor itself, so
the variance does not cancel.  A float64 tensor whose largest finite
magnitude is past ``2 ** 448`` (or below ``2 ** -448``) has its sums scaled by
a power of two that its own minimum and maximum give (``scale_exponent``), so
squares neither overflow nor underflow; every other tensor's scale is 1.  An
engine bounds its temporaries by taking a large tensor in pieces (``pieces``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import histogram

__all__ = ["COUNTS", "FEW", "FIELDS", "LANES", "NARROW", "SMALL", "VECTOR", "Form", "Holds", "Summaries",
           "batched_dtype", "codes", "combine", "empty_summary", "exp_bits_of", "finalize",
           "finite_top", "form", "joined", "lane_codes", "memory_order", "moments",
           "nonfinite_counts", "pieces", "prepared", "reductions", "scale_exponent", "scale_of",
           "segment_reductions", "shift_of", "widened"]

FIELDS = ("count", "shift", "dsum", "dsq", "min", "max")
COUNTS = ("nan", "posinf", "neginf")     # the vector of ``nonfinite_counts``
LANES = 4   # interleaved sub-histograms: a run of one code does not serialise counting

# floats whose values float32 holds exactly, and whose kernels torch may lack: they are
# summarised as float32 (``widened``)
NARROW = frozenset(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n))


_EXP_BITS: dict[torch.dtype, int] = {}        # per dtype, as met (torch has a few dozen)


def exp_bits_of(x: torch.Tensor) -> int:
    """The code width a tensor's summary uses: 11 (float64), 8 (other floats),
    or 0 (integer, bool or complex: a count only)."""
    bits = _EXP_BITS.get(x.dtype)
    if bits is None:
        dtype = x.dtype
        bits = _EXP_BITS[dtype] = 0 if dtype.is_complex or not dtype.is_floating_point else \
            11 if dtype == torch.float64 else 8
    return bits


VECTOR = len(FIELDS) + histogram.SLOTS         # the length of a summary vector
SMALL = 1 << 13     # float elements below which a tensor waits for its step's batch (``form``)
FEW = 1 << 16       # the same at a step without statistics: one pass over a batch's copies
                    # costs less than a kernel call a tensor, up to this size


class Holds(enum.Enum):
    """What a vector holds: its layout, never told by its width."""
    SUMMARY = "summary"          # ``FIELDS``, then ``histogram.SLOTS`` counts (``VECTOR`` values)
    NONFINITE = "nonfinite"      # ``COUNTS``: NaN, +Inf and -Inf (a step without statistics)


class Form(enum.Enum):
    """What form a tensor's summary takes (``form`` decides)."""
    COUNT = "count"              # no vector: its element count is all (integer, bool, complex;
                                 # an empty float tensor at a step without statistics)
    EMPTY = "empty"              # an empty float tensor: ``empty_summary``
    SMALL = "small"              # a tiny float tensor: a copy, summarised with its step's batch
    FEW = "few"                  # a tiny float tensor at a step without statistics: a copy,
                                 # its NaN/Inf counted with its step's batch
    SUMMARY = "summary"          # an engine's summary vector (``Holds.SUMMARY``)
    NONFINITE = "nonfinite"      # an engine's NaN/Inf counts (``Holds.NONFINITE``)

    __hash__ = object.__hash__   # members are singletons: hashed in C (a key per capture)


# the members as module constants: an Enum attribute costs a lookup per capture
_COUNT, _EMPTY, _SMALL, _SUMMARY, _NONFINITE, _FEW = (
    Form.COUNT, Form.EMPTY, Form.SMALL, Form.SUMMARY, Form.NONFINITE, Form.FEW)


def form(x: torch.Tensor, stats: bool, batched: bool = True) -> tuple[Form, int, int]:
    """What form the summary of ``x`` takes, and what decided it: its code width
    (``exp_bits_of``) and element count.  Statistics (``stats``), or at a step
    without them the exact NaN/Inf counts; tiny float tensors (below ``SMALL``
    elements, or ``FEW`` for the counts) wait for the step's batch (``batched``: a
    kernel call on them costs more than the work).
    One call a capture: the hot path."""
    exp_bits = _EXP_BITS.get(x.dtype)
    if exp_bits is None:
        exp_bits = exp_bits_of(x)
    numel = x.numel()
    if not exp_bits:
        return _COUNT, 0, numel
    if not numel:
        return (_EMPTY if stats else _COUNT), exp_bits, 0
    if stats:
        return (_SMALL if batched and numel < SMALL else _SUMMARY), exp_bits, numel
    return (_FEW if batched and numel < FEW else _NONFINITE), exp_bits, numel


def batched_dtype(exp_bits: int) -> torch.dtype:
    """The dtype a batch of tiny tensors of code width ``exp_bits`` is read as
    (``Engine.reduce_many``): float64's 11-bit codes, or float32 for the rest."""
    return torch.float64 if exp_bits == 11 else torch.float32


def prepared(x: torch.Tensor) -> torch.Tensor:
    """A float tensor as the engines take it: its dimensions in memory order
    (``memory_order``), never a copy (an engine widens the 8-bit floats itself,
    a piece at a time)."""
    return memory_order(x)


def pieces(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Views of ``x`` that cover each of its elements once, each of at most ``n``
    elements: how an engine bounds its temporaries (a summary ignores element
    order).  A contiguous tensor is cut flat into pieces of one size (one compiled
    kernel for all of them); another along its first dimension, and a row that
    alone holds more than ``n`` in turn."""
    total = x.numel()
    if total <= n:
        return [x]
    if x.is_contiguous():
        parts = -(-total // n)
        return list(x.reshape(-1).split(-(-total // parts)))
    row = x[0].numel()
    if row <= n:
        return list(x.split(n // row))
    return [p for r in x for p in pieces(r, n)]


def empty_summary() -> torch.Tensor:
    """The summary vector of an empty float tensor (on the host): no values, so it
    merges with its step's other micro-batches as nothing."""
    inf = float("inf")
    head = torch.tensor([0.0, 0.0, 0.0, 0.0, inf, -inf], dtype=torch.float64)
    return torch.cat([head, torch.zeros(histogram.SLOTS, dtype=torch.float64)])


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x``, or float32 for the 8-bit floats (an exact conversion)."""
    return x.float() if x.dtype in NARROW else x


def nonfinite_counts(x: torch.Tensor) -> torch.Tensor:
    """NaN, +Inf and -Inf counts of a float tensor, as float64 (``COUNTS``): the
    exact check of a step without statistics, taken at capture time (a later
    in-place op cannot hide a value from it)."""
    inf = float("inf")
    return torch.stack([torch.isnan(x).sum(), (x == inf).sum(), (x == -inf).sum()]).to(torch.float64)


def memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dimensions in memory order, when that makes it contiguous
    (a transposed output, such as attention's): a summary ignores element order,
    and reading memory in order lets the kernels vectorise."""
    if x.dim() < 2 or x.is_contiguous():
        return x
    y = x.permute(sorted(range(x.dim()), key=x.stride, reverse=True))
    return y if y.is_contiguous() else x


SHIFT_WINDOW = 1024   # elements, spread over the tensor, in which ``shift_of`` looks


def shift_of(x: torch.Tensor) -> torch.Tensor:
    """The sums' shift of ``x`` (float64, 0-dim, on its device, no sync): the first
    finite one of ``SHIFT_WINDOW`` elements spread evenly over it (element 0 first;
    if it is not contiguous, spread along its first dimension: views, never a
    copy), else 0.  Not
    simply the first element: summed around 0, a tensor that starts with NaN and
    whose mean is large next to its spread would lose its variance.  Eager, apart
    from the compiled ``reductions``: a slice inside would make the compiler
    specialise on sizes."""
    if x.dim() == 0:
        line = x.reshape(1)
    elif x.is_contiguous():
        line = x.reshape(-1)
    else:
        line = x[(slice(None),) + (0,) * (x.dim() - 1)]
    head = widened(line[::max(1, line.numel() // SHIFT_WINDOW)][:SHIFT_WINDOW])
    fin = torch.isfinite(head)
    first = fin & (fin.cumsum(0) == 1)        # the first finite one: no index, so no host read
    return torch.where(first, head.to(torch.float64), 0.0).sum()


# a float64 tensor's sums are scaled by 2 ** -k (``scale_exponent``) when its largest finite
# magnitude is outside [2 ** -448, 2 ** 448): inside, n * (2 * top) ** 2 stays finite for any
# n < 2 ** 63, and so do the host's merges (``combine``); 2 ** 960 is the largest scale
_FREE_EXP, _LOWEST_EXP = 448, -960


def scale_exponent(top, xp=np):
    """The exponent ``k`` of the scale ``2 ** -k`` of a float64 tensor's sums (its
    ``dsum`` and ``dsq`` are of ``(x - shift) * 2 ** -k``), from ``top``, its largest
    finite magnitude (``max(|min|, |max|)``; not finite: no finite values): 0
    while ``top`` is 0 or within ``[2 ** -448, 2 ** 448)``, as every narrower
    dtype's is, else ``top``'s own exponent (at least -960), so the scaled values
    are below 1 and their squares neither overflow nor underflow.  Elementwise, on
    numpy arrays (the host's) or torch tensors (an engine's, on its device: ``xp``
    is ``torch``)."""
    e = xp.frexp(xp.where(xp.isfinite(top), top, 0.0))[1]
    return xp.where((e > _FREE_EXP) | (e < -_FREE_EXP), xp.where(e < _LOWEST_EXP, _LOWEST_EXP, e),
                    0)


def finite_top(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (0 if none): what its scale is of."""
    return torch.where(torch.isfinite(x), x.abs(), 0).amax()


def scale_of(top: torch.Tensor) -> torch.Tensor:
    """The scale ``2 ** -k`` (``scale_exponent``) of the sums of a float64 tensor whose
    largest finite magnitude is ``top`` (a tensor, on its device: no sync)."""
    return torch.exp2(-scale_exponent(top, torch).to(torch.float64))


def reductions(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """The NaN-safe reductions of ``x`` (see ``FIELDS``), in float64, summed around
    the shift ``c`` (``shift_of``); a float64 tensor's sums scaled by ``s``
    (``scale_of``: of the whole tensor when ``x`` is one of its pieces)."""
    inf = float("inf")
    fin = torch.isfinite(x)
    xd = x.to(torch.float64)
    d = torch.where(fin, xd - c, 0) if s is None else torch.where(fin, xd * s - c * s, 0)
    return torch.stack([
        torch.full((), x.numel(), dtype=torch.float64, device=x.device),
        c, d.sum(), (d * d).sum(),
        torch.where(fin, x, inf).min().to(torch.float64),
        torch.where(fin, x, -inf).max().to(torch.float64),
    ])


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ``reductions`` of a tensor from those of its pieces (one shift and scale):
    the counts and sums added in order, the least minimum, the greatest maximum."""
    if len(parts) == 1:
        return parts[0]
    p = torch.stack(parts)
    return torch.stack([p[:, 0].sum(), p[0, 1], p[:, 2].sum(), p[:, 3].sum(), p[:, 4].min(),
                        p[:, 5].max()])


def codes(x: torch.Tensor) -> torch.Tensor:
    """Per-element histogram codes of a float tensor, flattened (``histogram.encode``).

    The code stays in the bits' own integer type: a narrowing cast would stop
    the compiler from vectorising the kernel.
    """
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()                 # float16 and bfloat16 are exact in float32
    exp_bits = 11 if x.dtype == torch.float64 else 8
    bits = x.view(torch.int64 if exp_bits == 11 else torch.int32)   # same size: any strides
    n = histogram.raw_codes(exp_bits)
    code = (bits >> histogram.code_shift(exp_bits)) & (n - 1)
    code = torch.where(x == 0, n + (bits < 0).to(code.dtype), code)
    code = torch.where(x == float("inf"), n + 2, code)
    return torch.where(x == -float("inf"), n + 3, code).reshape(-1)


def lane_codes(x: torch.Tensor) -> torch.Tensor:
    """``codes`` spread over ``LANES`` sub-histograms by element position, so
    neighbouring elements land in different counters."""
    code = codes(x)
    lane = torch.arange(code.numel(), device=code.device, dtype=code.dtype) % LANES
    exp_bits = 11 if x.dtype == torch.float64 else 8     # as ``codes``: no dict in a kernel
    return code + lane * histogram.code_width(exp_bits)


def segment_reductions(flat: torch.Tensor, seg: torch.Tensor, starts: torch.Tensor,
                       lengths: torch.Tensor) -> torch.Tensor:
    """``reductions`` of each segment of ``flat`` at once: (segments, fields)."""
    inf = float("inf")
    k = len(lengths)
    fin = torch.isfinite(flat)
    xd = flat.to(torch.float64)
    n = flat.numel()                  # each segment's shift: its first finite element (else 0)
    index = torch.where(fin, torch.arange(n, device=flat.device), n)
    first = torch.full((k,), n, dtype=index.dtype, device=flat.device)
    first = first.scatter_reduce_(0, seg, index, "amin")
    c = torch.where(first < n, xd[first.clamp(max=max(n - 1, 0))], 0)
    # sums by segment_reduce; min and max by scatter_reduce (the faster of the two for them)
    lo = torch.full((k,), inf, dtype=flat.dtype, device=flat.device)
    lo = lo.scatter_reduce_(0, seg, torch.where(fin, flat, inf), "amin")
    hi = torch.full((k,), -inf, dtype=flat.dtype, device=flat.device)
    hi = hi.scatter_reduce_(0, seg, torch.where(fin, flat, -inf), "amax")
    if flat.dtype == torch.float64:           # each segment's scale (``scale_exponent``)
        s = scale_of(torch.maximum(lo.abs(), hi.abs()))
        d = torch.where(fin, xd * s[seg] - (c * s)[seg], 0)
    else:
        d = torch.where(fin, xd - c[seg], 0)
    return torch.stack([lengths.to(torch.float64), c,
                        torch.segment_reduce(d, "sum", lengths=lengths),
                        torch.segment_reduce(d * d, "sum", lengths=lengths),
                        lo.to(torch.float64), hi.to(torch.float64)], 1)


@dataclass
class Summaries:
    """Statistics (one array per store name) and histograms of a batch of rows."""
    stats: dict[str, np.ndarray]
    hist: np.ndarray                  # (n, NBINS): exact counts, in float64

    def nonfinite(self, i: int) -> tuple[int, int, int]:
        return tuple(int(self.stats[k][i]) for k in ("nan", "posinf", "neginf"))


# the moments of a summary that add up over tensors: counts (then the shifted sums)
_COUNTED = ("count", "n", "zeros", "nan", "posinf", "neginf", "floats")


def moments(summaries: list[np.ndarray], counts: Sequence[float] = ()) -> tuple[dict, np.ndarray]:
    """Blocks of summary vectors (``Holds.SUMMARY``), each a (rows x ``VECTOR``)
    matrix, then the element ``counts`` of tensors without float statistics
    (integer, bool or complex: a count and nothing else), in one vectorised pass a
    block: per row (the blocks' rows, then a row per count) its counts, shifted
    sums (scaled by ``2 ** -k``, ``k`` its ``scale_exponent``), min and max, and
    its histogram: exact counts in float64 (one block and no counts, the common
    case: a view of the block's, no copy)."""
    n = sum(len(mat) for mat in summaries) + len(counts)
    m = {k: np.zeros(n) for k in (*_COUNTED, "c", "s1", "s2")}
    m["lo"], m["hi"] = np.full(n, np.inf), np.full(n, -np.inf)
    head = len(FIELDS)
    one = len(summaries) == 1 and not len(counts)
    hist = summaries[0][:, head: head + histogram.NBINS] if one else \
        np.zeros((n, histogram.NBINS))
    at = 0
    m["count"][n - len(counts):] = counts
    for mat in summaries:
        rows = slice(at, at + len(mat))
        at += len(mat)
        m["count"][rows] = mat[:, 0]
        m["floats"][rows] = 1
        if not one:
            hist[rows] = mat[:, head: head + histogram.NBINS]
        m["zeros"][rows] = mat[:, head + histogram.ZERO_BIN]
        for k, slot in (("nan", histogram.NAN_SLOT), ("posinf", histogram.POSINF_SLOT),
                        ("neginf", histogram.NEGINF_SLOT)):
            m[k][rows] = mat[:, head + slot]
        m["n"][rows] = mat[:, 0] - m["nan"][rows] - m["posinf"][rows] - m["neginf"][rows]
        for k, f in (("c", "shift"), ("s1", "dsum"), ("s2", "dsq"), ("lo", "min"), ("hi", "max")):
            m[k][rows] = mat[:, FIELDS.index(f)]
    m["k"] = _exponents(m["lo"], m["hi"])
    return m, hist


def _exponents(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The ``scale_exponent`` of rows of minima and maxima."""
    return scale_exponent(np.maximum(np.abs(lo), np.abs(hi)))


def combine(m: dict, hist: np.ndarray, rows: list[list[int]]) -> Summaries:
    """The statistics of groups of ``moments`` rows, each group taken together (a
    step's micro-batches), exactly as of their concatenation but for the rounding
    of the float64 sums (moved to one shift): ``count`` counts every element, the
    other statistics the float ones, whatever their dtypes."""
    order = np.fromiter((i for r in rows for i in r), np.int64, sum(map(len, rows)))
    if len(order) == len(rows) == len(hist) and (order == np.arange(len(order))).all():
        return _statistics(dict(m, hist=hist))     # a row each, in order: no copy
    g = {k: v[order] for k, v in m.items()}
    if len(order) == len(rows):              # a row each: nothing to merge
        out = dict(g, hist=hist[order])
        return _statistics(out)
    starts = np.cumsum([0] + [len(r) for r in rows[:-1]]).astype(np.int64)
    out = {k: np.add.reduceat(g[k], starts) for k in _COUNTED}
    member = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    # each group's shift: that of its first row holding finite values (else 0)
    first = np.minimum.reduceat(np.where(g["n"] > 0, np.arange(len(order)), len(order)), starts)
    c0 = np.where(first < len(order), g["c"][np.minimum(first, len(order) - 1)], 0.0)
    out["lo"] = np.minimum.reduceat(g["lo"], starts)
    out["hi"] = np.maximum.reduceat(g["hi"], starts)
    # each group's scale, of its own extremes: its rows' sums are moved to it (a row's scale
    # is at most its group's; a row of zeros, whose sums are 0, may have a greater one)
    out["k"] = _exponents(out["lo"], out["hi"])
    k = out["k"][member]
    s1, s2 = np.ldexp(g["s1"], g["k"] - k), np.ldexp(g["s2"], 2 * (g["k"] - k))
    dc = np.where(g["n"] > 0, np.ldexp(g["c"], -k) - np.ldexp(c0[member], -k), 0.0)
    out["c"] = c0
    out["s1"] = np.add.reduceat(s1 + g["n"] * dc, starts)
    out["s2"] = np.add.reduceat(s2 + 2 * dc * s1 + g["n"] * dc * dc, starts)
    out["hist"] = np.add.reduceat(hist[order], starts, axis=0)
    return _statistics(out)


def finalize(summaries: list[np.ndarray], counts: Sequence[float] = ()) -> Summaries:
    """Host summary vectors (``Holds.SUMMARY``), then the element ``counts`` of
    tensors without float statistics -> statistics and histograms, a row each, in
    that order."""
    m, hist = moments([np.stack(summaries)] if summaries else [], counts)
    return combine(m, hist, [[i] for i in range(len(summaries) + len(counts))])


def _statistics(m: dict) -> Summaries:
    n, k, s1, s2 = m["n"], m["k"], m["s1"], m["s2"]
    c = np.ldexp(m["c"], -k)            # in the sums' scale: mean, std and norm are taken
    floats = m["floats"] > 0            # there, then scaled back (inf only past float64)
    has = n > 0                         # rows of float tensors: their norm is 0 without values
    safe = np.where(has, n, 1.0)
    m2 = s2 - s1 * s1 / safe            # sums of (x - c) and (x - c)^2: no cancellation
    lo, hi = np.where(has, m["lo"], np.nan), np.where(has, m["hi"], np.nan)
    with np.errstate(over="ignore"):
        norm = np.ldexp(np.sqrt(np.maximum(s2 + 2 * c * s1 + n * c * c, 0.0)), k)
        mean = np.ldexp(c + s1 / safe, k)
        std = np.ldexp(np.sqrt(np.maximum(m2, 0.0) / safe), k)
    # bounds the values set (the mean within them, the std at most half their range): rounding
    # never takes either past them, nor past float64 (the norm alone may truly be past it)
    mean = np.minimum(np.maximum(mean, lo), hi)
    std = np.minimum(std, hi / 2 - lo / 2)
    stats = {
        "count": m["count"],
        "mean": np.where(has, mean, np.nan),
        "std": np.where(has, std, np.nan),
        "min": lo,
        "max": hi,
        "abs_max": np.maximum(np.abs(lo), np.abs(hi)),
        "norm": np.where(floats, norm, np.nan),
        "zero_frac": np.where(has, m["zeros"] / safe, np.nan),
        "nan": m["nan"],
        "posinf": m["posinf"],
        "neginf": m["neginf"],
    }
    return Summaries(stats, m["hist"])
