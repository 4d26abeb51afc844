"""Per-step statistics and histograms of a run, lazy, as xarray objects; in a
run of several ranks, every rank's along a ``rank`` dimension."""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import ConfigError, LayerNotFoundError
from tensortape.recorder.histogram import bin_centers, bin_edges

from . import _damage
from ._index import RunIndex
from ._select import chosen, columns_of, layer_coord, missing, steps_text
from ._tables import as_slice

__all__ = ["Statistics", "counts"]


def counts(raw):
    """A count statistic as stored (float64, lazy) as int64: -1 where the layer did
    not run at that step (NaN in the store), never a cast of NaN."""
    return np.where(np.isnan(raw), -1, raw).astype(np.int64)


def _execution_order(names: list[str], layers: list[str]) -> list[int]:
    """Positions of ``names`` in the run's execution order (``run.layers``: first
    capture; a stats table of gradients holds its columns as backward sent them)."""
    where = {n: i for i, n in enumerate(layers)}
    return sorted(range(len(names)), key=lambda j: (where.get(names[j], len(where)), j))


class Statistics:
    """The reads of a run's stats tables (``Run.stats``, ``Run.histogram``)."""

    def __init__(self, index: RunIndex):
        self.index = index

    def rows(self, kind: str, rank: int) -> tuple[str, np.ndarray, np.ndarray]:
        """The stats table's path, its rows to read (the latest recording of each
        step, in step order) and their steps."""
        path = fmt.stats_group(rank, kind)
        current, steps = self.index.current_rows(path, rank)
        rows = current[fmt.latest_rows(steps[current])]
        return path, rows, steps[rows]

    def steps(self, kind: str, rank: int) -> np.ndarray:
        return self.rows(kind, rank)[2]

    def _across(self, rank: int | None, one, kind: str, holds=None):
        """``one(rank)`` for the rank asked, or, for a run of several ranks and no
        rank asked, every rank's (those that have ``kind``) joined along a ``rank``
        dimension: steps and layers are the union; what a rank did not record (a
        rank where ``holds(rank)`` is false: nothing asked for) is NaN, and -1 for
        counts, as where a layer did not run."""
        ix = self.index
        if rank is not None or len(ix.ranks) < 2:
            return one(rank)
        ranks = [r for r in ix.ranks if kind in ix.kinds_of(r)]
        if not ranks:
            ix.kind(kind, ix.ranks[0])
        held = [r for r in ranks if holds is None or holds(r)] or ranks[:1]
        parts = [one(r) for r in held]
        like = parts[0]
        parts = [p.drop_attrs() for p in parts]
        names = list(fmt.COUNT_STATS)
        if isinstance(like, xr.DataArray):        # a histogram: its NaN/Inf counts per rank too
            names = ["hist", *(k for k in fmt.COUNT_STATS[1:] if k in like.coords)]
            parts = [p.to_dataset(name="hist").reset_coords(names[1:]) for p in parts]
        fill = dict.fromkeys(names, -1)
        out = xr.concat(parts, dim=xr.DataArray(held, dims="rank", name="rank"), join="outer",
                        fill_value=fill, coords="minimal", compat="override")
        if held != ranks:
            out = out.reindex(rank=ranks, fill_value=fill)
        if isinstance(like, xr.DataArray):
            out = out.set_coords(names[1:])["hist"].rename(like.name)
        out.attrs.update(like.attrs)
        out.attrs.pop("rank", None)
        return out

    def stats(self, kind: str = "activations", layers=None, rank: int | None = None,
              lazy: bool = True) -> xr.Dataset:
        ix = self.index
        if rank is not None or len(ix.ranks) < 2 or layers is None:
            return self._across(rank, lambda r: self._stats(kind, layers, r, lazy=lazy), kind)
        # the layers asked for, of every rank's (each pattern selects a layer of some
        # rank); a rank is read where it holds one
        held = [r for r in ix.ranks if kind in ix.kinds_of(r)]
        layers = chosen(list(dict.fromkeys(n for r in held for n in ix.stats_layers(kind, r))),
                        layers, what="layer with statistics on any rank")
        return self._across(rank, lambda r: self._stats(kind, layers, r, strict=False, lazy=lazy),
                            kind,
                            lambda r: bool(columns_of(ix.stats_layers(kind, r), layers,
                                                      strict=False)))

    def _stats(self, kind: str, layers, rank: int | None, strict: bool = True,
               lazy: bool = True) -> xr.Dataset:
        ix = self.index
        rank = ix.rank(rank)
        ix.kind(kind, rank)
        path, rows, steps = self.rows(kind, rank)
        names = ix.stats_layers(kind, rank)
        idx = columns_of(names, layers, strict)
        data = {}
        raw = ix.tables.stats(path, fmt.STATS, rows, idx, lazy) if len(rows) else {}
        for s in fmt.STATS:
            dtype = np.int64 if s in fmt.COUNT_STATS else np.float64
            if not len(rows):                  # full tensors of this kind, no statistics yet
                data[s] = (("step", "layer"), np.zeros((0, len(idx)), dtype))
                continue
            data[s] = (("step", "layer"), counts(raw[s]) if s in fmt.COUNT_STATS
                       else raw[s].astype(dtype))
        ds = xr.Dataset(data, coords={"step": steps,
                                      "layer": layer_coord([names[i] for i in idx])})
        ds.attrs.update(kind=kind, rank=rank)
        return ds.isel(layer=_execution_order([names[i] for i in idx], ix.layers_of(rank)))

    def damaged(self, kind: str, layers, rank: int | None) -> xr.DataArray:
        """(step, layer) as ``stats`` of one rank reads them: True where the
        statistics read as missing because their chunk is missing (``_damage``)."""
        ix = self.index
        rank = ix.rank(rank)
        ix.kind(kind, rank)
        path, rows, steps = self.rows(kind, rank)
        names = ix.stats_layers(kind, rank)
        idx = columns_of(names, layers)
        mask = np.zeros((len(rows), len(idx)), bool)
        if ix.damage(path, rank):
            for j, i in enumerate(idx):
                mask[:, j] = ix.unreadable(path, rank, _damage.STATS, rows, i)
        out = xr.DataArray(mask, dims=("step", "layer"), name="damaged",
                           coords={"step": steps, "layer": layer_coord([names[i] for i in idx])})
        return out.isel(layer=_execution_order([names[i] for i in idx], ix.layers_of(rank)))

    def histogram(self, layer: str, kind: str = "activations", step=None,
                  rank: int | None = None) -> xr.DataArray:
        ix = self.index
        if rank is None and len(ix.ranks) > 1:
            held = [r for r in ix.ranks if kind in ix.kinds_of(r)]
            names = list(dict.fromkeys(n for r in held for n in ix.stats_layers(kind, r)))
            if held and layer not in names:
                raise LayerNotFoundError(missing(layer, names, f"{kind} statistics on any rank"))
        return self._across(rank, lambda r: self._histogram(layer, kind, step, r), kind,
                            lambda r: layer in ix.stats_layers(kind, r))

    def _histogram(self, layer: str, kind: str, step, rank: int | None) -> xr.DataArray:
        ix = self.index
        rank = ix.rank(rank)
        ix.kind(kind, rank)
        names = ix.stats_layers(kind, rank)
        if layer not in names:
            raise LayerNotFoundError(missing(layer, names, f"{kind} statistics"))
        i = names.index(layer)
        path, rows, steps = self.rows(kind, rank)
        lo, hi = bin_edges()
        hist = ix.tables.lazy(path + "/hist")[as_slice(rows), i]     # one indexing: one read
        # -1 where the layer did not run (no count, unless its statistics' chunk is
        # missing: then the histogram reads as stored) or the histogram's chunk is missing
        unread = ix.unreadable(path, rank, _damage.STATS, rows, i)
        absent = np.isnan(ix.tables.stat(path, "count", rows, i)) & ~unread
        absent |= ix.unreadable(path, rank, ("hist",), rows, i)
        hist = np.where(absent[:, None], -1, hist)
        out = xr.DataArray(hist, dims=("step", "bin"),
                           coords={"step": steps, "bin": bin_centers(),
                                   "bin_lo": ("bin", lo), "bin_hi": ("bin", hi)},
                           name=f"{layer} {kind}", attrs={"layer": layer, "kind": kind})
        for s in ("nan", "posinf", "neginf"):
            out.coords[s] = ("step", counts(ix.tables.stat(path, s, rows, i)))
        if step is not None:
            if step not in set(steps.tolist()):
                raise ConfigError(f"step {step} has no statistics for {layer!r}; it has "
                                  f"{steps_text(steps)}")
            out = out.sel(step=step)
        return out
