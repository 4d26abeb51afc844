"""The on-disk schema of a tensortape store, in one place.

The writer (``recorder``) and every reader (``analysis``) import it.  It
imports nothing heavier than numpy, so readers start without torch.

Layout of a store (Zarr v3)::

    run.zarr/                       root attrs: tensortape_format, status, ... (``root_attrs``)
      rank0/                        attrs: the rank's durable state (``RankState``)
        stats/<kind>/               step (step), stats (step, layer, stat) in shards of
                                    1024 steps x 256 layers, hist (step, layer, bin) in
                                    shards of 256 steps x 256 layers, bin_lo/bin_hi (bin);
                                    attrs: stats (the names along ``stat``);
                                    pyramid<G> (grain<G>, layer, grain_stat): the maxima
                                    of each grain of G physical rows (``PYRAMID_GRAINS``)
        tensors/<kind>/<node>/      data (step, dim_0, ...), step (step), micro (step),
                                    extent (step, axis); attrs: name, kind
                                    (either table: recording (step) once a resumed
                                    recording appended to it)
        replay/step<S>/             on_nonfinite="replay": the producer call's bundle
                                    (``replay_group``), named by its event's replay
        scalars/                    ``rec.log``'s scalars, a row per (step, name): step,
                                    name (an index into the rank state's ``scalar_names``),
                                    value (float64) (``scalars_table``); absent: none
        nonfinite/<kind>/           the NaN/Inf counts of steps without statistics
                                    (``nonfinite_table``): step (step), counts (step,
                                    layer, count_stat): a row per such step where a
                                    capture held any, a column per name of the rank's
                                    ``layers`` (by position), each (nan, posinf, neginf)
                                    summed over the step's micro-batches (0: none)

Format 3 packs a kind's statistics into one array and writes its histograms
as shards, so a rank's files grow with its flushes and steps / 256, not with
arrays x steps.  Format 2 had an array per statistic (``<stat>`` (step,
layer)) and histogram chunks of 16 steps x 8 layers; format 1 no ``micro``.
Readers read all three; ``tensortape migrate`` converts a store to format 3.

The *pyramid* of a stats table (absent in tables made before it: readers
then compute it) holds, per grain of ``G`` consecutive physical rows and per
layer, the largest value of each map statistic (``MAP_STATS``, as
``pyramid.map_value`` computes it from a row) and whether any row is non-finite
(``any_nonfinite``, read as ``> 0``), a fold of the grain's rows in order
(``recorder.pyramid``: how a row becomes map values, and grains their
maxima).  Only whole grains are stored; the rank state's ``pyramid`` says how
many of the table's rows they cover, committed with the rows: a reader trusts
the grains of the first ``min(pyramid, committed)`` rows, and none when the
levels are narrower than the table (a tensortape without pyramids appending
to the table keeps that entry but widens only ``stats``; a writer continues a
pyramid only when it covers every committed row).  It is an addition old
readers ignore, so the format version stays 3.

A step's statistics are one row (over all its micro-batches); its full
tensors are a row per micro-batch.  A step recorded again (a job resumed
with ``mode="a"`` from an earlier checkpoint) appends rows.  Each attach with
``mode="a"`` begins a new *recording* of the rank (``RankState.recording``: 0
for the first, then 1, 2, ...); a table that a recording after the first
appends to gains a ``recording`` column (step), the number of the recording
that wrote each row (absent: every row is recording 0), and the rank's state
lists the steps a recording recorded again (``RankState.rerecorded``).  A
reader returns, of each step, the rows of the latest recording that recorded
it, and none of an older one's (``current_rows``); an older recording's events
at such a step are removed by the writer.

This module owns: the names (kinds, statistics, statuses), the table paths
and their parsing, the columns of each table, and the rank state and the
events to and from JSON.  Beside it, public too: ``histogram`` (the histogram
codes and bins, both ways), ``dtypes`` (bfloat16 and float8 from their stored
bits), ``patterns`` (which layer names a glob pattern selects) and ``pyramid``
(a stats row's map values, and their maxima per grain).

Any thread, no state: the training thread (names), the writer thread (rows and
state) and the reader's threads.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._json import integer, object_or_none, step_run, strings, to_json
from .errors import StoreFormatError

FORMAT_VERSION = 3          # 3: packed statistics, sharded histograms (2: an array per
READS_VERSIONS = (1, 2, 3)  # statistic; 1: no ``micro`` column)


class Kind(str, enum.Enum):
    """What a capture is of; each member is its on-disk string (a ``str``: it
    compares, hashes, formats, prints and serialises as that string, so stored
    names and readers are unchanged).  Hot paths use the members as constants."""
    ACTIVATIONS = "activations"
    GRADIENTS = "gradients"
    INPUTS = "inputs"
    WEIGHTS = "weights"
    WEIGHT_GRADS = "weight_grads"

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__


KINDS = tuple(k.value for k in Kind)
# a ``capture`` value that is no kind of its own: the recorded root's integer and bool
# inputs (token ids, attention masks, labels), stored as its ``inputs`` (``(root):input_ids``)
BATCH = "batch"
CAPTURES = (*KINDS, BATCH)
FORWARD_KINDS = ("inputs", "activations", "weights")
BACKWARD_KINDS = ("gradients", "weight_grads")

STATS = (
    "count", "mean", "std", "min", "max", "abs_max", "norm",
    "zero_frac", "nan", "posinf", "neginf",
)

COUNT_STATS = ("count", "nan", "posinf", "neginf")     # integers in every API and output
STATUS_RECORDING = "recording"
STATUS_COMPLETE = "complete"
STATUS_INTERRUPTED = "interrupted"
STATUSES = (STATUS_RECORDING, STATUS_COMPLETE, STATUS_INTERRUPTED)

ROOT_LABEL = "(root)"
LOGICAL_ATTR = "logical_dtype"
# dtypes numpy lacks, stored as their unsigned bits with ``logical_dtype``
BITS_DTYPES = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
               "float8_e4m3fnuz": "uint8", "float8_e5m2fnuz": "uint8", "float8_e8m0fnu": "uint8"}
MAX_EVENTS = 1000          # events kept in the attributes; ``events_total`` counts them all

# --- tables and their columns ----------------------------------------------
STATS_COLUMNS = ("step", "stats", "hist")     # rows keyed by step (format 3)
STATS_COLUMNS_V2 = ("step", "hist", *STATS)   # formats 1 and 2: an array per statistic
STAT_AXIS = "stat"
BIN_COLUMNS = ("bin_lo", "bin_hi")            # fixed: one value per bin
TENSOR_COLUMNS = ("data", "step", "micro", "extent")
SCALAR_COLUMNS = ("step", "name", "value")    # ``rec.log``: a row per (step, name)
NONFINITE_COLUMNS = ("step", "counts")        # NaN/Inf counts of steps without statistics
OPTIONAL_COLUMNS = {"micro": 0}               # absent in format 1: every row is micro-batch 0
MAP_STATS = ("abs_max", "std", "norm", "rms", "nonfinite")   # the browser view's map
PYRAMID_STATS = (*MAP_STATS, "any_nonfinite")     # along a pyramid level's ``grain_stat``
PYRAMID_GRAINS = (64, 8)     # rows a grain of each pyramid level, coarsest first
RECORDING = "recording"      # a column of a table a resumed recording appended to (any format-3
                             # table may have it; absent: every row is recording 0)
EVERY_CHUNK = "every_chunk"  # a table attribute: each chunk of its rows is stored, even one all
                             # fill, so a chunk missing from the committed rows is damage


# Every dtype the writer stores (numpy names; bfloat16 and float8 are stored as their
# unsigned bits, with ``logical_dtype``); readers refuse any other.
STORED_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128"})


def is_url(location: str) -> bool:
    """Whether a store location is an fsspec URL rather than a local path."""
    return "://" in str(location)


def location(store) -> str:
    """A store location as the recorder keeps it: a path or an fsspec URL, a
    ``file://`` URL as its local path (one file system, one kind of claim)."""
    where = os.fspath(store)
    return where.removeprefix("file://") if where.startswith("file://") else where


