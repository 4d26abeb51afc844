"""The histogram codec: the integer code of each float element, and the bins
the codes are counted into (``bin_edges``, shared by every dtype and kind).

The recorder's device engines implement ``encode`` and map their code counts
through ``code_slots``; a statistics table stores ``NBINS`` counts per row
(``bin_lo``/``bin_hi`` its edges), which the reader labels with ``bin_centers``.

Public: the reader imports it.  Pure numpy, no state but its tables' caches;
any thread.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = ["NAN_SLOT", "NBINS", "NEGINF_SLOT", "POSINF_SLOT", "SLOTS", "ZERO_BIN", "bin_centers",
           "bin_edges", "code_shift", "code_slots", "code_width", "encode", "raw_codes"]

# The device gives every float element an integer code.  A finite non-zero value
# gets its raw code: sign | exponent | top 2 mantissa bits, taken from the float's
# bits (float32 for 16- and 32-bit floats, 8 exponent bits; float64, 11).  Exact
# zeros and Infs get the special codes after the raw ones.  Counting the codes
# gives the histogram and exact zero, NaN and Inf counts at once.
#
# Bins: a value x != 0 lies in [2^e (1 + m/4), 2^e (1 + (m+1)/4)) with m in 0..3.
# Exponents E_MIN..E_MAX-1 get four bins each, per sign; magnitudes below
# 2^E_MIN fall in an "underflow" bin, those at or above 2^E_MAX in an
# "overflow" bin; exact zeros have their own bin.  NaN and +/-Inf are counted
# apart (the ``nan``, ``posinf`` and ``neginf`` statistics).
MANTISSA_BITS = {8: 23, 11: 52}
SPECIAL_CODES = ("poszero", "negzero", "posinf", "neginf")
E_MIN, E_MAX, SUB = -64, 64, 4
_PER_SIGN = (E_MAX - E_MIN) * SUB + 2          # + underflow and overflow
NBINS = 2 * _PER_SIGN + 1
ZERO_BIN = _PER_SIGN


def raw_codes(exp_bits: int) -> int:
    """How many raw codes floats with ``exp_bits`` exponent bits have."""
    return 1 << (exp_bits + 3)


def code_shift(exp_bits: int) -> int:
    """The right shift of a float's bits that leaves its raw code."""
    return MANTISSA_BITS[exp_bits] - 2


def code_width(exp_bits: int) -> int:
    """Codes per histogram: the raw ones, then the special ones."""
    return raw_codes(exp_bits) + len(SPECIAL_CODES)


def encode(x: np.ndarray) -> tuple[np.ndarray, int]:
    """The codes of a float array and their exponent width (the reference the
    device engines implement; 16-bit floats are coded as float32)."""
    x = np.asarray(x)
    x = x.astype(np.float64 if x.dtype == np.float64 else np.float32).ravel()
    exp_bits = 11 if x.dtype == np.float64 else 8
    bits = x.view(np.int64 if exp_bits == 11 else np.int32)
    n = raw_codes(exp_bits)
    code = (bits >> code_shift(exp_bits)) & (n - 1)
    code = np.where(x == 0, n + (bits < 0), code)
    code = np.where(x == np.inf, n + 2, code)
    return np.where(x == -np.inf, n + 3, code).astype(np.int64), exp_bits


@lru_cache(maxsize=None)
def bin_edges() -> tuple[np.ndarray, np.ndarray]:
    """(bin_lo, bin_hi) of the shared bins, ascending by value."""
    mags_lo = [0.0]
    mags_hi = [2.0 ** E_MIN]
    for e in range(E_MIN, E_MAX):
        for m in range(SUB):
            mags_lo.append(2.0 ** e * (1 + m / SUB))
            mags_hi.append(2.0 ** e * (1 + (m + 1) / SUB))
    mags_lo.append(2.0 ** E_MAX)
    mags_hi.append(math.inf)
    lo_pos, hi_pos = np.array(mags_lo), np.array(mags_hi)
    lo = np.concatenate([-hi_pos[::-1], [0.0], lo_pos])
    hi = np.concatenate([-lo_pos[::-1], [0.0], hi_pos])
    return lo, hi


@lru_cache(maxsize=None)
def bin_centers() -> np.ndarray:
    """A value per bin: its middle, or its finite edge for the open-ended tails."""
    lo, hi = bin_edges()
    return np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, np.where(np.isfinite(lo), lo, hi))


def _magnitude_bin(exponent: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Index within one sign's half (0 = underflow) of normal numbers."""
    idx = (exponent - E_MIN) * SUB + sub + 1
    idx = np.where(exponent < E_MIN, 0, idx)
    return np.where(exponent >= E_MAX, _PER_SIGN - 1, idx)


@lru_cache(maxsize=None)
def code_to_bin(exp_bits: int) -> np.ndarray:
    """Map raw codes to global bins; NaN codes (all-ones exponent) map to -1,
    subnormals to underflow."""
    bias = (1 << (exp_bits - 1)) - 1
    codes = np.arange(raw_codes(exp_bits))
    sign = codes >> (exp_bits + 2)
    exp_field = (codes >> 2) & ((1 << exp_bits) - 1)
    sub = codes & 3
    mag = _magnitude_bin(exp_field - bias, sub)
    mag = np.where(exp_field == 0, 0, mag)
    out = np.where(sign == 0, ZERO_BIN + 1 + mag, ZERO_BIN - 1 - mag)
    return np.where(exp_field == (1 << exp_bits) - 1, -1, out).astype(np.int64)


# A summary vector's counts: one slot per bin, then the NaN, +Inf and -Inf counts.
NAN_SLOT, POSINF_SLOT, NEGINF_SLOT = NBINS, NBINS + 1, NBINS + 2
SLOTS = NBINS + 3


@lru_cache(maxsize=None)
def code_slots(exp_bits: int) -> np.ndarray:
    """The slot of each histogram code (``code_width`` of them): its bin, or the
    NaN, +Inf or -Inf count.  Both zeros go to the zero bin.  The device maps its
    code counts through this, so a summary's counts have one width for every dtype."""
    raw = code_to_bin(exp_bits)
    raw = np.where(raw < 0, NAN_SLOT, raw)
    return np.concatenate([raw, [ZERO_BIN, ZERO_BIN, POSINF_SLOT, NEGINF_SLOT]]).astype(np.int64)
