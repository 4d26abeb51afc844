"""The numba kernels of the CPU statistics engine (``_numba``): one read per tensor.

Every element is read as its bits (float32 as ``uint32``, float64 as ``uint64``,
bfloat16 as ``uint16``, float16 as ``int16``, the 8-bit floats as ``uint8``
through a 256-entry table of their float32 bits: no widened copy).  A tensor
is taken block by block (``BLOCK`` elements), in two loops over each: one read
of memory, the second loop's from the cache:

- ``_moments``, one vectorised loop: if finite, ``d = x - shift`` in float64
  (a float64 tensor's scaled as ``_summary.scale_exponent`` says, when a first
  pass found it needs it: ``scale``), summed with ``d * d`` (reassociated into
  the CPU's vector lanes: the same sums as ``_summary.reductions`` but for
  rounding; the blocks' sums are added in order); the minimum and maximum as
  integer order keys of the bits (``_key``: integer reductions vectorise, float
  ``min`` does not); and the counts of +0, -0, +Inf and -Inf;
- ``_codes``: each element's histogram code (``format.encode``'s top bits)
  counted into ``LANES`` private int32 rows (element ``i`` into lane
  ``i % LANES``, so a run of equal codes, a ReLU's zeros, does not serialise
  on one counter).

``finish`` turns the codes' counts into histogram slots (``format.code_slots``),
moving the four special values from their code's slot to their own.  A step's
tiny tensors (``many``) count slots straight into their rows instead.

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

from tensortape.recorder import histogram as fmt

__all__ = ["BLOCK", "HEAD", "LANES", "NO_TABLE", "READS", "UNCOUNTED", "cached_mark", "chunk",
           "compile_for", "finish", "many", "nonfinite", "one", "shift_of", "slot_table"]

LANES = 4
BLOCK = 4096            # elements of a block: read by both loops while in cache, summed
                        # before they join the running sums
HEAD = 6                # the head of a summary vector (``_summary.FIELDS``)
SLOTS = fmt.SLOTS
NO_TABLE = np.zeros(1, np.uint32)       # the decoder table of a dtype that needs none
UNCOUNTED = np.zeros((0, 1), np.int32)  # ``chunk``'s counts when its codes are not counted
# how each float dtype is read: its bits' numpy type and code width (8-bit floats through
# a table of their float32 bits)
READS = {"float64": (np.uint64, 11), "float32": (np.uint32, 8), "bfloat16": (np.uint16, 8),
         "float16": (np.int16, 8), "float8": (np.uint8, 8)}
_EXP64 = np.uint64(0x7FF0000000000000)                   # float64's exponent bits
_SHIFT64 = np.uint64(fmt.code_shift(11))
_LOW64 = np.uint64((1 << fmt.code_shift(11)) - 1)
_CODES64 = fmt.raw_codes(11)                             # float64's codes (8-bit exponents: 2048)
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


# --- per element type: the order key, the special values, the code -----------------
def _key(u):
    """The signed integer that orders floats as their values do (-0 just below +0),
    of bits ``u``: its minimum and maximum are the floats' (integer reductions
    vectorise; float ``min`` with its NaN rules does not)."""


@overload(_key, inline="always")
def _key_impl(u):
    if u == types.uint64:
        return lambda u: np.int64(u) ^ ((np.int64(u) >> 63) & 0x7FFFFFFFFFFFFFFF)
    return lambda u: np.int32(u) ^ ((np.int32(u) >> 31) & 0x7FFFFFFF)


def _value(k, a):
    """The float64 value of order key ``k`` of the bits ``a`` is read as (``_key``'s
    inverse; numba widens the keys to int64); ±Inf for the keys that stand for "no
    finite element"."""


@overload(_value, inline="always")
def _value_impl(k, a):
    if a.dtype == types.uint64:
        def f64(k, a):
            if k == _NONE64[0] or k == _NONE64[1]:
                return np.inf if k == _NONE64[0] else -np.inf
            return _as_f64(np.uint64(k ^ ((k >> 63) & 0x7FFFFFFFFFFFFFFF)))
        return f64

    def f32(k, a):
        if k == _NONE32[0] or k == _NONE32[1]:
            return np.inf if k == _NONE32[0] else -np.inf
        return np.float64(_as_f32(np.uint32(k ^ ((k >> 31) & 0x7FFFFFFF))))
    return f32


_NONE32 = (np.int32(0x7FFFFFFF), np.int32(-0x80000000))       # (min, max) keys of no element
_NONE64 = (np.int64(0x7FFFFFFFFFFFFFFF), np.int64(-0x8000000000000000))


def _none(a):
    """The (minimum, maximum) keys of no element, for the bits ``a`` is read as."""


