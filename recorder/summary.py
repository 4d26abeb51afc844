"""Pure tensor -> summary functions, no I/O.

``reduce(x)`` turns a tensor into one small float64 vector on the tensor's
own device (no host sync): a few reductions, then the counts of the raw
histogram codes.  Many such vectors are concatenated and moved to the host
once per step; ``finalize_layers`` then turns a step's vectors into the
statistics of the store in vectorised passes (on the training thread: numpy
work there is cheaper than the GIL hand-offs it would cause on the writer's).

Two fused kernels (``torch.compile`` when it works on this machine, the same
functions eagerly otherwise) read ``x``: one computes the NaN-safe
reductions, the other gives every element an integer code, ``sign |
exponent | top 2 mantissa bits`` for finite non-zero values and four special
codes for +0, -0, +Inf and -Inf.  One ``bincount`` of those
codes (spread over four interleaved sub-histograms, so runs of zeros do not
serialise the counting) then gives the histogram *and* the exact zero, NaN and
Inf counts, so the reductions need not count anything.  A transposed tensor is
read in memory order.  Sums accumulate in float64, the
variance around a shift taken from the tensor itself (no cancellation).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numpy as np
import torch

from .format import NBINS, STATS, bins_from_codes, code_to_bin

__all__ = ["reduce", "reduce_many", "is_small", "finalize", "finalize_many", "finalize_layers",
           "nonfinite", "summarize"]

# Layout of a summary vector: the reductions, then the code counts.
_FIELDS = ("count", "shift", "dsum", "dsq", "min", "max")
_NF = len(_FIELDS)
_RAW = {8: 1 << 11, 11: 1 << 14}      # raw code count, by exponent width
_SPECIAL = ("poszero", "negzero", "posinf", "neginf")


def _width(wide: bool) -> int:
    """Codes per histogram: the raw ones, then the special ones."""
    return _RAW[11 if wide else 8] + len(_SPECIAL)


def _reductions(x: torch.Tensor) -> torch.Tensor:
    """The NaN-safe reductions of ``x`` (see ``_FIELDS``), in float64."""
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


def _codes(x: torch.Tensor) -> torch.Tensor:
    """Per-element histogram codes of a float tensor, flattened.

    The raw code ``sign | exponent | 2 mantissa bits`` is one shift of the
    float's bits; exact zeros and Infs get the special codes after the raw
    ones.  (The code stays in the bits' own integer type: a narrowing cast
    would stop the compiler from vectorising the kernel.)
    """
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()                 # float16 and bfloat16 are exact in float32
    if x.dtype == torch.float64:   # a same-size view: fine for any strides
        bits, shift, ncodes = x.view(torch.int64), 50, _RAW[11]
    else:
        bits, shift, ncodes = x.view(torch.int32), 21, _RAW[8]
    code = (bits >> shift) & (ncodes - 1)
    code = torch.where(x == 0, ncodes + (bits < 0).to(code.dtype), code)
    code = torch.where(x == float("inf"), ncodes + 2, code)
    return torch.where(x == -float("inf"), ncodes + 3, code).reshape(-1)


_LANES = 4   # interleaved sub-histograms that ``reduce`` counts into


def _lane_codes(x: torch.Tensor) -> torch.Tensor:
    """``_codes`` spread over ``_LANES`` sub-histograms by element position.

    Neighbouring elements land in different counters, so a run of one code (the
    zeros of a ReLU output or its gradient) no longer makes each increment wait
    for the last: counting such data runs about twice as fast.
    """
    code = _codes(x)
    lane = torch.arange(code.numel(), device=code.device, dtype=code.dtype) % _LANES
    return code + lane * _width(x.dtype == torch.float64)


_compiled: dict = {}
_compile_lock = threading.Lock()
_PARALLEL_MIN = 1 << 18        # elements from which CPU work is split across threads


def _use_compile() -> bool:
    return os.environ.get("TENSORTAPE_COMPILE", "1") not in ("0", "false", "no")


def _fused(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` as one fused kernel, compiled once per process when possible.

    Large CPU tensors get a kernel that OpenMP splits across threads (the
    size is unknown at compile time, so inductor would otherwise run it on
    one); small ones a serial kernel, as a parallel region costs more than it
    saves there, most of all on a busy machine.
    """
    parallel = x.device.type == "cpu" and x.numel() >= _PARALLEL_MIN
    key = (fn, parallel)
    compiled = _compiled.get(key)
    if compiled is None:
        with _compile_lock:
            compiled = _compiled.get(key)
            if compiled is None:
                compiled = False
                if _use_compile():
                    try:
                        probe = torch.tensor([1.0, float("nan"), 0.0, -float("inf")], device=x.device)
                        compiled = torch.compile(fn, dynamic=True,
                                                 options={"cpp.dynamic_threads": parallel})
                        with torch.no_grad():
                            torch.testing.assert_close(compiled(probe), fn(probe), equal_nan=True)
                    except Exception:  # no compiler here: the eager path is exact too
                        compiled = False
                _compiled[key] = compiled
    if compiled is not False:
        try:
            with torch.no_grad():    # one grad mode, so no recompiles between forward and backward
                return compiled(x)
        except Exception:
            pass
    return fn(x)