def pyramid_level(grain: int) -> str:
    """The array of a stats table's pyramid level of ``grain`` rows a grain."""
    return f"pyramid{int(grain)}"


def rank_group(rank: int) -> str:
    return f"rank{int(rank)}"


def rank_of(name) -> int | None:
    """The rank whose group is ``name`` (``rank3`` -> 3), or None for any other name:
    the one place a rank group's name is read back (``rank_group`` makes it)."""
    digits = name[4:] if isinstance(name, str) and name.startswith("rank") else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


CLAIM_NAME = "tensortape.lock"   # a group at the root whose zarr.json names the job that
                                 # records the run (``recorder.claim._claim``); gone at close
CLAIM_TOKEN = "claim"            # a root attribute: the token of the claim under which the
                                 # root was last committed (a rank other than 0 finds the
                                 # claim gone: rank 0's close if it is its job's, else a
                                 # job that took the run over and closed it)


def is_own_entry(name: str) -> bool:
    """Whether ``name``, an entry at the root of a store, is one tensortape writes
    (``zarr.json``, the rank groups, the claim ``tensortape.lock`` of the job that
    records there, and a temporary file of zarr's that a kill left): ``mode="w"``
    deletes these and nothing else (a live job's claim refuses it first)."""
    return name == "zarr.json" or rank_of(name) is not None or name == CLAIM_NAME \
        or is_partial(name)