@overload(_none, inline="always")
def _none_impl(a):
    if a.dtype == types.uint64:
        return lambda a: _NONE64
    return lambda a: _NONE32


def _specials(u):
    """Whether bits ``u`` are +0, -0, +Inf, -Inf: the values whose slots differ
    from their code's (``slot_table``)."""


@overload(_specials, inline="always")
def _specials_impl(u):
    if u == types.uint64:
        return lambda u: (u == _ZERO64, u == _NZERO64, u == _EXP64, u == _NINF64)
    return lambda u: (u == 0, u == 0x80000000, u == 0x7F800000, u == 0xFF800000)


_NZERO64 = np.uint64(0x8000000000000000)
_NINF64 = np.uint64(0xFFF0000000000000)


def _code(u):
    """The histogram code of bits ``u`` (``format.encode``, before its special
    codes): the top bits, sign, exponent and the mantissa's first two."""


@overload(_code, inline="always")
def _code_impl(u):
    if u == types.uint64:
        return lambda u: np.intp(u >> _SHIFT64)
    return lambda u: np.intp(u >> 21)


def _shifted(x, shift, scale):
    """``x - shift``, both times ``scale`` (None: not scaled; a separate compile)."""


@overload(_shifted, inline="always")
def _shifted_impl(x, shift, scale):
    if isinstance(scale, types.NoneType):
        return lambda x, shift, scale: x - shift
    return lambda x, shift, scale: x * scale - shift * scale


# --- the kernels ---------------------------------------------------------------------
@njit(nogil=True, cache=True, fastmath={"reassoc"})
def _moments(b, dec, shift, scale):
    """Of the elements of ``b`` (a block): the sum of ``d = x - shift`` (times
    ``scale``, unless None) and of ``d * d`` over the finite ones, their minimum
    and maximum order keys, and the counts of +0, -0, +Inf and -Inf.  One
    vectorised loop: the sums reassociated (the CPU's vector lanes; they differ
    from an ordered sum only in rounding)."""
    s = q = 0.0
    lo, hi = _none(b)
    p0 = n0 = pi = ni = np.int32(0)
    for j in range(b.size):
        x, u, f = _element(b, j, dec)
        d = _shifted(x, shift, scale) if f else 0.0
        s += d
        q += d * d
        k = _key(u)
        lo = min(lo, k if f else _none(b)[0])
        hi = max(hi, k if f else _none(b)[1])
        z, nz, inf, ninf = _specials(u)
        p0 += np.int32(z)
        n0 += np.int32(nz)
        pi += np.int32(inf)
        ni += np.int32(ninf)
    return s, q, lo, hi, p0, n0, pi, ni


@njit(nogil=True, cache=True)
def _codes(b, dec, counts):
    """Counts of the codes of ``b``'s elements added to ``counts`` (LANES x codes,
    int32): element ``i`` into lane ``i % LANES``, so a run of equal codes, a
    ReLU's zeros, does not serialise on one counter."""
    n = b.size // LANES
    for i in range(n):
        for lane in range(LANES):
            x, u, f = _element(b, i * LANES + lane, dec)
            counts[lane, _code(u)] += 1
    for j in range(n * LANES, b.size):
        x, u, f = _element(b, j, dec)
        counts[0, _code(u)] += 1


@njit(nogil=True, cache=True)
def chunk(a, start, stop, dec, shift, scale, counts, special):
    """Elements ``start:stop`` of flat ``a``, block after block of ``BLOCK``, their
    sums around ``shift`` times ``scale`` (None: not scaled): its
    codes counted into ``counts`` (LANES x the codes, half ``slot_table``'s length;
    int32: a chunk holds at most ``2 ** 30`` elements; not when ``counts`` has no
    rows: a step's tiny tensors count slots themselves), then ``_moments`` of the
    block, from the cache.  The special values' counts are added to ``special``
    (+0, -0, +Inf, -Inf; int64); returns (sum of d, sum of d * d, min, max) of the
    finite elements, the blocks' sums added in order (a long tensor's sums stay
    accurate)."""
    s_all = q_all = 0.0
    lo, hi = _none(a)
    i = start
    while i < stop:
        end = min(stop, i + BLOCK)
        b = a[i:end]
        if counts.shape[0]:
            _codes(b, dec, counts)
        s, q, l, h, p0, n0, pi, ni = _moments(b, dec, shift, scale)
        s_all += s
        q_all += q
        lo = min(lo, l)
        hi = max(hi, h)
        special[0] += p0
        special[1] += n0
        special[2] += pi
        special[3] += ni
        i = end
    return s_all, q_all, _value(lo, a), _value(hi, a)