_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _bincount(code: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(code, minlength=n)`` without a device sync.

    On the CPU ``bincount`` runs on one thread; large inputs are split and the
    parts run concurrently (torch releases the GIL); their counts add up exactly.
    """
    if code.device.type != "cpu":
        # bincount on an accelerator reads the maximum back to the host (a sync per
        # tensor); an index_add of ones into n counters needs none
        ones = torch.ones(1, dtype=torch.int64, device=code.device).expand(code.numel())
        return torch.zeros(n, dtype=torch.int64, device=code.device).index_add_(0, code, ones)
    parts = min(torch.get_num_threads(), 4, code.numel() // _PARALLEL_MIN)
    if parts < 2:
        return torch.bincount(code, minlength=n)
    global _pool
    with _compile_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="tensortape-bincount")
    chunks = code.chunk(parts)
    futures = [_pool.submit(torch.bincount, c, minlength=n) for c in chunks[1:]]
    counts = torch.bincount(chunks[0], minlength=n)
    for f in futures:
        counts += f.result()
    return counts


def _memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dimensions in memory order, when that makes it contiguous
    (a transposed output, such as attention's): a summary ignores element order,
    and reading memory in order lets its kernels vectorise."""
    if x.dim() < 2 or x.is_contiguous():
        return x
    y = x.permute(sorted(range(x.dim()), key=x.stride, reverse=True))
    return y if y.is_contiguous() else x


@torch.compiler.disable
def reduce(x: torch.Tensor) -> torch.Tensor:
    """One float64 vector (on ``x``'s device) summarising ``x``; no sync."""
    x = _memory_order(x.detach())
    if x.is_complex() or not x.is_floating_point() or x.numel() == 0:
        return torch.full((1,), x.numel(), dtype=torch.float64, device=x.device)
    width = _width(x.dtype == torch.float64)
    counts = _bincount(_fused(_lane_codes, x), _LANES * width).view(_LANES, width).sum(0)
    return torch.cat([_fused(_reductions, x), counts.to(torch.float64)])


SMALL = 1 << 13   # elements below which a tensor waits for the step's batched summary


def is_small(x: torch.Tensor) -> bool:
    """Whether ``x`` is summarised with the rest of its step (``reduce_many``):
    for tiny tensors the fixed cost of a kernel call exceeds the work."""
    return x.is_floating_point() and 0 < x.numel() < SMALL


def _segment_reductions(flat: torch.Tensor, seg: torch.Tensor, starts: torch.Tensor,
                        lengths: torch.Tensor) -> torch.Tensor:
    """``_reductions`` of each segment of ``flat`` at once: (segments, fields)."""
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


@torch.compiler.disable
def reduce_many(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``reduce`` of many small float tensors, with a few kernels for all of them.

    The tensors are concatenated per (device, float width); segment
    reductions give each one's sums, minimum and maximum, and one ``bincount`` of
    codes offset by segment gives every histogram.  Same vectors as ``reduce``.
    """
    out: list = [None] * len(xs)
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault((x.device, x.dtype == torch.float64), []).append(i)
    for (device, wide), idx in groups.items():
        parts = [xs[i].detach().reshape(-1) for i in idx]
        flat = torch.cat([p.to(torch.float64 if wide else torch.float32) for p in parts])
        sizes = [p.numel() for p in parts]
        lengths = torch.tensor(sizes, device=device)
        seg = torch.repeat_interleave(torch.arange(len(parts), device=device), lengths,
                                      output_size=sum(sizes))   # known here: no device sync
        starts = torch.cumsum(lengths, 0) - lengths
        width = _width(wide)
        codes = _fused(_codes, flat) + seg * width
        counts = _bincount(codes, len(parts) * width).view(len(parts), width)
        table = torch.cat([_segment_reductions(flat, seg, starts, lengths),
                           counts.to(torch.float64)], 1)
        for row, i in zip(table, idx):
            out[i] = row
    return out


def _raw_codes(vecs: np.ndarray) -> tuple[np.ndarray, int]:
    """The raw code counts of float summary vectors (rows), and their exponent width."""
    raw = vecs[:, _NF:-len(_SPECIAL)]
    return raw, 8 if raw.shape[1] == _RAW[8] else 11


def _nonfinite_counts(vecs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact (nan, posinf, neginf) per row of float summary vectors of one length."""
    raw, exp_bits = _raw_codes(vecs)
    nan = raw[:, code_to_bin(exp_bits) < 0].sum(axis=1)   # all-ones exponent, Infs coded apart
    return nan, vecs[:, -2], vecs[:, -1]


def nonfinite(vec: np.ndarray) -> tuple[int, int, int]:
    """Exact (nan, posinf, neginf) counts of one host summary vector."""
    if vec.size <= _NF:
        return 0, 0, 0                # integer, bool or empty: no NaN or Inf
    return tuple(int(v[0]) for v in _nonfinite_counts(vec[None]))


def finalize_many(vecs: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Statistics (one array per store name) and histograms of summary vectors
    of equal length, one per row, in one vectorised pass."""
    vecs = np.atleast_2d(vecs)
    count = vecs[:, 0]
    if vecs.shape[1] == 1:  # integer, bool or empty tensors: a count and nothing else
        stats = {k: np.full(len(vecs), np.nan) for k in STATS}
        stats.update(count=count, nan=0 * count, posinf=0 * count, neginf=0 * count)
        return stats, None
    c, s1, s2, lo, hi = (vecs[:, _FIELDS.index(f)] for f in ("shift", "dsum", "dsq", "min", "max"))
    raw, exp_bits = _raw_codes(vecs)
    poszero, negzero = vecs[:, -4], vecs[:, -3]
    nan, posinf, neginf = _nonfinite_counts(vecs)
    n = count - nan - posinf - neginf
    zeros = poszero + negzero
    has = n > 0
    safe = np.where(has, n, 1.0)
    m2 = s2 - s1 * s1 / safe            # sums of (x - c) and (x - c)^2: no cancellation
    lo, hi = np.where(has, lo, np.nan), np.where(has, hi, np.nan)
    stats = {
        "count": count,
        "mean": np.where(has, c + s1 / safe, np.nan),
        "std": np.where(has, np.sqrt(np.maximum(m2, 0.0) / safe), np.nan),
        "min": lo,
        "max": hi,
        "abs_max": np.maximum(np.abs(lo), np.abs(hi)),
        "norm": np.sqrt(np.maximum(s2 + 2 * c * s1 + n * c * c, 0.0)),
        "zero_frac": np.where(has, zeros / safe, np.nan),
        "nan": nan,
        "posinf": posinf,
        "neginf": neginf,
    }
    return stats, bins_from_codes(raw, exp_bits, zeros)


def finalize_layers(entries: list[tuple[str, np.ndarray]]
                    ) -> tuple[list[str], dict[str, np.ndarray], np.ndarray]:
    """One kind's (layer, vector) pairs of a step -> (layers, statistics, histograms).

    Vectors of float32-like, float64 and integer tensors differ in length;
    each length is finalised in one vectorised pass.
    """
    n = len(entries)
    stats = {s: np.full(n, np.nan) for s in STATS}
    hist = np.zeros((n, NBINS), dtype=np.int64)
    by_length: dict[int, list[int]] = {}
    for i, (_, vec) in enumerate(entries):
        by_length.setdefault(vec.size, []).append(i)
    for rows in by_length.values():
        part, h = finalize_many(np.stack([entries[i][1] for i in rows]))
        for s, v in part.items():
            stats[s][rows] = v
        if h is not None:
            hist[rows] = h
    return [layer for layer, _ in entries], stats, hist


def finalize(vec: np.ndarray) -> tuple[dict[str, float], np.ndarray | None]:
    """Statistics (the store's names) and global histogram of one vector."""
    stats, hist = finalize_many(vec[None])
    return {k: float(v[0]) for k, v in stats.items()}, (None if hist is None else hist[0])


def summarize(x: torch.Tensor) -> tuple[dict[str, float], np.ndarray | None]:
    """Statistics and histogram of one tensor, on the host (syncs)."""
    return finalize(reduce(x).cpu().numpy())
