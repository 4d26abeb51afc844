"""Full tensors of a run: which layers hold them, at which steps, and the
tensors themselves as lazy, NaN-padded xarray objects with their true extents."""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt
from tensortape.recorder.dtypes import decode_bits
from tensortape.recorder.errors import ConfigError, LayerNotFoundError

from ._index import RunIndex
from ._select import missing
from ._tables import as_slice

__all__ = ["Tensors"]


def _where(layer: str, kind: str, step, micro: int) -> str:
    """One wording for a full tensor asked for: layer (kind), step, micro-batch."""
    at = [f"step {step}"] if step is not None else []
    at += [f"micro-batch {micro}"] if micro or step is None else []
    return f"{layer!r} ({kind}) at {', '.join(at)}"


class Tensors:
    """The reads of a run's tensor tables (``Run.tensor``, ``Run.tensor_layers``,
    ``Run.steps(tensors=True)``)."""

    BLOCK = 64 << 20           # bytes of full tensors a block read holds (``blocks``)

    def __init__(self, index: RunIndex):
        self.index = index
        self._read: dict = {}

    def paths(self, kind: str, rank: int) -> dict[str, str]:
        """Layer name -> table path of the full tensors of one kind (not those whose
        every row is of steps that a later recording recorded again, or that a
        missing chunk makes unreadable).  Read once."""
        got = self._read.get((rank, kind))
        if got is None:
            got = self._read[(rank, kind)] = self._paths(kind, rank)
        return got

    def _paths(self, kind: str, rank: int) -> dict[str, str]:
        ix = self.index
        out = {}
        again = bool(ix.states[rank].rerecorded)
        tables = {p: t for p, n in ix.committed(rank).items() if n
                  for t in [fmt.parse_path(p)] if t.section == "tensors" and t.kind == kind}
        with ix.source.opened([*tables, *(f"{p}/{c}" for p in tables for c in ix.tables.columns(p))]):
            for p, t in tables.items():
                if (again or ix.damage(p, rank)) and not len(ix.current_rows(p, rank)[0]):
                    continue
                name = ix.source.attrs(p).get("name", t.node)
                out[name if isinstance(name, str) else t.node] = p
                self._data(p)
        return out

    def layers(self, kind: str, rank: int) -> list[str]:
        """The layers of ``kind`` that hold full tensors, in execution order."""
        if kind not in self.index.kinds_of(rank):
            return []
        found = self.paths(kind, rank)
        order = {n: i for i, n in enumerate(self.index.layers_of(rank))}
        return sorted(found, key=lambda n: order.get(n, len(order)))

    def path(self, layer: str, kind: str, rank: int) -> str:
        paths = self.paths(self.index.kind(kind, rank), rank)
        if layer not in paths:
            raise LayerNotFoundError(missing(layer, list(paths), f"full {kind} tensors"))
        return paths[layer]

    def steps(self, kind: str, rank: int, layer: str | None = None) -> np.ndarray:
        """Steps that hold full tensors (of ``layer``, or of any layer)."""
        paths = [self.path(layer, kind, rank)] if layer else self.paths(kind, rank).values()
        found = [steps[rows] for rows, steps in (self.index.current_rows(p, rank) for p in paths)]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)

    def _data(self, path: str):
        """A table's ``data`` array (its metadata read once: the index is one snapshot)."""
        got = self._read.get(path)
        if got is None:
            got = self._read[path] = self.index.source.array(path + "/data")
        return got

    def nbytes(self, path: str, rank: int) -> int:
        """Bytes of one table's full tensors as decoded (committed rows, padded shape)."""
        data = self._data(path)
        return self.index.committed(rank)[path] * int(np.prod(data.shape[1:])) * data.dtype.itemsize

    def rows(self, path: str, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows a reader reads of a tensor table (the latest recording's), ordered
        by (step, micro-batch), with their steps, micro-batches and extents."""
        return self._rows(path, rank)

    def _rows(self, path: str, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows a reader reads of a tensor table, ordered by (step, micro-batch):
        of each, the latest recording's (``RunIndex.current_rows``); and their
        steps, micro-batches and extents.  Read once."""
        got = self._read.get((rank, path))
        if got is None:
            ix = self.index
            n = ix.checked_rows(path, rank)
            current, steps = ix.current_rows(path, rank)
            keys = ix.keys(path, rank)        # read by the table's check
            micros = keys.get("micro", np.zeros(n, np.int64))    # format 1: every row's is 0
            rows = current[fmt.latest_rows(np.stack([steps[current], micros[current]], axis=1))]
            extent = keys["extent"][rows].astype(np.int64)
            got = self._read[(rank, path)] = rows, steps[rows], micros[rows], extent
        return got

    def tensor(self, layer: str, kind: str, step, micro: int | None, rank: int) -> xr.DataArray:
        ix = self.index
        path = self.path(layer, kind, rank)
        n = ix.checked_rows(path, rank)
        rows, steps, micros, extent = self._rows(path, rank)
        m = 0 if micro is None else int(micro)
        mine = micros == m
        if not mine.any():
            have = ", ".join(map(str, sorted(set(micros.tolist()))))
            raise ConfigError(f"{_where(layer, kind, None, m)} has no full tensor: its micro-batches "
                              f"(the forward passes of a step, from 0) are {have}")
        rows, steps, extent = rows[mine], steps[mine], extent[mine]
        data = ix.tables.lazy(path + "/data")[:n][as_slice(rows)]
        logical = dict(self._data(path).attrs).get(fmt.LOGICAL_ATTR)
        if logical in fmt.BITS_DTYPES:
            data = data.map_blocks(decode_bits, logical, dtype=np.float32)
        dims = ("step", *(f"dim_{i}" for i in range(data.ndim - 1)))
        extent = extent[:, : data.ndim - 1]
        coords = {"step": steps, **{f"extent_{d}": ("step", extent[:, j])
                                    for j, d in enumerate(dims[1:])}}
        out = xr.DataArray(data, dims=dims, coords=coords, name=f"{layer} {kind}",
                           attrs={"layer": layer, "kind": kind, "micro": m})
        if step is None:
            return out
        hits = np.nonzero(steps == step)[0]
        if not hits.size:
            raise ConfigError(f"{_where(layer, kind, step, m)} has no full tensor"
                              f"{self._why(path, rank, step)}; "
                              f"{'it has' if not m else f'micro-batch {m} has'} full tensors at "
                              f"step{'s' * (len(steps) > 1)} {', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}")
        row = out.isel(step=int(hits[0]))
        got = row.isel({d: slice(0, int(e)) for d, e in zip(dims[1:], extent[hits[0]])}).compute()
        if ix.lost(path, rank)[rows[hits[0]]]:    # its chunk found undecodable as it was read
            raise ConfigError(f"{_where(layer, kind, step, m)} has no full tensor"
                              f"{self._why(path, rank, step)}")
        return got

    def shape(self, layer: str, kind: str, rank: int) -> tuple[int, ...]:
        """A layer's full-tensor shape past the step: the largest recorded."""
        return tuple(int(x) for x in self._data(self.path(layer, kind, rank)).shape[1:])

    def micro_batches(self, layer: str, kind: str, step: int, rank: int) -> dict[int, np.ndarray]:
        """Every micro-batch's full tensor of one step: micro-batch -> numpy array at
        its true shape (bfloat16 and float8 decoded to float32), read directly (no
        task graph); empty where the step has none."""
        return next(self.by_step(layer, kind, [step], rank))[1]

    def by_step(self, layer: str, kind: str, steps, rank: int):
        """``(step, micro_batches(...))`` for each of ``steps`` in order, read a block
        of steps at a time (``blocks``)."""
        for asked, held in self.blocks(layer, kind, steps, rank):
            for step in asked:
                yield int(step), {m: x.copy() for m, x in held.get(int(step), {}).items()}

    def blocks(self, layer: str, kind: str, steps, rank: int):
        """The full tensors of ``layer`` at ``steps`` (in order), a block of whole
        steps at a time: ``(the block's steps, {step: {micro-batch: array at its
        true shape}})``, each block's rows read in one call and at most ``BLOCK``
        bytes (one step, where it is larger); bfloat16 and float8 decoded, the rows
        that damage keeps from being read left out.  The arrays are views of the
        block."""
        ix = self.index
        path = self.path(layer, kind, rank)
        rows, have, micros, extent = self._rows(path, rank)
        data = self._data(path)
        logical = dict(data.attrs).get(fmt.LOGICAL_ATTR)
        steps = np.asarray(steps, np.int64).reshape(-1)
        lo, hi = np.searchsorted(have, steps, "left"), np.searchsorted(have, steps, "right")
        per_row = max(1, int(np.prod(data.shape[1:])) * data.dtype.itemsize)
        start = 0
        while start < len(steps):
            end, held = start + 1, hi[start] - lo[start]
            while end < len(steps) and (held + hi[end] - lo[end]) * per_row <= self.BLOCK:
                held += hi[end] - lo[end]
                end += 1
            at = np.concatenate([np.arange(lo[k], hi[k]) for k in range(start, end)])
            got = np.asarray(data[as_slice(rows[at])]) if len(at) else None
            if logical in fmt.BITS_DTYPES and got is not None:
                got = decode_bits(got, logical)
            lost = ix.lost(path, rank)        # a chunk found undecodable as it was read
            out: dict = {}
            for i, k in enumerate(at):
                if not lost[rows[k]]:
                    out.setdefault(int(have[k]), {})[int(micros[k])] = got[
                        (i, *(slice(0, int(e)) for e in extent[k, : data.ndim - 1]))]
            yield steps[start:end], out
            start = end

    def _why(self, path: str, rank: int, step) -> str:
        """Why a step has no full tensor, where damage is the reason."""
        if step in set(self.index.lost_steps(path, rank).tolist()):
            return (" (its chunk is missing or cannot be read: the store is damaged there; "
                    "see `tensortape info`)")
        return ""
