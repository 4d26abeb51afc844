"""The dtypes numpy lacks, as a store holds them: bfloat16 and the 8-bit floats
are stored as their unsigned bits (``format.BITS_DTYPES``), the array's
``logical_dtype`` attribute (``format.LOGICAL_ATTR``) naming the dtype.  This
module turns those bits back into exact float32 (``decode_bits``), and gives
the NaN a padded row is filled with (``nan_bits``).

Public: the reader (``analysis``) decodes full tensors with it.  Pure numpy,
no state but its tables' caches; any thread.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["decode_bits", "nan_bits"]

# (exponent bits, mantissa bits, bias, has a sign bit) of each 8-bit float
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, True),
    "float8_e5m2": (5, 2, 15, True),
    "float8_e4m3fnuz": (4, 3, 8, True),
    "float8_e5m2fnuz": (5, 2, 16, True),
    "float8_e8m0fnu": (8, 0, 127, False),
}


@lru_cache(maxsize=None)
def _float8_table(name: str) -> np.ndarray:
    """The float32 value of each of the 256 codes of an 8-bit float (exact)."""
    exp_bits, man_bits, bias, signed = _FLOAT8[name]
    code = np.arange(256)
    e = (code >> man_bits) & ((1 << exp_bits) - 1)
    m = (code & ((1 << man_bits) - 1)).astype(np.float64)
    frac = m / (1 << man_bits)
    value = np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e - bias))
    if name == "float8_e8m0fnu":                     # no zero, no subnormals: 2^(code - 127)
        value = 2.0 ** (code - 127.0)
    if signed:
        value = np.where(code >> 7, -value, value)
    top = e == (1 << exp_bits) - 1
    if name == "float8_e5m2":
        value = np.where(top & (m == 0), np.copysign(np.inf, value), value)
    with np.errstate(over="ignore"):              # e8m0fnu's 2^128 is its NaN's code
        out = value.astype(np.float32).view(np.uint32)
    # NaNs widen as torch widens them: the payload shifted in and the quiet bit set
    # (e4m3fn, e5m2), or one fixed NaN (the fnuz formats and e8m0fnu)
    if name == "float8_e4m3fn":
        nan = (code & 0x7F) == 0x7F
    elif name == "float8_e5m2":
        nan = top & (m != 0)
    else:
        nan = code == (0x80 if signed else 0xFF)
    if name in ("float8_e4m3fn", "float8_e5m2"):
        widened = ((code >> 7).astype(np.uint32) << 31) | 0x7FC00000 \
            | (code & ((1 << man_bits) - 1)).astype(np.uint32) << (23 - man_bits)
    else:
        widened = np.full(256, 0x7F800001, np.uint32)
    return np.where(nan, widened, out).astype(np.uint32).view(np.float32)


def nan_bits(logical: str) -> int:
    """A NaN's bits in a dtype stored as bits: the fill value of padding."""
    if logical == "bfloat16":
        return 0x7FC0
    return int(np.nonzero(np.isnan(_float8_table(logical)))[0][0])


def decode_bits(block: np.ndarray, logical: str) -> np.ndarray:
    """Stored bits of ``logical`` (bfloat16 or an 8-bit float) -> exact float32."""
    if logical == "bfloat16":
        return (block.astype(np.uint32) << 16).view(np.float32)
    return _float8_table(logical)[block]
