"""Numbers for JSON, one rule for every JSON tensortape writes (the CLI's, the
events', the browser view's API): floats at full precision, integers as
integers, NaN and Inf as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (JSON
has neither); and, in a row of statistics whose ``count`` is -1 (the layer did
not run there: absent), the float statistics as ``null``, the counts as -1."""

from __future__ import annotations

import math

__all__ = ["number", "statistics_row"]

COUNTS = ("count", "nan", "posinf", "neginf")


def number(v, integer: bool = False):
    """``v`` for JSON: an int (``integer``, when finite), a float, or "nan", "inf", "-inf"."""
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return int(v) if integer else v


def statistics_row(row: dict, stats, integers=COUNTS) -> dict:
    """A row of ``stats`` (and other columns, kept as they are) for JSON; an absent
    row's float statistics are ``None``."""
    absent = "count" in row and row["count"] is not None and float(row["count"]) < 0
    return {k: ((int(v) if k in integers else None) if absent and k in stats else
                number(v, k in integers) if k in stats else v)
            for k, v in row.items()}
