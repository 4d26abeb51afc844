"""A recorded run, opened lazily: ``open_run(path)`` reads attributes only.

``Run`` is the facade of the reader; each of its jobs is a room of its own:

- ``_index.RunIndex``: attributes, ranks, committed rows and the checks that
  make a table safe to read; it picks the reader of the run's format version
  (``_tables``);
- ``_stats.Statistics`` and ``_tensors.Tensors``: the reads;
- ``_events``: non-finite events, the first of them, the replay bundle;
- ``_accessor.RunPlotAccessor``: the pictures (``run.plot``);
- ``_display``: summary, repr and HTML; ``_hdf5``: the HDF5 export.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt
from tensortape.recorder.format import NonFiniteEvent

from . import _events
from .plots._accessor import RunPlotAccessor, UncachedAccessor
from ._display import as_html, as_text, summary
from ._events import FirstNonFinite
from ._index import RunIndex
from ._stats import Statistics
from ._tensors import Tensors

__all__ = ["open_run", "Run", "NonFiniteEvent", "FirstNonFinite"]


def open_run(path) -> "Run":
    """Open a run (Zarr store, fsspec URL, or HDF5 export) lazily; a ``Run`` is returned as is."""
    return path if isinstance(path, Run) else Run(path)


class Run:
    """A recorded run.  ``source`` is the store as read (attributes and arrays),
    ``state(rank)`` a rank's committed state; the methods below are the API."""

    MAX_ROW_BYTES = RunIndex.MAX_ROW_BYTES   # one step of one tensor: 64 GiB at the most

    plot = UncachedAccessor(RunPlotAccessor)

    def __init__(self, path):
        self._attach(RunIndex(path))

    def _attach(self, index: RunIndex) -> None:
        self._index = index
        self._statistics = Statistics(index)
        self._tensors = Tensors(index)

    # --- what is in the run -----------------------------------------------------
    @property
    def path(self) -> str:
        return self._index.path

    @property
    def source(self):
        """The store as read: its attributes and arrays."""
        return self._index.source

    @property
    def attrs(self) -> dict:
        return self._index.attrs

    @property
    def ranks(self) -> list[int]:
        return self._index.ranks

    def only(self, rank: int) -> "Run":
        """The run as ``rank`` recorded it: a view with that one rank (what the
        comparisons and the pictures read)."""
        view = Run.__new__(Run)
        view._attach(self._index.only(rank))
        return view

    @property
    def index(self) -> RunIndex:
        """The run's index (attributes, ranks, committed rows and their checks):
        public for tensortape's own readers (pictures, migrate, TensorBoard, the
        server), which read through it what ``Run``'s methods do not return."""
        return self._index

    def _rank(self, rank: int | None) -> int:
        return self._index.rank(rank)

    def state(self, rank: int | None = None) -> fmt.RankState:
        """What a rank committed: row counts per table, layers, events, counters."""
        return self._index.state(rank)

    def columns(self, path: str) -> tuple[str, ...]:
        """The arrays of the table at ``path`` as its format wrote them."""
        return self._index.tables.columns(path)

    def checked_rows(self, path: str, rank: int) -> int:
        """A table's committed rows, once its arrays are checked against them: each
        array is there, holds the committed rows, and a row has a sane size."""
        return self._index.checked_rows(path, rank)

    @property
    def status(self) -> str:
        return self.attrs.get("status", "unknown")

    @property
    def config(self) -> dict:
        return self.attrs.get("config", {})

    @property
    def metadata(self) -> dict:
        return self.attrs.get("metadata", {})

    @property
    def dropped(self) -> int:
        """Captures dropped (counted with their reasons), every rank's."""
        states = self._index.states
        if not states:
            return int(self.attrs.get("dropped", 0))
        return sum(st.dropped for st in states.values())

    def layers_of(self, rank: int | None = None) -> list[str]:
        return self._index.layers_of(rank)

    @property
    def layers(self) -> list[str]:
        return self.layers_of()

    def kinds_of(self, rank: int | None = None) -> list[str]:
        return self._index.kinds_of(rank)

    @property
    def kinds(self) -> list[str]:
        return self.kinds_of()

    def tensor_layers(self, kind: str = "activations", rank: int | None = None) -> list[str]:
        """The layers of ``kind`` that hold full tensors, in execution order."""
        return self._tensors.layers(kind, self._rank(rank))

    def steps(self, kind: str = "activations", tensors: bool = False, rank: int | None = None,
              layer: str | None = None) -> np.ndarray:
        """Steps that hold statistics (or, with ``tensors=True``, full tensors)."""
        rank = self._rank(rank)
        self._index.kind(kind, rank)
        if not tensors:
            return self._statistics.steps(kind, rank)
        return self._tensors.steps(kind, rank, layer)

    # --- statistics, histograms and full tensors ----------------------------------
    def stats(self, kind: str = "activations", layers=None, rank: int | None = None, *,
              lazy: bool = True) -> xr.Dataset:
        """Per-step statistics: an ``xr.Dataset`` with dims (step, layer), one
        variable per statistic (lazy; counts are int64).

        kind: one of ``run.kinds``.  layers: a glob pattern or list of them
        (default: every layer with statistics).  rank: one rank's; by default,
        in a run of several ranks, every rank's along a ``rank`` dimension
        (each read only when its values are).  lazy: False reads them at once,
        with numpy (no dask: cheaper where every value is wanted)."""
        return self._statistics.stats(kind, layers, rank, lazy=lazy)

    def damaged(self, kind: str = "activations", layers=None,
                rank: int | None = None) -> xr.DataArray:
        """Where the statistics of one rank (default: the first) read as missing
        because their chunk is missing from the store: a bool ``xr.DataArray``
        (step, layer) aligned with ``stats(kind, layers, rank)``.  It tells damage
        from a layer that did not run, which reads the same (NaN, counts -1)."""
        return self._statistics.damaged(kind, layers, rank)

    def histogram(self, layer: str, kind: str = "activations", step=None,
                  rank: int | None = None) -> xr.DataArray:
        """Counts in the shared bins: dims (step, bin); ``bin`` holds each bin's centre
        (what ``.plot()`` uses), ``bin_lo``/``bin_hi`` its edges; ``nan``, ``posinf``
        and ``neginf`` per step.  In a run of several ranks and no ``rank`` asked,
        every rank's along a ``rank`` dimension (-1: not recorded there).  At a step
        where the layer did not run (an expert with no tokens), every count is -1."""
        return self._statistics.histogram(layer, kind, step, rank)

    def tensor(self, layer: str, kind: str = "activations", step=None, micro: int | None = None,
               rank: int | None = None) -> xr.DataArray:
        """Full tensors: lazy (step, dim_0, ...), floats NaN-padded; the true extent of
        each step along ``dim_i`` is the integer coordinate ``extent_dim_i`` (step).

        With ``step=s``, that one step at its true shape.  Steps with several
        micro-batches hold a tensor for each: ``micro=k`` picks one (``None``: 0, the
        micro-batch every step has).
        A step recorded again (a job resumed with mode="a") gives its latest
        recording, whole: none of an older recording's micro-batches.
        """
        return self._tensors.tensor(layer, kind, step, micro, self._rank(rank))

    def micro_batches(self, layer: str, kind: str = "activations", step: int = 0,
                      rank: int | None = None) -> dict[int, np.ndarray]:
        """Every micro-batch's full tensor of one step, read at once: a dict from
        micro-batch to a numpy array at its true shape (bfloat16 and float8 decoded
        to float32); empty where the step holds no full tensor of ``layer``."""
        return self._tensors.micro_batches(layer, kind, int(step), self._rank(rank))

    # --- full tensors as a data set ---------------------------------------------------
    def rows(self, layer: str, kind: str = "activations", **options):
        """The full tensors of ``layer`` as per-token rows, numpy (no torch): an
        iterable of dicts ``x`` (the row, along the tensor's last axis), ``token``
        (where the run holds token ids: ``capture=("activations", "batch")``),
        ``step``, ``micro``, ``rank``, ``sequence`` and ``position``.  Padding is
        never a row.

        steps: None (all), a half-open slice or a list; ranks, micros: None (all), an
        int or a list.  tokens: the inputs holding token ids (``"auto"``: the root's
        ``input_ids``, or its lone integer input; None: none).  mask: the inputs
        whose zeros are left out (e.g. ``"(root):attention_mask"``).  shuffle (True),
        buffer_rows (65,536), seed (0) and ``set_epoch``: whole chunks in a drawn
        order, their rows mixed in a buffer of that many rows.  batch_size: None
        (single rows) or rows per item; drop_last.  docs/GUIDE.md, "Activations as a
        data set"."""
        from .export._dataset import Rows
        return Rows(self._index, layer, kind, **options)

    def dataset(self, layer: str, kind: str = "activations", **options):
        """``rows(layer, kind, **options)`` as a torch ``IterableDataset``
        (DataLoader-ready: with ``num_workers=N`` each worker reads its own chunks,
        every row once); ``x`` as a tensor."""
        from .export._dataset import as_torch
        return as_torch(self.rows(layer, kind, **options))

    def micro_batches_by_step(self, layer: str, kind: str = "activations", steps=(),
                              rank: int | None = None):
        """``(step, micro_batches(layer, kind, step))`` for each of ``steps`` in
        order, lazily: a block of steps read at once (at most 64 MiB of rows, or
        one step), not a chunk again for each step."""
        return self._tensors.by_step(layer, kind, [int(s) for s in steps], self._rank(rank))

    def tensor_blocks(self, layer: str, kind: str = "activations", steps=(),
                      rank: int | None = None):
        """As ``micro_batches_by_step``, a block at a time: ``(the block's steps,
        {step: {micro-batch: array}})``, the arrays views of one read (at most 64
        MiB of rows, or one step); a step without full tensors is absent."""
        return self._tensors.blocks(layer, kind, steps, self._rank(rank))

    def tensor_shape(self, layer: str, kind: str = "activations",
                     rank: int | None = None) -> tuple[int, ...]:
        """A layer's full-tensor shape past the step (the largest recorded), read
        from the store's metadata (``tensor(layer, kind).shape[1:]``)."""
        return self._tensors.shape(layer, kind, self._rank(rank))

    # --- non-finite values -----------------------------------------------------------
    def events_of(self, rank: int | None = None) -> list[NonFiniteEvent]:
        """One rank's events, or with ``rank=None`` every rank's, ordered by step, then
        forward before backward, then execution order (then rank)."""
        return _events.events_of(self._index, rank)

    @property
    def events(self) -> list[NonFiniteEvent]:
        """Every rank's events (each names its ``rank``), in order."""
        return self.events_of()

    def first_nonfinite(self, rank: int | None = None, history: int = 5) -> FirstNonFinite | None:
        """The earliest non-finite capture across every rank (or of ``rank``): by
        step, then forward before backward, then execution order; it names its
        rank, and ``same_step`` holds the other events of that step."""
        return _events.first_nonfinite(self._index, self._statistics.stats, rank, history)

    def scalars(self, rank: int | None = None) -> xr.Dataset:
        """The run's logged scalars (``rec.log``: loss, learning rate, ...): an
        ``xr.Dataset`` over ``step`` (and ``rank`` in a run of several, unless one
        is asked), one float64 variable per name, NaN where a name has no value;
        empty for a run without scalars."""
        from ._scalars import scalars
        return scalars(self._index, rank)

    def replay(self, model, rank: int | None = None) -> dict:
        """Repeat the recorded replay (``on_nonfinite="replay"``) in ``model``, a
        model the user builds (the same architecture): its submodule at the
        bundle's path gets the recorded parameters and buffers, and the call runs
        again on the recorded inputs (and output gradients, for a NaN made in
        backward) under the same op check.  What it found, as the event's
        ``replay``.  Step through ``model`` in a debugger to see it happen.
        (The torch side: ``recorder.replay.replay_bundle``.)"""
        attrs, read = _events.bundle(self._index, rank)
        from tensortape.recorder.replay import replay_bundle
        return replay_bundle(attrs, read, model)

    # --- plots (``run.plot``) and export ----------------------------------------------
    def plot_histogram(self, layer, kind="activations", steps=None, rank=None, ax=None,
                       density: bool = True, scale: str = "linear"):
        """``run.plot.histogram``: histogram of ``layer`` at some steps -> Figure."""
        return self.plot.histogram(layer, kind, steps, rank, ax, density=density, scale=scale)

    def plot_evolution(self, layers=None, kind="activations", stat="std", rank=None, ax=None,
                       steps: slice | None = None):
        """``run.plot.evolution``: one statistic over the steps -> Figure."""
        return self.plot.evolution(layers, kind, stat, rank, ax, steps=steps)

    def plot_distribution(self, layer, kind="activations", rank=None, ax=None,
                          steps: slice | None = None):
        """``run.plot.distribution``: step x value picture of a histogram -> Figure."""
        return self.plot.distribution(layer, kind, rank, ax, steps=steps)

    @property
    def name(self) -> str:
        """The run's short name: the last part of its path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1] or self.path

    def to_hdf5(self, path, progress=None) -> str:
        from .export._hdf5 import to_hdf5
        return to_hdf5(self, path, progress=progress)

    def disk_bytes(self) -> int:
        """The store's size where it lies (a local path or any fsspec URL)."""
        import fsspec
        fs, root = fsspec.core.url_to_fs(self.path)
        return int(fs.du(root, total=True)) if fs.isdir(root) else int(fs.size(root))

    # --- display -------------------------------------------------------------------
    def summary(self, rank: int | None = None) -> dict:
        """What the run holds, as plain JSON-able values (``tensortape info``): the
        layers and steps of ``rank`` (default: the first), and, with no rank
        asked, the events and counters of every rank, with a line per rank."""
        return summary(self._index, self._statistics, self._tensors, rank)

    def __repr__(self) -> str:
        return as_text(self.summary())

    def _repr_html_(self) -> str:
        return as_html(self.summary())
