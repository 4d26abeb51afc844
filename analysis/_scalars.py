"""A run's logged scalars (``rec.log``; the trainers' callbacks and ``tensortape
record`` log theirs), as ``run.scalars()`` returns them: an ``xr.Dataset`` over
``step`` (and ``rank`` in a run of several), one float64 variable per name.

Each rank's scalars table (``format.scalars_table``) holds a row per (step,
name); of a step recorded again (``mode="a"``) only the latest recording's
rows are read (``RunIndex.current_rows``), and of a name logged twice for one
step, the last.  A name that has no value at a step (or on a rank) is NaN
there.  A row whose value's chunk is missing (``_damage``) is no value logged:
its step is on the ``step`` axis, NaN.  A store without scalars (any older one)
gives an empty Dataset.  A name that is a coordinate's (``step``, ``rank``)
reads with a ``'`` added, more while that name is logged too (``variables``: as
the root's label is made), in every reader of them.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt

from ._index import RunIndex

__all__ = ["logged", "scalars", "variables"]

COORDINATES = ("step", "rank")


def logged(index: RunIndex, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{name: (steps, values)} of one rank, steps ascending: the values logged (a
    NaN logged is there; a step without the name, or whose value's chunk is
    missing, is not)."""
    return _logged(index, rank)[0]


def _logged(index: RunIndex, rank: int) -> tuple[dict, np.ndarray]:
    """``logged``, and the steps of the rows whose value's chunk is missing."""
    path = fmt.scalars_table(rank)
    if not index.committed(rank).get(path):
        return {}, np.zeros(0, np.int64)
    current, steps = index.current_rows(path, rank)
    n = len(steps)
    names = np.asarray(index.source.array(f"{path}/name")[:n])[current]
    values = np.asarray(index.source.array(f"{path}/value")[:n], np.float64)[current]
    unread = index.unreadable(path, rank, ("value",), current, 0)
    steps = steps[current]
    keep = fmt.latest_rows(np.stack([steps, names], axis=1))     # the last of (step, name)
    lost, keep = steps[keep[unread[keep]]], keep[~unread[keep]]
    known = index.states[rank].scalar_names
    name = variables(index)
    out = {}
    for i in np.unique(names[keep]):
        rows = keep[names[keep] == i]
        rows = rows[np.argsort(steps[rows], kind="stable")]
        if 0 <= i < len(known):
            out[name[known[i]]] = (steps[rows], values[rows])
    return out, lost


def variables(index: RunIndex) -> dict[str, str]:
    """Each logged name (of any rank) -> its name in ``run.scalars()``: itself, or for a
    coordinate's name ``'`` added until it is no name logged or given."""
    logged = [n for r in index.ranks for n in index.states[r].scalar_names]
    taken = set(COORDINATES) | set(logged)
    out = {}
    for n in dict.fromkeys(logged):
        var = n
        while n in COORDINATES and var in taken:
            var += "'"
        taken.add(var)
        out[n] = var
    return out


def scalars(index: RunIndex, rank: int | None = None) -> xr.Dataset:
    """The run's scalars (see the module); ``rank``: one rank's."""
    ranks = [index.rank(rank)] if rank is not None or len(index.ranks) < 2 else index.ranks
    got = [_logged(index, r) for r in ranks]
    per_rank = [part for part, _ in got]
    names = list(dict.fromkeys(n for part in per_rank for n in part))
    steps = np.unique(np.concatenate([np.zeros(0, np.int64)] + [lost for _, lost in got] + [
        s for part in per_rank for s, _ in part.values()])).astype(np.int64)
    data = {}
    for name in names:
        grid = np.full((len(ranks), len(steps)), np.nan)
        for j, part in enumerate(per_rank):
            if name in part:
                s, v = part[name]
                grid[j, np.searchsorted(steps, s)] = v
        data[name] = (("rank", "step"), grid) if len(ranks) > 1 else (("step",), grid[0])
    coords = {"step": steps}
    if len(ranks) > 1:
        coords["rank"] = ranks
    ds = xr.Dataset(data, coords=coords)
    if len(ranks) == 1 and index.ranks:
        ds.attrs["rank"] = ranks[0]
    return ds
