"""Export a run to TensorBoard event files (``tensortape export RUN DIR --format
tensorboard``), for those who look at runs in TensorBoard.

Written with TensorBoard's own event writer and protos (``tensorboard``, no
torch, no TensorFlow), one folder of event files per rank (``DIR`` itself for a
run of one rank, else ``DIR/rank<R>``):

- ``<kind>/<layer>``: a histogram per step over the store's true bins, only the
  range of bins that hold values, after a first empty bucket (``_limits``); ``min``,
  ``max``, ``num`` (finite values), ``sum`` and ``sum_squares`` from the step's
  statistics;
- ``<kind>/<layer>/<stat>``: each statistic as a scalar, the NaN, +Inf and
  -Inf counts among them (TensorBoard's histograms have no place for them);
- ``scalars/<name>``: the run's logged scalars (``run.scalars()``).

A tag is UTF-8, so a lone surrogate in a name (a valid layer name in Python) is
written as its escape, ``\\udfff`` (``_tag``).  TensorBoard keeps scalars as
float32.  A step where a layer did not run is left out.  Memory stays bounded: a
layer's histograms are read a block of steps at a time.
"""

from __future__ import annotations

import os
import time

import numpy as np

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import ConfigError

from .._scalars import logged
from .._select import Names, one_layer

__all__ = ["to_tensorboard"]

BLOCK_STEPS = 1024
EVENTS = "events.out.tfevents."


def existing_events(folder: str) -> list[str]:
    """The TensorBoard event files in ``folder`` and its rank folders."""
    found = []
    for base, dirs, files in os.walk(folder):
        found += [os.path.join(base, f) for f in files if f.startswith(EVENTS)]
        if base != folder:
            dirs[:] = []
    return found


def to_tensorboard(run, folder, progress=None) -> str:
    """Write ``run``'s histograms, statistics and scalars as event files in
    ``folder`` (see the module); returns ``folder``."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise ConfigError("the TensorBoard export writes with the tensorboard package, which is "
                          "not installed: pip install tensorboard (or 'tensortape[tensorboard]')"
                          ) from None
    folder = os.fspath(folder)
    protos = (Event, Summary, HistogramProto)
    work = [(r, kind, layer) for r in run.ranks for kind in run.kinds_of(r)
            for layer in run.state(r).stats_layers.get(kind, [])]
    writers = {r: EventFileWriter(folder if len(run.ranks) == 1 else
                                  os.path.join(folder, fmt.rank_group(r)), max_queue_size=1000)
               for r in run.ranks}
    try:
        for r, w in writers.items():
            _scalars(w, logged(run.index, r), protos)
        for r, kind, layer in (progress(work) if progress else work):
            _layer(writers[r], run.only(r), kind, layer, protos)
    finally:
        for w in writers.values():
            w.close()
    return folder


def _tag(*parts: str) -> str:
    """``parts`` joined by ``/``: a TensorBoard tag, a lone surrogate as its escape."""
    return "/".join(parts).encode("utf-8", "backslashreplace").decode("utf-8")


def _scalars(writer, per_name: dict, protos) -> None:
    """A rank's logged scalars (a NaN logged included), an event per step."""
    Event, Summary, _ = protos
    by_step: dict[int, list] = {}
    for name, (steps, values) in per_name.items():
        for s, v in zip(steps.tolist(), values.tolist()):
            by_step.setdefault(s, []).append(Summary.Value(tag=_tag("scalars", name),
                                                           simple_value=v))
    for step in sorted(by_step):
        writer.add_event(Event(wall_time=time.time(), step=int(step),
                               summary=Summary(value=by_step[step])))


def _limits(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The bucket limits of bins with edges ``lo``, ``hi``: the lower limit of the
    first, then each bin's upper limit, strictly increasing.

    A TensorBoard bucket holds the values from the previous limit up to, not
    including, its own.  A positive bin [lo, hi) has ``hi``; a bin that holds its
    upper edge (a negative one, (lo, hi], and the zero bin, [0, 0]) has the
    next double above it, so each value lies in the bucket of its bin."""
    closed = (hi < 0) | (lo == hi)
    right = np.where(closed, np.nextafter(hi, np.inf), hi) + 0.0        # -0.0 as 0.0
    return np.concatenate([[np.nextafter(lo[0], np.inf) if closed[0] else lo[0]], right])


def _layer(writer, run, kind: str, layer: str, protos) -> None:
    """One layer's histograms and statistics, a block of steps at a time."""
    Event, Summary, HistogramProto = protos
    hist = run.histogram(layer, kind)
    stats = one_layer(run.stats(kind, Names([layer])))
    limits = _limits(hist.bin_lo.values, hist.bin_hi.values)
    steps = hist.step.values
    for start in range(0, len(steps), BLOCK_STEPS):
        part = slice(start, start + BLOCK_STEPS)
        counts = np.asarray(hist.isel(step=part).values)
        block = {s: np.asarray(stats[s].isel(step=part).values) for s in fmt.STATS}
        for j, step in enumerate(steps[part]):
            if block["count"][j] < 0:                    # the layer did not run there
                continue
            values = [Summary.Value(tag=_tag(kind, layer, s), simple_value=float(block[s][j]))
                      for s in fmt.STATS]
            c = counts[j]
            held = np.nonzero(c > 0)[0]
            if len(held):
                first, last = held[0], held[-1] + 1
                num = float(c.sum())
                mean, std = float(block["mean"][j]), float(block["std"][j])
                values.append(Summary.Value(tag=_tag(kind, layer), histo=HistogramProto(
                    min=float(block["min"][j]), max=float(block["max"][j]), num=num,
                    sum=mean * num, sum_squares=num * (std * std + mean * mean),
                    bucket_limit=limits[first:last + 1].tolist(),
                    bucket=[0.0, *c[first:last].astype(np.float64).tolist()])))
            writer.add_event(Event(wall_time=time.time(), step=int(step),
                                   summary=Summary(value=values)))
