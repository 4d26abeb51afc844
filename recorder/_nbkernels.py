"""The numba kernels of the CPU statistics engine (``_numba``): one read per tensor.

Every element is read once, as its bits (float32 as ``uint32``, float64 as
``uint64``, bfloat16 as ``uint16``, float16 as ``int16``, the 8-bit floats as
``uint8`` through a 256-entry table of their float32 bits: no widened copy),
and gives at once:

- its histogram slot (``format.code_slots`` of its code, ``format.encode``):
  one lookup in a table indexed by the code and by whether the bits below the
  code are all zero (what tells ±0 from the underflow bin and ±Inf from NaN),
  counted into ``LANES`` private sub-histograms (element ``i`` into lane
  ``i % LANES``, so a run of equal codes, a ReLU's zeros, does not serialise
  on one counter);
- if finite, ``d = x - shift`` in float64, summed with ``d * d`` in
  ``LANES`` accumulators per block of ``BLOCK`` elements, the blocks' sums
  added in order (the same sums as ``_summary.reductions``, but for rounding);
  and the minimum and maximum.

The functions are compiled by numba once per machine (``cache=True``: on disk,
next to this file or in ``NUMBA_CACHE_DIR``), and run without the GIL
(``nogil=True``): ``_numba`` splits a large tensor across threads, each
counting into its own histogram, and merges them at the end.  They use no
numba threading layer (a ``parallel=True`` region from two Python threads at
once terminates the process under numba's default ``workqueue`` layer).

Pure functions: any thread.  This module imports neither torch nor the rest of
the recorder but ``format``, so a child process can compile the kernels into
numba's cache quickly (``compile_for``).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from recorder import histogram as fmt

__all__ = ["BLOCK", "HEAD", "LANES", "NO_TABLE", "READS", "cached_mark", "chunk", "compile_for",
           "finish", "many", "nonfinite", "one", "shift_of", "slot_table"]

LANES = 4
BLOCK = 4096            # elements summed in lanes before they join the running sums
HEAD = 6                # the head of a summary vector (``_summary.FIELDS``)
SLOTS = fmt.SLOTS
NO_TABLE = np.zeros(1, np.uint32)       # the decoder table of a dtype that needs none
# how each float dtype is read: its bits' numpy type and code width (8-bit floats through
# a table of their float32 bits)
READS = {"float64": (np.uint64, 11), "float32": (np.uint32, 8), "bfloat16": (np.uint16, 8),
         "float16": (np.int16, 8), "float8": (np.uint8, 8)}
_EXP64 = np.uint64(0x7FF0000000000000)                   # float64's exponent bits
_SHIFT64 = np.uint64(fmt.code_shift(11))
_LOW64 = np.uint64((1 << fmt.code_shift(11)) - 1)
_ZERO64 = np.uint64(0)


def slot_table(exp_bits: int) -> np.ndarray:
    """The slot of index ``code << 1 | (bits below the code are all zero)``: the
    code's slot, but ±0 (zero bin) and ±Inf (their counts) where those bits are
    zero (``format.encode``'s special codes)."""
    slots = fmt.code_slots(exp_bits)
    n = fmt.raw_codes(exp_bits)
    table = np.repeat(slots[:n], 2)
    top = ((1 << exp_bits) - 1) << 2                      # exponent all ones, mantissa 00
    sign = 1 << (exp_bits + 2)
    for code, special in ((0, 0), (sign, 1), (top, 2), (sign | top, 3)):
        table[code << 1 | 1] = slots[n + special]
    return table.astype(np.int16)


# --- bits <-> values -----------------------------------------------------------------
@intrinsic
def _as_f32(typingctx, u):
    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(u), codegen


@intrinsic
def _bits_f32(typingctx, v):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _as_f64(typingctx, u):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.uint64), codegen


@intrinsic
def _half_f32(typingctx, h):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


def _element(a, i, dec):
    """(value as float64, bits as uint32 or uint64, finite) of element ``i``."""


