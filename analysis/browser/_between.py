"""The NaN/Inf counts of steps without statistics (``stats_every > 1``), as the
map folds them into its columns.

A stats table has a row at each step with statistics; a step without them
still counts the NaN and Inf of every capture, in the kind's ``nonfinite``
table (``format.nonfinite_table``: complete), and in its events (of which the
attributes keep at most ``format.MAX_EVENTS``).  A map column is non-finite
when any of its steps holds a NaN or an Inf, these steps too: each joins the
column of the last step with statistics before it (the first column where
none is), whose ``step_lo``/``step_hi`` then reach it; under
``stat="nonfinite"`` its count joins the column's largest.  A window without
statistics but with such steps gets columns of those steps.

A store written by a tensortape that kept no such table (its rank state has no
``nonfinite``) is folded from its kept events; the events it did not keep
cannot be placed, and are counted as such (``unplaced``).
"""

from __future__ import annotations

import numpy as np

from tensortape.recorder import format as fmt

__all__ = ["Between"]

BLOCK = 4096            # rows read at a time


class Between:
    """A window's steps without statistics whose captures of ``kind`` held a NaN or
    an Inf on ``rank``: ``steps`` (increasing), read a block at a time (``blocks``)."""

    def __init__(self, run, kind: str, rank: int, start, stop):
        self.run, self.kind, self.rank = run, kind, rank
        st = run.state(rank)
        self.kept = st.nonfinite is not None
        if self.kept:
            path = self.path = fmt.nonfinite_table(rank, kind)
            current, steps = run.index.current_rows(path, rank)
            rows = current[fmt.latest_rows(steps[current])]
            steps = steps[rows]
            self.unplaced = 0
        else:                            # the kept events: a row a step, over its micro-batches
            self.events: dict[int, dict[str, int]] = {}
            for e in run.events_of(rank):
                if e.kind == kind:
                    at = self.events.setdefault(e.step, {})
                    at[e.layer] = at.get(e.layer, 0) + e.nan + e.posinf + e.neginf
            steps = np.array(sorted(self.events), np.int64)
            rows = np.arange(len(steps))
            self.unplaced = st.events_total - len(st.events)
        inside = np.ones(len(steps), bool)
        if start is not None:
            inside &= steps >= start
        if stop is not None:
            inside &= steps < stop
        self.rows, self.steps = rows[inside], steps[inside]

    def blocks(self):
        """(steps, layer names, NaN+Inf count (row, layer)) a block of rows at a time."""
        for b0 in range(0, len(self.rows), BLOCK):
            rows, steps = self.rows[b0:b0 + BLOCK], self.steps[b0:b0 + BLOCK]
            if not self.kept:
                at = [self.events[int(s)] for s in steps]
                names = sorted(set().union(*at))
                yield steps, names, np.array([[a.get(n, 0) for n in names] for a in at], np.int64)
                continue
            counts = _rows(self.run.index.source.array(f"{self.path}/counts"), rows)
            yield steps, self.run.layers_of(self.rank)[:counts.shape[1]], counts.sum(axis=2)

    def fold(self, values: np.ndarray, bad: np.ndarray, lo: np.ndarray, hi: np.ndarray,
             names: list[str], stat: str, columns):
        """The map's columns (``values``, ``bad``: column x layer of ``names``; each
        column's first and last step ``lo``, ``hi``) with these steps folded in: names
        they add are new layers (NaN where they have no statistics).  ``columns(n)``:
        the edges of a window of ``n`` steps, for a window without statistics."""
        if not len(self.steps):
            return values, bad, lo, hi, names
        if not len(lo):
            edges = columns(len(self.steps))
            lo, hi = self.steps[edges[:-1]], self.steps[edges[1:] - 1]
            values = np.full((len(lo), len(names)), np.nan)
            bad = np.zeros(values.shape, bool)
        lo, hi, names = lo.copy(), hi.copy(), list(names)
        where = {n: j for j, n in enumerate(names)}
        for steps, layers, total in self.blocks():
            col = np.maximum(np.searchsorted(lo, steps, "right") - 1, 0)
            np.minimum.at(lo, col, steps)
            np.maximum.at(hi, col, steps)
            r, j = np.nonzero(total > 0)
            for n in {layers[k] for k in j} - where.keys():
                where[n] = len(names)
                names.append(n)
            if len(names) > values.shape[1]:
                grow = len(names) - values.shape[1]
                values = np.concatenate([values, np.full((len(values), grow), np.nan)], axis=1)
                bad = np.concatenate([bad, np.zeros((len(bad), grow), bool)], axis=1)
            at = (col[r], np.array([where[layers[k]] for k in j], np.int64))
            bad[at] = True
            if stat == "nonfinite":
                np.fmax.at(values, at, total[r, j].astype(np.float64))
        return values, bad, lo, hi, names


def _rows(arr, rows: np.ndarray) -> np.ndarray:
    """``arr``'s rows ``rows``, in order: a read per run of consecutive ones."""
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    return np.concatenate([np.asarray(arr[int(r[0]): int(r[-1]) + 1]) for r in np.split(rows, cut)])