def is_partial(name: str) -> bool:
    """A temporary file of zarr's atomic write (``zarr.<32 hex>.partial``), left by a
    process killed while it wrote the root's ``zarr.json``."""
    head, _, rest = name.partition(".")
    hexpart, _, tail = rest.partition(".")
    return head == "zarr" and tail == "partial" and len(hexpart) == 32 and all(
        c in "0123456789abcdef" for c in hexpart)


def stats_group(rank: int, kind: str) -> str:
    return f"{rank_group(rank)}/stats/{kind}"


def replay_group(rank: int, step: int) -> str:
    """Where ``on_nonfinite="replay"`` stores its replay bundle (one a run): the
    producer call's inputs, parameters, buffers and output gradients as arrays
    (``input_<i>``, ``param_<name>``, ``buffer_<name>``, ``grad_<path>``), and its
    structure, RNG and autocast state in the group's attributes."""
    return f"{rank_group(rank)}/replay/step{int(step)}"


def tensor_group(rank: int, kind: str, layer: str) -> str:
    return f"{rank_group(rank)}/tensors/{kind}/{node_name(layer)}"


def nonfinite_table(rank: int, kind: str) -> str:
    """The NaN/Inf counts of ``kind`` at the rank's steps without statistics:
    ``NONFINITE_COLUMNS``, committed in the rank state's ``nonfinite``."""
    return f"{rank_group(rank)}/nonfinite/{kind}"


def scalars_table(rank: int) -> str:
    """The rank's logged scalars (``rec.log``): ``SCALAR_COLUMNS``."""
    return f"{rank_group(rank)}/scalars"


@dataclass(frozen=True)
class TablePath:
    """A parsed table path: ``rankR/stats/KIND``, ``rankR/tensors/KIND/NODE``,
    ``rankR/nonfinite/KIND`` or ``rankR/scalars`` (kind ``""``)."""
    rank: int
    section: str            # "stats", "tensors", "nonfinite" or "scalars"
    kind: str
    node: str | None = None

    @property
    def columns(self) -> tuple[str, ...]:
        return {"stats": STATS_COLUMNS, "scalars": SCALAR_COLUMNS,
                "nonfinite": NONFINITE_COLUMNS}.get(self.section, TENSOR_COLUMNS)


def latest_rows(keys: np.ndarray) -> np.ndarray:
    """Indices of the last row of each distinct key (rows of one table, keys such
    as steps or (step, micro) pairs), ordered by key."""
    keys = np.asarray(keys)
    if keys.ndim == 1:
        keys = keys[:, None]
    if not len(keys):
        return np.zeros(0, np.int64)
    order = np.lexsort(keys.T[::-1])                       # stable: equal keys keep row order
    k = keys[order]
    last = np.ones(len(k), bool)
    last[:-1] = (k[1:] != k[:-1]).any(axis=1)
    return order[last]


def note_step(runs: list[list[int]], recording: int, step: int) -> None:
    """Add ``step``, recorded again by ``recording``, to ``runs``: arithmetic runs
    ``[recording, first, last, stride]`` (stride 0: one step), in recording order;
    a recording's steps increase, so its steps recorded every k steps are one run.
    (Any key in place of ``recording`` makes runs of the steps with that key.)"""
    if runs and runs[-1][0] == recording:
        run = runs[-1]
        if run[1] == run[2] and step > run[2]:
            run[2], run[3] = step, step - run[1]
            return
        if run[3] and step - run[2] == run[3]:
            run[2] = step
            return
    runs.append([int(recording), int(step), int(step), 0])