@overload(_element, inline="always")
def _element_impl(a, i, dec):
    dt = a.dtype
    if dt == types.uint64:                                 # float64
        def f64(a, i, dec):
            u = a[i]
            return _as_f64(u), u, (u & _EXP64) != _EXP64
        return f64
    if dt == types.uint32:                                 # float32
        def f32(a, i, dec):
            u = a[i]
            return np.float64(_as_f32(u)), u, (u & 0x7F800000) != 0x7F800000
        return f32
    if dt == types.uint16:                                 # bfloat16: its float32's top half
        def bf16(a, i, dec):
            u = np.uint32(np.uint32(a[i]) << 16)
            return np.float64(_as_f32(u)), u, (u & 0x7F800000) != 0x7F800000
        return bf16
    if dt == types.int16:                                  # float16, widened exactly
        def f16(a, i, dec):
            v = _half_f32(a[i])
            u = _bits_f32(v)
            return np.float64(v), u, (u & 0x7F800000) != 0x7F800000
        return f16
    if dt == types.uint8:                                  # an 8-bit float: its float32 bits
        def f8(a, i, dec):
            u = dec[a[i]]
            return np.float64(_as_f32(u)), u, (u & 0x7F800000) != 0x7F800000
        return f8


def _index(u):
    """The slot table's index of bits ``u`` (see ``slot_table``)."""


@overload(_index, inline="always")
def _index_impl(u):
    if u == types.uint64:
        return lambda u: np.intp(u >> _SHIFT64) * 2 + np.intp((u & _LOW64) == _ZERO64)
    return lambda u: np.intp(u >> 21) * 2 + np.intp((u & 0x1FFFFF) == 0)


# --- the kernels ---------------------------------------------------------------------
@njit(nogil=True, cache=True)
def chunk(a, start, stop, dec, table, shift, hist):
    """Elements ``start:stop`` of flat ``a``: slot counts added to ``hist`` (LANES x
    SLOTS, int64) and (sum of d, sum of d * d, min, max) of the finite ones."""
    inf = np.inf
    s_all, q_all, lo, hi = 0.0, 0.0, inf, -inf
    i = start
    while i < stop:
        end = min(stop, i + BLOCK)
        s0 = s1 = s2 = s3 = 0.0
        q0 = q1 = q2 = q3 = 0.0
        while i + LANES <= end:
            x0, u0, f0 = _element(a, i, dec)
            x1, u1, f1 = _element(a, i + 1, dec)
            x2, u2, f2 = _element(a, i + 2, dec)
            x3, u3, f3 = _element(a, i + 3, dec)
            hist[0, table[_index(u0)]] += 1
            hist[1, table[_index(u1)]] += 1
            hist[2, table[_index(u2)]] += 1
            hist[3, table[_index(u3)]] += 1
            d0 = x0 - shift if f0 else 0.0
            d1 = x1 - shift if f1 else 0.0
            d2 = x2 - shift if f2 else 0.0
            d3 = x3 - shift if f3 else 0.0
            s0 += d0
            s1 += d1
            s2 += d2
            s3 += d3
            q0 += d0 * d0
            q1 += d1 * d1
            q2 += d2 * d2
            q3 += d3 * d3
            lo = min(lo, min(x0 if f0 else inf, x1 if f1 else inf),
                     min(x2 if f2 else inf, x3 if f3 else inf))
            hi = max(hi, max(x0 if f0 else -inf, x1 if f1 else -inf),
                     max(x2 if f2 else -inf, x3 if f3 else -inf))
            i += LANES
        while i < end:
            x0, u0, f0 = _element(a, i, dec)
            hist[0, table[_index(u0)]] += 1
            if f0:
                d0 = x0 - shift
                s0 += d0
                q0 += d0 * d0
                lo = min(lo, x0)
                hi = max(hi, x0)
            i += 1
        s_all += (s0 + s1) + (s2 + s3)
        q_all += (q0 + q1) + (q2 + q3)
    return s_all, q_all, lo, hi


@njit(nogil=True, cache=True)
def finish(n, shift, parts, hists, out):
    """The summary vector (``_summary``'s layout) of a tensor from its chunks'
    ``parts`` (rows of sum, sum of squares, min, max) and ``hists``
    (chunks x LANES x SLOTS), into ``out``."""
    out[0] = n
    out[1] = shift
    out[2] = 0.0
    out[3] = 0.0
    out[4] = np.inf
    out[5] = -np.inf
    for p in range(parts.shape[0]):
        out[2] += parts[p, 0]
        out[3] += parts[p, 1]
        out[4] = min(out[4], parts[p, 2])
        out[5] = max(out[5], parts[p, 3])
    for j in range(SLOTS):
        c = 0
        for p in range(hists.shape[0]):
            for lane in range(LANES):
                c += hists[p, lane, j]
        out[HEAD + j] = c