@njit(nogil=True, cache=True)
def finish(n, shift, parts, counts, special, table, out):
    """The summary vector (``_summary``'s layout) of a tensor from its chunks'
    ``parts`` (rows of sum, sum of squares, min, max), code ``counts`` (chunks x
    LANES x codes) and ``special`` counts (chunks x 4), into ``out``; ``table``:
    ``slot_table`` (a code's slot at ``code << 1``, a special value's at its code's
    ``code << 1 | 1``)."""
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
    out[HEAD:] = 0.0
    ncodes = counts.shape[2]
    for code in range(ncodes):
        c = 0
        for p in range(counts.shape[0]):
            for lane in range(LANES):
                c += counts[p, lane, code]
        out[HEAD + table[code << 1]] += c
    width = 11 if ncodes == _CODES64 else 8                     # the code's exponent bits
    top = ((1 << width) - 1) << 2                               # exponent all ones, mantissa 00
    sign = 1 << (width + 2)
    for k, code in enumerate((0, sign, top, sign | top)):      # +0, -0, +Inf, -Inf
        c = 0
        for p in range(special.shape[0]):
            c += special[p, k]
        out[HEAD + table[code << 1]] -= c
        out[HEAD + table[code << 1 | 1]] += c


@njit(nogil=True, cache=True)
def shift_of(a, start, stop, dec):
    """The sums' shift of elements ``start:stop``: their first finite one (0 if
    none).  ``_summary.reductions`` takes the first element if finite, else 0: a
    tensor whose first element is NaN would then be summed around 0, and its
    variance cancel (a large mean, a small spread)."""
    for i in range(start, stop):
        x, u, f = _element(a, i, dec)
        if f:
            return x
    return 0.0


@njit(nogil=True, cache=True)
def one(a, dec, table, out):
    """The summary vector of flat ``a`` (non-empty, at most ``2 ** 30`` elements)
    into ``out``, on this thread."""
    shift = shift_of(a, 0, a.size, dec)
    counts = np.zeros((1, LANES, table.size >> 1), np.int32)
    special = np.zeros((1, 4), np.int64)
    parts = np.empty((1, 4))
    parts[0, 0], parts[0, 1], parts[0, 2], parts[0, 3] = chunk(a, 0, a.size, dec, shift, None,
                                                               counts[0], special[0])
    finish(a.size, shift, parts, counts, special, table, out)


@njit(nogil=True, cache=True)
def many(a, offsets, first, last, dec, table, out):
    """Rows ``first:last`` of ``out`` (tensors x VECTOR, float64): the summary
    vector of each segment ``offsets[k]:offsets[k + 1]`` of flat ``a`` (non-empty,
    tiny): the sums as ``one``'s, each element's slot counted straight into its row
    (one lookup by code and "bits below the code are zero", see ``slot_table``)."""
    special = np.zeros(4, np.int64)
    uncounted = np.zeros((0, 1), np.int32)             # the slots are counted below
    for k in range(first, last):
        start, stop = offsets[k], offsets[k + 1]
        shift = shift_of(a, start, stop, dec)
        row = out[k]
        row[0] = stop - start
        row[1] = shift
        row[2], row[3], row[4], row[5] = chunk(a, start, stop, dec, shift, None, uncounted,
                                               special)
        row[HEAD:] = 0.0
        for j in range(start, stop):
            x, u, f = _element(a, j, dec)
            row[HEAD + table[_index(u)]] += 1.0


@njit(nogil=True, cache=True)
def nonfinite(a, start, stop, dec, out):
    """NaN, +Inf and -Inf counts of elements ``start:stop`` of flat ``a``, added
    to ``out`` (int64)."""
    b = a[start:stop]
    nan = pos = neg = 0
    for j in range(b.size):
        x, u, f = _element(b, j, dec)
        z, nz, inf, ninf = _specials(u)
        nan += not (f or inf or ninf)
        pos += inf
        neg += ninf
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
    counts = np.zeros((1, LANES, table.size >> 1), np.int32)
    special = np.zeros((1, 4), np.int64)
    parts = np.zeros((1, 4))
    out = np.zeros(HEAD + SLOTS)
    parts[0] = chunk(a, 0, a.size, dec, shift_of(a, 0, a.size, dec), None, counts[0], special[0])
    if dtype == "float64":                              # a float64 tensor's scaled sums
        chunk(a, 0, a.size, dec, 0.0, 1.0, UNCOUNTED, special[0])
    finish(a.size, 0.0, parts, counts, special, table, out)
    one(a, dec, table, out)
    nonfinite(a, 0, a.size, dec, np.zeros(3, np.int64))
    if dtype in ("float32", "float64"):                 # reduce_many's widths
        many(a, np.array([0, a.size], np.int64), 0, 1, dec, table, out.reshape(1, -1))
    if mark:
        with open(cached_mark(dtype), "w"):
            pass