def superseding(runs, steps: np.ndarray) -> np.ndarray:
    """Of each of ``steps``, the latest recording that recorded it again (0: none)."""
    steps = np.asarray(steps, np.int64)
    out = np.zeros(len(steps), np.int64)
    for recording, first, last, stride in runs:
        hit = (steps >= first) & (steps <= last)
        if stride:
            hit &= (steps - first) % stride == 0
        out[hit] = np.maximum(out[hit], recording)
    return out


def current_rows(steps: np.ndarray, recordings: np.ndarray | None, runs) -> np.ndarray:
    """Indices of the rows of a table (their ``steps`` and ``recordings``) that belong
    to the latest recording of their step: a row of a step that a later recording
    recorded again is not read (that recording's rows are the step's, whole, even
    where it has none of this table)."""
    steps = np.asarray(steps, np.int64)
    if not runs or recordings is None:
        return np.arange(len(steps))
    return np.nonzero(np.asarray(recordings, np.int64) >= superseding(runs, steps))[0]


def parse_path(path: str) -> TablePath:
    """The parts of a table path; ``StoreFormatError`` for anything else."""
    parts = path.split("/") if isinstance(path, str) else []
    rank = rank_of(parts[0]) if parts else None
    if rank is not None and parts[1:] == ["scalars"]:
        return TablePath(rank, "scalars", "")
    ok = (len(parts) in (3, 4) and rank is not None
          and parts[2] in KINDS and ((parts[1] in ("stats", "nonfinite") and len(parts) == 3)
                                     or (parts[1] == "tensors" and len(parts) == 4
                                         and parts[3] == node_name_safe(parts[3]))))
    if not ok:
        raise StoreFormatError(f"{path!r} is not a table path of a tensortape store")
    return TablePath(rank, parts[1], parts[2], parts[3] if len(parts) == 4 else None)


# --- names -------------------------------------------------------------------
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.%~")


def label(module_name: str, names=()) -> str:
    """The recorded name of a module: its ``named_modules()`` name, or for the root
    ``(root)`` (with a ``'`` added for each module of ``names`` that is literally
    called so: the root's label never clashes with a module's name)."""
    if module_name:
        return module_name
    root = ROOT_LABEL
    while root in names:
        root += "'"
    return root


def join(base: str, path: str) -> str:
    """The recorded name of a leaf at ``path`` inside a module's output or inputs."""
    return f"{base}:{path}" if path else base


def node_name(layer: str) -> str:
    """A store node name for a layer name that can never escape its folder.

    Characters outside ``[A-Za-z0-9_.-]`` are percent-encoded (their UTF-8
    bytes; a lone surrogate's as UTF-8 would encode it), a leading dot too (so
    ``.`` and ``..`` are impossible), and overlong names are cut and suffixed
    with a hash.  Readers never invert this: the true name is kept in the
    node's ``name`` attribute.
    """
    out = "".join(c if c in _SAFE and c not in "%~" else "".join(f"%{b:02X}" for b in _utf8(c))
                  for c in layer)
    if not out or out.startswith(".") or out.startswith("__"):
        out = "%2E" + out[1:] if out.startswith(".") else "%5F" + out[1:] if out else "%00"
    if len(out) > 180:
        out = out[:160] + "~" + hashlib.sha1(_utf8(layer)).hexdigest()[:16]
    return out


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")        # any str, a lone surrogate too


def node_name_safe(node: str) -> str:
    """``node`` if it is a name ``node_name`` can produce (safe on any file system), else ''."""
    ok = node and len(node) <= 180 and set(node) <= _SAFE and not node.startswith(".")
    return node if ok else ""


