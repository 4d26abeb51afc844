"""The store format: names, versions and the shared histogram bins.

This module is the single source of truth for the on-disk layout; the
writer (``recorder.store``) and every reader (``analysis``) import it.

Layout of a store (Zarr v3)::

    run.zarr/                       root attrs: tensortape_format, status, ...
      rank0/                        attrs: committed row counts, layers, events
        stats/<kind>/               step (step), <stat> (step, layer),
                                    hist (step, layer, bin), bin_lo/bin_hi (bin)
        tensors/<kind>/<layer>/     data (step, dim_0, ...), step (step),
                                    extent (step, axis)
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import lru_cache

import numpy as np

FORMAT_VERSION = 1

KINDS = ("activations", "gradients", "inputs", "weights", "weight_grads")
FORWARD_KINDS = ("inputs", "activations", "weights")
BACKWARD_KINDS = ("gradients", "weight_grads")

STATS = (
    "count", "mean", "std", "min", "max", "abs_max", "norm",
    "zero_frac", "nan", "posinf", "neginf",
)

STATUS_RECORDING = "recording"
STATUS_COMPLETE = "complete"
STATUS_INTERRUPTED = "interrupted"

ROOT_LABEL = "(root)"
BF16_ATTR = "logical_dtype"
BF16 = "bfloat16"

# --- histogram bins --------------------------------------------------------
# A value x != 0 lies in [2^e (1 + m/4), 2^e (1 + (m+1)/4)) with m in 0..3.
# Exponents E_MIN..E_MAX-1 get four bins each, per sign; magnitudes below
# 2^E_MIN fall in an "underflow" bin, those at or above 2^E_MAX in an
# "overflow" bin; exact zeros have their own bin.  NaN and +/-Inf are counted
# apart (the ``nan``, ``posinf`` and ``neginf`` statistics).
E_MIN, E_MAX, SUB = -64, 64, 4
_PER_SIGN = (E_MAX - E_MIN) * SUB + 2          # + underflow and overflow
NBINS = 2 * _PER_SIGN + 1
ZERO_BIN = _PER_SIGN


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


def _magnitude_bin(exponent: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Index within one sign's half (0 = underflow) of normal numbers."""
    idx = (exponent - E_MIN) * SUB + sub + 1
    idx = np.where(exponent < E_MIN, 0, idx)
    return np.where(exponent >= E_MAX, _PER_SIGN - 1, idx)


@lru_cache(maxsize=None)
def code_to_bin(exp_bits: int) -> np.ndarray:
    """Map raw codes ``sign | exponent | 2 mantissa bits`` to global bins.

    ``exp_bits`` is 8 for float32 codes and 11 for float64 codes.  Codes with
    an all-ones exponent (NaN; Infs and exact zeros are coded apart by the
    summary) map to -1; a zero exponent (subnormals) maps to underflow.
    """
    bias = (1 << (exp_bits - 1)) - 1
    codes = np.arange(1 << (exp_bits + 3))
    sign = codes >> (exp_bits + 2)
    exp_field = (codes >> 2) & ((1 << exp_bits) - 1)
    sub = codes & 3
    mag = _magnitude_bin(exp_field - bias, sub)
    mag = np.where(exp_field == 0, 0, mag)
    out = np.where(sign == 0, ZERO_BIN + 1 + mag, ZERO_BIN - 1 - mag)
    return np.where(exp_field == (1 << exp_bits) - 1, -1, out).astype(np.int64)


@lru_cache(maxsize=None)
def _bin_groups(exp_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes ordered by bin, where each bin's run starts, and those bins."""
    lut = code_to_bin(exp_bits)
    keep = np.nonzero(lut >= 0)[0]
    order = keep[np.argsort(lut[keep], kind="stable")]
    ordered = lut[order]
    starts = np.concatenate([[0], np.nonzero(np.diff(ordered))[0] + 1])
    return order, starts, ordered[starts]


def bins_from_codes(raw: np.ndarray, exp_bits: int, zeros) -> np.ndarray:
    """Global histogram counts (..., NBINS) from raw code counts (..., codes).

    The raw counts exclude exact zeros (``zeros``, one per row), which get
    ``ZERO_BIN``.  Works on one vector or on a batch of rows at once.
    """
    order, starts, bins = _bin_groups(exp_bits)
    raw = np.asarray(raw)
    hist = np.zeros((*raw.shape[:-1], NBINS), dtype=np.int64)
    hist[..., bins] = np.rint(np.add.reduceat(raw[..., order], starts, axis=-1))
    hist[..., ZERO_BIN] = zeros
    return hist


# --- names and paths -------------------------------------------------------
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def node_name(layer: str) -> str:
    """A store node name for a layer name that can never escape its folder.

    Characters outside ``[A-Za-z0-9_.-]`` are percent-encoded, a leading dot
    too (so ``.`` and ``..`` are impossible), and overlong names are cut and
    suffixed with a hash.  Readers never invert this: the true name is kept
    in the node's ``name`` attribute.
    """
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in layer)
    if not out or out.startswith(".") or out.startswith("__"):
        out = "%2E" + out[1:] if out.startswith(".") else "%5F" + out[1:] if out else "%00"
    if len(out) > 180:
        out = out[:160] + "~" + hashlib.sha1(layer.encode()).hexdigest()[:16]
    return out


def rank_group(rank: int) -> str:
    return f"rank{int(rank)}"


def stats_group(rank: int, kind: str) -> str:
    return f"{rank_group(rank)}/stats/{kind}"


def tensor_group(rank: int, kind: str, layer: str) -> str:
    return f"{rank_group(rank)}/tensors/{kind}/{node_name(layer)}"


def to_json(obj):
    """A JSON-safe copy of ``obj`` (raises ``TypeError`` for other objects)."""
    return json.loads(json.dumps(obj, allow_nan=False))
