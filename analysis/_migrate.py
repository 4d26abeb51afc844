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
    return write_run(new, run.attrs, {r: run.state(r) for r in run.ranks}, tables(), mode=mode,
                     source=run.path)


def _is_hdf5(run) -> bool:
    from ._source import H5Source
    return isinstance(run.source, H5Source)


def _table(run, path: str, n: int, TableRows):
    """The table at ``path`` (``n`` committed rows) as the writer takes it."""
    source, tables = run.source, run.index.tables
    recorded = source.has(f"{path}/{fmt.RECORDING}")      # a resumed recording's
    table = fmt.parse_path(path)
    if table.section == "stats":
        names = ("step", "hist", *((fmt.RECORDING,) if recorded else ()))

        def blocks():
            for lo in range(0, n, BLOCK_ROWS):
                hi = min(lo + BLOCK_ROWS, n)
                block = {c: np.asarray(source.array(f"{path}/{c}")[lo:hi]) for c in names}
                yield {**block, "stats": tables.stats_block(path, lo, hi)}
        return TableRows(path, blocks, recorded, width=int(source.array(f"{path}/hist").shape[1]))
    data = source.array(f"{path}/data")
    names = ("data", "step", "extent", *((fmt.RECORDING,) if recorded else ()))
    step = max(1, int(data.chunks[0]))

    def blocks():
        micros = tables.micros(path, n)                   # format 1: every row's is 0
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            block = {c: np.asarray(source.array(f"{path}/{c}")[lo:hi]) for c in names}
            yield {**block, "micro": micros[lo:hi]}
    name = source.attrs(path).get("name", table.node)
    return TableRows(path, blocks, recorded, name=name if isinstance(name, str) else table.node,
                     logical=dict(data.attrs).get(fmt.LOGICAL_ATTR))