@dataclass(frozen=True)
class NonFiniteEvent:
    """One capture that held NaN or Inf."""
    step: int
    layer: str
    kind: str
    nan: int
    posinf: int
    neginf: int
    order: int = 0
    phase: str = "forward"
    micro: int = 0
    rank: int = 0
    # on_nonfinite="replay": the op that made it (op, source, code, inputs, module, ...)
    replay: dict | None = field(default=None, compare=False, hash=False)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if out["replay"] is None:
            del out["replay"]
        return out

    @classmethod
    def from_json(cls, d) -> "NonFiniteEvent":
        try:
            ev = cls(integer(d["step"]), str(d["layer"]), str(d["kind"]), integer(d["nan"]),
                     integer(d["posinf"]), integer(d["neginf"]), integer(d.get("order", 0)),
                     str(d.get("phase", "forward")), integer(d.get("micro", 0)),
                     integer(d.get("rank", 0)), object_or_none(d.get("replay")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreFormatError(f"a non-finite event in the store is malformed ({d!r:.80})") from e
        return ev

    @property
    def sort_key(self):
        """Step, then forward before backward, then execution order, then rank."""
        return (self.step, self.phase != "forward", self.order, self.rank)


@dataclass
class RankState:
    """One rank's durable state, kept in its group's attributes.

    ``committed`` maps each table path to the rows a reader may trust: the
    writer advances it only after the data is written.
    """
    rank: int = 0
    layers: list[str] = field(default_factory=list)           # first-capture order
    events: list[NonFiniteEvent] = field(default_factory=list)
    events_total: int = 0
    dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)   # what ``dropped`` counts
    outside_steps: int = 0                                    # forward passes outside a step
    over_budget: int = 0                     # full tensors due that no reader can read for max_bytes
    over_budget_at: list[list[int]] = field(default_factory=list)   # where: runs [count, first,
                                     # last, stride] (``note_step``'s), each step ``count`` of them
    last_step: int | None = None
    committed: dict[str, int] = field(default_factory=dict)
    stats_layers: dict[str, list[str]] = field(default_factory=dict)   # kind -> layer rows
    bytes_raw: int = 0
    recording: int = 0               # the number of the rank's latest recording: 0 for the
                                     # first, one more at each attach with mode="a"
    rerecorded: list[list[int]] = field(default_factory=list)   # the steps a recording recorded
                                     # again (``note_step`` runs): older rows there are not read
    scalar_names: list[str] = field(default_factory=list)   # ``rec.log``'s names, by index
    pyramid: dict[str, int] = field(default_factory=dict)   # stats table -> the rows its
                                     # pyramid covers (committed with them; absent: none)
    nonfinite: dict[str, int] | None = None   # ``nonfinite_table`` -> its committed rows
                                     # (None: written by a tensortape that kept no such table)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["events"] = [e.to_json() for e in self.events]
        return to_json(d)

    @classmethod
    def from_json(cls, d, where: str = "the store") -> "RankState":
        if not isinstance(d, dict):
            raise StoreFormatError(f"the rank state of {where} is not a JSON object")
        try:
            committed = {str(p): integer(n) for p, n in dict(d.get("committed", {})).items()}
            for p in committed:
                parse_path(p)
            return cls(
                rank=integer(d.get("rank", 0)),
                layers=strings(d.get("layers", [])),
                events=[NonFiniteEvent.from_json(e) for e in list(d.get("events", []))],
                events_total=integer(d.get("events_total", len(d.get("events", [])))),
                dropped=integer(d.get("dropped", 0)),
                drop_reasons={str(k): integer(v)
                              for k, v in dict(d.get("drop_reasons", {})).items()},
                outside_steps=integer(d.get("outside_steps", 0)),
                over_budget=integer(d.get("over_budget", 0)),
                over_budget_at=[step_run(r) for r in list(d.get("over_budget_at", []))],
                last_step=None if d.get("last_step") is None else integer(d["last_step"]),
                committed=committed,
                stats_layers={str(k): strings(v) for k, v in dict(d.get("stats_layers", {})).items()},
                bytes_raw=integer(d.get("bytes_raw", 0)),
                recording=integer(d.get("recording", 0)),
                rerecorded=[step_run(r) for r in list(d.get("rerecorded", []))],
                scalar_names=strings(d.get("scalar_names", [])),
                pyramid={str(p): integer(n) for p, n in dict(d.get("pyramid", {})).items()},
                nonfinite=None if d.get("nonfinite") is None else
                {str(p): integer(n) for p, n in dict(d["nonfinite"]).items()})
        except StoreFormatError:
            raise
        except (TypeError, ValueError, AttributeError) as e:
            raise StoreFormatError(f"the rank state of {where} is malformed: {e}") from e


def root_attrs(state: RankState, base: dict[str, Any], status: str | None = None) -> dict:
    """The root attributes: ``base`` (format, versions, config, ...) with rank 0's
    layers, events and counters, and ``status`` when given."""
    out = dict(base, layers=list(state.layers), events=[e.to_json() for e in state.events],
               dropped=state.dropped, drop_reasons=dict(state.drop_reasons),
               outside_steps=state.outside_steps,
               over_budget=state.over_budget)
    if status:
        out["status"] = status
    return out