@njit(nogil=True, cache=True)
def shift_of(a, start, dec):
    """The sums' shift of a tensor starting at ``start``: its first element if
    finite, else 0 (as ``_summary.reductions``)."""
    x, u, f = _element(a, start, dec)
    return x if f else 0.0


@njit(nogil=True, cache=True)
def one(a, dec, table, out):
    """The summary vector of flat ``a`` (non-empty) into ``out``, on this thread."""
    shift = shift_of(a, 0, dec)
    hist = np.zeros((1, LANES, SLOTS), np.int64)
    parts = np.empty((1, 4))
    parts[0, 0], parts[0, 1], parts[0, 2], parts[0, 3] = chunk(a, 0, a.size, dec, table, shift,
                                                               hist[0])
    finish(a.size, shift, parts, hist, out)


@njit(nogil=True, cache=True)
def many(a, offsets, first, last, dec, table, out):
    """Rows ``first:last`` of ``out`` (tensors x VECTOR, float64): the summary
    vector of each segment ``offsets[k]:offsets[k + 1]`` of flat ``a`` (non-empty)."""
    hist = np.zeros((1, LANES, SLOTS), np.int64)
    parts = np.empty((1, 4))
    for k in range(first, last):
        shift = shift_of(a, offsets[k], dec)
        hist[:] = 0
        parts[0, 0], parts[0, 1], parts[0, 2], parts[0, 3] = chunk(
            a, offsets[k], offsets[k + 1], dec, table, shift, hist[0])
        finish(offsets[k + 1] - offsets[k], shift, parts, hist, out[k])


@njit(nogil=True, cache=True)
def nonfinite(a, start, stop, dec, out):
    """NaN, +Inf and -Inf counts of elements ``start:stop`` of flat ``a``, added
    to ``out`` (int64)."""
    nan = pos = neg = 0
    for i in range(start, stop):
        x, u, f = _element(a, i, dec)
        if not f:
            if x != x:
                nan += 1
            elif x > 0:
                pos += 1
            else:
                neg += 1
    out[0] += nan
    out[1] += pos
    out[2] += neg


def cached_mark(dtype: str) -> str:
    """The file that says ``compile_for(dtype)`` has filled numba's cache for this
    source, numba and machine (numba itself checks each entry when it loads)."""
    import numba
    import platform
    stat = os.stat(__file__)
    tag = f"{dtype}-{numba.__version__}-{platform.machine()}-{stat.st_mtime_ns}-{stat.st_size}"
    return os.path.join(one._cache.cache_path, f"tensortape-{tag}.ok")


def compile_for(dtype: str, mark: bool = False) -> None:
    """Compile (or load from numba's cache) every kernel a tensor of ``dtype`` (a
    ``READS`` key) takes, by running each on a few elements of its bits; ``mark``:
    then write its ``cached_mark``."""
    bits_type, exp_bits = READS[dtype]
    a = np.zeros(LANES + 1, bits_type)
    dec, table = np.zeros(256, np.uint32), slot_table(exp_bits)
    dec = dec if bits_type == np.uint8 else NO_TABLE
    hist = np.zeros((1, LANES, SLOTS), np.int64)
    parts = np.zeros((1, 4))
    out = np.zeros(HEAD + SLOTS)
    parts[0] = chunk(a, 0, a.size, dec, table, shift_of(a, 0, dec), hist[0])
    finish(a.size, 0.0, parts, hist, out)
    one(a, dec, table, out)
    nonfinite(a, 0, a.size, dec, np.zeros(3, np.int64))
    if dtype in ("float32", "float64"):                 # reduce_many's widths
        many(a, np.array([0, a.size], np.int64), 0, 1, dec, table, out.reshape(1, -1))
    if mark:
        with open(cached_mark(dtype), "w"):
            pass

