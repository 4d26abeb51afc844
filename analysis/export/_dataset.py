"""Recorded full tensors as a data set of per-token rows (``run.rows``,
``run.dataset``): what a sparse autoencoder or a probe trains on.

A full tensor of shape ``(..., d)`` (``(batch, sequence, d_model)``, say) is
``prod(...)`` rows of ``d`` values, each with the step, micro-batch and rank it
was recorded at, its ``sequence`` (the flat index over the axes before the
last two) and ``position`` (along the axis before the last), and, where the
run holds the recorded root's token ids (``capture=("activations", "batch")``),
its ``token``.  Only a tensor's true extent is read out: padding is never a row.

**Reads.**  The unit of work is one chunk of the layer's table (a few steps'
tensors, about 8 MB), read whole; the token ids and mask of its steps are read
beside it.  ``shuffle=True`` visits the chunks in an order drawn from
``(seed, epoch)`` and mixes their rows in a buffer of ``buffer_rows`` rows: the
memory held is that buffer and one chunk, whatever the run's size.  Workers
(``iterate(worker, workers)``; a DataLoader's, in ``run.dataset``) take every
``workers``-th chunk of that order: each row once, in one worker.

Numpy only: ``run.dataset`` wraps this in a torch ``IterableDataset`` (torch is
imported there, by the call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from tensortape.recorder import format as fmt
from tensortape.recorder.dtypes import decode_bits
from tensortape.recorder.errors import ConfigError

from .._index import RunIndex
from .._tensors import Tensors

__all__ = ["Rows", "TOKENS"]

TOKENS = ("(root):input_ids", "(root)", "(root):0")   # tokens="auto": the first held, integer
META = ("token", "step", "micro", "rank", "sequence", "position")


@dataclasses.dataclass
class _Part:
    """One rank's side of the data set: the layer's table and, row by row (the
    rows read, ordered), its step, micro-batch and extent, and the rows of the
    token ids and mask that go with it (-1: none)."""

    rank: int
    path: str                       # the layer's table
    data: object                    # the table's ``data`` array (read a chunk at a time)
    logical: str | None
    rows: np.ndarray
    steps: np.ndarray
    micros: np.ndarray
    extent: np.ndarray              # (rows, ndim)
    tokens: object | None = None    # the token ids' ``data`` array
    token_rows: np.ndarray | None = None
    mask: object | None = None
    mask_rows: np.ndarray | None = None
    beside: dict = dataclasses.field(default_factory=dict)     # role -> the tokens' or mask's table


def _token_ids(index, tensors, rank: int) -> str | None:
    """The name of ``rank``'s token ids (``TOKENS``' first held, of integers), or None."""
    held = tensors.paths("inputs", rank) if "inputs" in index.kinds_of(rank) else {}
    return next((t for t in TOKENS if t in held and np.dtype(
        index.source.array(held[t] + "/data").dtype).kind in "iub"), None)


class Rows:
    """Per-token rows of one layer's full tensors, as numpy (see the module).

    Iterating gives dicts: ``x`` (``(d,)``, or ``(batch_size, d)`` with
    ``batch_size``), and ``token`` (where the run has token ids), ``step``,
    ``micro``, ``rank``, ``sequence`` and ``position``.  ``unmatched`` lists the
    ``(rank, step, micro)`` whose tensors have no token ids (or mask) beside them:
    left out."""

    def __init__(self, index: RunIndex, layer: str, kind: str = "activations", *, steps=None,
                 ranks=None, micros=None, tokens="auto", mask=None, shuffle: bool = True,
                 buffer_rows: int = 1 << 16, seed: int = 0, batch_size: int | None = None,
                 drop_last: bool = False):
        for name, value, low in (("buffer_rows", buffer_rows, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ConfigError(f"{name}={value!r} is not valid; use an integer >= {low}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
                batch_size, (int, np.integer)) or batch_size < 1):
            raise ConfigError(f"batch_size={batch_size!r} is not valid; use None (single "
                              f"rows) or an integer >= 1")
        self.layer, self.kind = layer, kind
        self.shuffle, self.buffer_rows, self.seed = bool(shuffle), int(buffer_rows), int(seed)
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        self.epoch = 0
        self.unmatched: list[tuple[int, int, int]] = []
        chosen = index.ranks if ranks is None else [index.rank(r) for r in np.atleast_1d(ranks)]
        tensors = Tensors(index)
        self._index = index
        named = {r: tokens for r in chosen}
        if tokens == "auto":              # token ids where every rank chosen holds them
            named = {r: _token_ids(index, tensors, r) for r in chosen}
            if None in named.values():
                named = dict.fromkeys(chosen)
        self.parts = [self._part(index, tensors, r, steps, micros, named[r], mask) for r in chosen]
        widths = {int(w) for p in self.parts for w in np.unique(p.extent[:, -1])}
        if len(widths) > 1:
            raise ConfigError(f"{layer!r} ({kind}) changes its last axis across steps; a "
                              f"row is one vector of its last axis, which must keep its size")
        # the chunks: (part, first row, end row, positions of its rows in the part)
        self.chunks = []
        for i, p in enumerate(self.parts):
            size = p.data.chunks[0]
            block = p.rows // size
            for b in np.unique(block):
                at = np.nonzero(block == b)[0]
                self.chunks.append((i, int(b) * size, int(b + 1) * size, at))

    def _part(self, index, tensors, rank, steps, micros, tokens, mask) -> _Part:
        kind = index.kind(self.kind, rank)
        path = tensors.path(self.layer, kind, rank)
        rows, st, mi, ext = tensors.rows(path, rank)
        keep = _chosen(st, steps) & _chosen(mi, micros)
        data = index.source.array(path + "/data")
        if data.ndim < 3:
            raise ConfigError(f"{self.layer!r} ({kind}) holds 1-D tensors; a row is a vector "
                              f"along a tensor's last axis, so it needs two axes or more")
        part = _Part(rank, path, data, dict(data.attrs).get(fmt.LOGICAL_ATTR), rows[keep], st[keep],
                     mi[keep], ext[keep][:, : data.ndim - 1])
        for name, role in ((tokens, "tokens"), (mask, "mask")):
            if name is not None:
                self._beside(index, tensors, part, name, role)
        return part

    def _beside(self, index, tensors, part: _Part, layer: str, role: str) -> None:
        """The rows of ``layer`` (kind inputs: token ids or a mask) at each of the
        part's (step, micro-batch); those the part has no match for go."""
        rank = part.rank
        path = tensors.path(layer, index.kind("inputs", rank), rank)
        rows, st, mi, ext = tensors.rows(path, rank)
        data = index.source.array(path + "/data")
        key = {(int(s), int(m)): i for i, (s, m) in enumerate(zip(st, mi))}
        at = np.array([key.get((int(s), int(m)), -1) for s, m in zip(part.steps, part.micros)],
                      dtype=np.int64)
        lost = at < 0
        self.unmatched += [(rank, int(s), int(m)) for s, m in zip(part.steps[lost], part.micros[lost])]
        for f in ("rows", "steps", "micros", "extent", "token_rows", "mask_rows"):
            v = getattr(part, f)
            if v is not None:
                setattr(part, f, v[~lost])
        at = at[~lost]
        lead = part.extent[:, :-1]
        fix = f"pass {role}= the inputs recorded with {self.layer!r}, or {role}=None"
        if data.ndim - 1 != lead.shape[1]:
            raise ConfigError(f"{role} {layer!r} has {data.ndim - 1} axes, not the {lead.shape[1]} "
                              f"leading axes of {self.layer!r}; {fix}")
        differ = np.nonzero((ext[at][:, : lead.shape[1]] != lead).any(axis=1))[0]
        if len(differ):
            i = int(differ[0])
            raise ConfigError(f"{role} {layer!r} at step {int(part.steps[i])} has shape "
                              f"{tuple(map(int, ext[at[i]][: lead.shape[1]]))}, not the leading "
                              f"axes {tuple(map(int, lead[i]))} of {self.layer!r}; {fix}")
        part.beside[role] = path
        if role == "tokens":
            part.tokens, part.token_rows = data, rows[at]
        else:
            part.mask, part.mask_rows = data, rows[at]

    # --- what it holds ---------------------------------------------------------------
    def __len__(self) -> int:
        """Rows before any mask: the tokens of every tensor chosen."""
        return int(sum(np.prod(p.extent[:, :-1], axis=1).sum() for p in self.parts))

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration draws (with ``seed``)."""
        self.epoch = int(epoch)

    def order(self, worker: int = 0, workers: int = 1) -> list[int]:
        """The chunks ``worker`` of ``workers`` reads, in its order."""
        n = len(self.chunks)
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(n)
                 if self.shuffle else np.arange(n))
        return [int(c) for c in order[worker::workers]]

    # --- reads -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        return self.iterate()

    def iterate(self, worker: int = 0, workers: int = 1) -> Iterator[dict]:
        """The rows of ``worker``'s chunks (of ``workers``), shuffled or in order."""
        blocks = (b for b in (self.read(c) for c in self.order(worker, workers)) if b)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, worker, 1])
            blocks = _mixed(blocks, max(1, min(self.buffer_rows, len(self))), rng)
        if self.batch_size is None:
            return _single(blocks)
        return _batched(blocks, self.batch_size, self.drop_last)

    def read(self, chunk: int) -> dict[str, np.ndarray]:
        """One chunk's rows, in order: ``x`` (rows, d) and their ``META`` columns."""
        i, lo, hi, at = self.chunks[chunk]
        p = self.parts[i]
        block = np.asarray(p.data[lo:min(hi, int(p.rows[at].max()) + 1)])
        if p.logical in fmt.BITS_DTYPES:
            block = decode_bits(block, p.logical)
        tokens = _rows_of(p.tokens, p.token_rows, at)
        mask = _rows_of(p.mask, p.mask_rows, at)
        bad = self._lost(p, at)           # rows whose chunk was found undecodable as read
        if bad.any():
            at = at[~bad]
            tokens, mask = ((b[0][~bad], b[1]) if b is not None else None for b in (tokens, mask))
            if not len(at):
                return {}
        if tokens is None and mask is None and _whole(p, at, block):
            return self._whole_rows(p, at, lo, block)
        parts: dict[str, list] = {k: [] for k in ("x", *META)}
        for j, k in enumerate(at):
            ext = p.extent[k]
            lead = tuple(int(e) for e in ext[:-1])
            n = int(np.prod(lead))
            x = block[(int(p.rows[k]) - lo, *(slice(0, int(e)) for e in ext))].reshape(n, -1)
            flat = np.arange(n)
            cols = {"x": x, "step": np.full(n, p.steps[k]), "micro": np.full(n, p.micros[k]),
                    "rank": np.full(n, p.rank), "sequence": flat // lead[-1],
                    "position": flat % lead[-1]}
            if tokens is not None:
                cols["token"] = tokens[1][(tokens[0][j], *(slice(0, e) for e in lead))].reshape(n)
            if mask is not None:
                keep = mask[1][(mask[0][j], *(slice(0, e) for e in lead))].reshape(n) != 0
                cols = {c: v[keep] for c, v in cols.items()}
            for c, v in cols.items():
                parts[c].append(v)
        return {c: (np.concatenate(v).astype(np.int64, copy=False) if c != "x"
                    else np.concatenate(v)) for c, v in parts.items() if v}

    def _lost(self, p: _Part, at: np.ndarray) -> np.ndarray:
        """Which of a chunk's rows damage keeps from being read: their own, their token
        ids' or their mask's chunk missing or undecodable (as the run's index knows it;
        unpickled in another process, where the index does not travel, such a chunk
        raises ``StoreFormatError`` instead)."""
        ix = self.__dict__.get("_index")
        bad = np.zeros(len(at), bool)
        if ix is None:
            return bad
        bad |= ix.lost(p.path, p.rank)[p.rows[at]]
        for role, rows in (("tokens", p.token_rows), ("mask", p.mask_rows)):
            if role in p.beside:
                bad |= ix.lost(p.beside[role], p.rank)[rows[at]]
        return bad

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_index"}

    def _whole_rows(self, p: _Part, at, lo: int, block) -> dict[str, np.ndarray]:
        """``read`` of a chunk whose rows are whole and consecutive (``_whole``)."""
        first = int(p.rows[at[0]]) - lo
        x = block[first:first + len(at)]
        lead = x.shape[1:-1]
        per, n = int(np.prod(lead)), len(at) * int(np.prod(lead))
        flat = np.arange(per)
        return {"x": x.reshape(n, x.shape[-1]), "step": np.repeat(p.steps[at], per),
                "micro": np.repeat(p.micros[at], per), "rank": np.full(n, p.rank, np.int64),
                "sequence": np.tile(flat // lead[-1], len(at)),
                "position": np.tile(flat % lead[-1], len(at))}


def _whole(p: _Part, at: np.ndarray, block: np.ndarray) -> bool:
    """Whether a chunk's rows ``at`` are consecutive and each at the table's full
    shape (no padding): then its rows are a view of the block read."""
    rows = p.rows[at]
    return bool((np.diff(rows) == 1).all() and (p.extent[at] == block.shape[1:]).all())


def _chosen(values: np.ndarray, which) -> np.ndarray:
    """Which of ``values`` ``which`` picks: None (all), a half-open slice, an int
    or a list of them."""
    if which is None:
        return np.ones(len(values), bool)
    if isinstance(which, slice):
        if which.step not in (None, 1):
            raise ConfigError(f"steps={which!r} is not valid; use a slice without a step, "
                              f"or a list of steps")
        lo = -np.inf if which.start is None else which.start
        hi = np.inf if which.stop is None else which.stop
        return (values >= lo) & (values < hi)
    return np.isin(values, np.atleast_1d(np.asarray(which, dtype=np.int64)))


def _rows_of(data, rows, at):
    """The rows of a beside table (token ids, mask) that one chunk needs, read at
    once: (row of each, read block), or None."""
    if data is None:
        return None
    want = rows[at]
    lo = int(want.min())
    return want - lo, np.asarray(data[lo:int(want.max()) + 1])


def _mixed(blocks, size: int, rng) -> Iterator[dict]:
    """Blocks of rows mixed in a buffer of ``size`` rows: each row that comes in
    takes a random place, and the row there goes out (a block larger than the
    buffer is mixed with it whole); what is left is given out mixed at the end."""
    buffer: dict | None = None
    filled = 0
    for b in blocks:
        n = len(b["x"])
        if not n:
            continue
        if buffer is None:
            buffer = {c: np.empty((size, *v.shape[1:]), v.dtype) for c, v in b.items()}
        free = min(size - filled, n)
        if free:                                    # the buffer fills first
            for c, v in b.items():
                buffer[c][filled:filled + free] = v[:free]
            filled += free
            b = {c: v[free:] for c, v in b.items()}
            n -= free
        if not n:
            continue
        if n <= size:
            slots = rng.choice(size, n, replace=False)
            out = {c: buffer[c][slots] for c in buffer}
            for c in buffer:
                buffer[c][slots] = b[c]
        else:
            pool = {c: np.concatenate([buffer[c], b[c]]) for c in buffer}
            perm = rng.permutation(size + n)
            out = {c: v[perm[:n]] for c, v in pool.items()}
            for c in buffer:
                buffer[c][:] = pool[c][perm[n:]]
        yield out
    perm = rng.permutation(filled)          # given out in pieces of 8 MB, never copied whole
    piece = max(1, (8 << 20) // max(1, sum(v[0].nbytes for v in (buffer or {}).values())))
    for i in range(0, filled, piece):
        yield {c: v[perm[i:i + piece]] for c, v in buffer.items()}


def _single(blocks) -> Iterator[dict]:
    for b in blocks:
        keys = list(b)
        for i in range(len(b["x"])):
            yield {c: (b[c][i] if c == "x" else int(b[c][i])) for c in keys}


def _batched(blocks, size: int, drop_last: bool) -> Iterator[dict]:
    """Blocks cut into batches of ``size`` rows (the last shorter, or dropped); a
    batch inside one block is a view of it, one across blocks is joined."""
    held: list[dict] = []
    n = 0
    for b in blocks:
        start, rows = 0, len(b["x"])
        if held and n + rows >= size:               # complete the batch begun before
            start = size - n
            yield {c: np.concatenate([*(h[c] for h in held), b[c][:start]]) for c in b}
            held, n = [], 0
        while start + size <= rows and not held:
            yield {c: v[start:start + size] for c, v in b.items()}
            start += size
        if start < rows:
            held.append({c: v[start:] for c, v in b.items()})
            n += rows - start
    if n and not drop_last:
        yield {c: np.concatenate([h[c] for h in held]) for c in held[0]}

_TORCH: dict = {}


def as_torch(rows: Rows):
    """``rows`` as a torch ``IterableDataset`` (torch imported here, by the call):
    a DataLoader's workers each read their own chunks (``Rows.iterate``); its
    items are ``Rows``' with ``x`` (and, batched, every column) as tensors."""
    cls = _TORCH.get("cls")
    if cls is None:
        import torch

        class RowDataset(torch.utils.data.IterableDataset):
            """Recorded rows as a torch ``IterableDataset`` (``run.dataset``)."""

            def __init__(self, rows: Rows):
                super().__init__()
                self.rows = rows

            def __len__(self) -> int:
                return len(self.rows)

            def set_epoch(self, epoch: int) -> None:
                self.rows.set_epoch(epoch)

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                it = (self.rows.iterate() if info is None
                      else self.rows.iterate(info.id, info.num_workers))
                for item in it:
                    yield {c: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                           for c, v in item.items()}

            def __reduce__(self):
                return as_torch, (self.rows,)

        cls = _TORCH["cls"] = RowDataset
    return cls(rows)
