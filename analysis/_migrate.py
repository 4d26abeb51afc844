"""Convert a Zarr store of an older format (1 or 2) to the current one:
``tensortape migrate OLD NEW``.

This side reads: every committed row of every table of ``OLD``, checked as any
read is (``Run.checked_rows``), a block at a time, in the current format's
terms (format 1 and 2's statistics packed as format 3 packs them, format 1's
tensor rows as micro-batch 0).  The recorder writes (``recorder.migrate``):
the same store code as a recording, so the layout has one writer.  ``OLD`` is
never changed, and ``NEW`` must not exist.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tensortape.recorder import format as fmt

from ._run import open_run

__all__ = ["migrate"]

BLOCK_ROWS = 1024


def migrate(old, new, progress=None, mode: str = "w-") -> str:
    """Write ``old`` (a path or URL: a store of an older format, or an HDF5
    export) to ``new`` in the current format; ``new``.  ``mode``: ``"w-"``
    refuses an existing ``new``, ``"w"`` overwrites a tensortape run there (and
    nothing else).  A Zarr store already in the current format is refused (there
    is nothing to convert)."""
    from tensortape.recorder.errors import ConfigError
    from tensortape.recorder.migrate import TableRows, write_run
    run = open_run(old)
    if run.attrs.get("tensortape_format") == fmt.FORMAT_VERSION and not _is_hdf5(run):
        raise ConfigError(f"{old!r} is already in format {fmt.FORMAT_VERSION}, the current "
                          f"one: there is nothing to migrate (copy the folder for a copy)")
    listed = [(r, p, run.checked_rows(p, r)) for r in run.ranks
              for p, n in run.state(r).committed.items() if n]
    run.index.refuse_damage("migrate")

    def tables():
        for rank, path, n in (progress(listed) if progress else listed):
            yield _table(run, path, n, TableRows)
    # the NaN/Inf counts of steps without statistics are not copied: the copy says so (its
    # map is placed from the kept events, ``format``), never that it holds them
    states = {r: dataclasses.replace(run.state(r), nonfinite=None) for r in run.ranks}
    return write_run(new, run.attrs, states, tables(), mode=mode, source=run.path)


def _is_hdf5(run) -> bool:
    from ._source import H5Source
    return isinstance(run.source, H5Source)


def _table(run, path: str, n: int, TableRows):
    """The table at ``path`` (``n`` committed rows) as the writer takes it."""
    source, tables = run.source, run.index.tables
    recorded = source.has(f"{path}/{fmt.RECORDING}")      # a resumed recording's
    extra = (fmt.RECORDING,) if recorded else ()
    table = fmt.parse_path(path)
    if table.section == "stats":
        return TableRows(path, _blocks(source, path, ("step", "hist", *extra), n, BLOCK_ROWS,
                                       lambda lo, hi: {"stats": tables.stats_block(path, lo, hi)}),
                         recorded, width=int(source.array(f"{path}/hist").shape[1]))
    if table.section == "scalars":
        return TableRows(path, _blocks(source, path, (*fmt.SCALAR_COLUMNS, *extra), n, BLOCK_ROWS),
                         recorded)
    data = source.array(f"{path}/data")
    micro = tables.micros(path, n)                        # format 1: every row's is 0
    name = source.attrs(path).get("name", table.node)
    return TableRows(path, _blocks(source, path, ("data", "step", "extent", *extra), n,
                                   max(1, int(data.chunks[0])),
                                   lambda lo, hi: {"micro": micro[lo:hi]}),
                     recorded, name=name if isinstance(name, str) else table.node,
                     logical=dict(data.attrs).get(fmt.LOGICAL_ATTR))


def _blocks(source, path: str, columns: tuple[str, ...], n: int, step: int, more=None):
    """The blocks of ``columns`` of the table at ``path``, ``step`` of its ``n`` rows at
    a time, each with ``more(lo, hi)``'s columns."""
    def blocks():
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            block = {c: np.asarray(source.array(f"{path}/{c}")[lo:hi]) for c in columns}
            yield {**block, **(more(lo, hi) if more else {})}
    return blocks
