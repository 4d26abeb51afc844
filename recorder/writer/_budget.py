"""The budget for full tensors on disk: ``max_bytes``, resolved once at the start.

``max_bytes="auto"`` (the default) is a tenth of the free space where the store
is, at most ``AUTO_CAP`` bytes (for a store on object storage, whose free space
is not known: ``AUTO_CAP``).  ``None`` is no budget; an integer is that budget.
A pure function of the location and the disk's free space: the recorder prints
``Budget.text`` when recording starts (a line on stderr, not a warning: a
default must not fail a run under ``-W error``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from ..errors import argument
from ..format import is_url

__all__ = ["AUTO_CAP", "AUTO_SHARE", "Budget", "resolve"]

AUTO_CAP = 10 * 10**9         # 10 GB: enough for hundreds of steps of a large layer's tensors
AUTO_SHARE = 10               # a tenth of the free space


@dataclass(frozen=True)
class Budget:
    limit: int | None          # bytes of full tensors in all (None: no budget)
    text: str                  # what the recorder prints when recording starts ("": nothing)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def _free(location: str) -> int | None:
    """Free bytes on the disk that holds (or will hold) ``location``."""
    path = os.path.abspath(location)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def resolve(max_bytes, location: str, stores_tensors: bool = True) -> Budget:
    """``max_bytes`` as given (``"auto"``, None or an int) -> the budget in bytes."""
    if max_bytes != "auto":
        return Budget(max_bytes, "")
    free = None if is_url(location) else _free(location)
    if free is None:
        limit = AUTO_CAP
        why = "the free space there is not known"
    else:
        limit = min(free // AUTO_SHARE, AUTO_CAP)
        why = f"a tenth of the {_gb(free)} free there, at most {_gb(AUTO_CAP)}"
    text = (f"tensortape: full tensors up to {_gb(limit)} in {location} "
            f"({argument('max_bytes', 'auto')}: {why}); past it only statistics, histograms "
            f"and the non-finite dump are stored"
            if stores_tensors else "")
    return Budget(limit, text)
