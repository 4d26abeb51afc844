"""The run's non-finite events: in order, the first with its neighbourhood for
a post-mortem, and the replay bundle a replay left."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xarray as xr

from tensortape.recorder import format as fmt
from tensortape.recorder.errors import ConfigError, StoreFormatError
from tensortape.recorder.format import NonFiniteEvent

from ._numbers import statistics_row
from ._index import RunIndex
from ._select import Names, one_layer

__all__ = ["FirstNonFinite", "bundle", "events_of", "first_nonfinite", "replay_lines"]


@dataclass(frozen=True)
class FirstNonFinite(NonFiniteEvent):
    """The first non-finite capture, with its neighbourhood for a post-mortem."""
    history: xr.Dataset | None = field(default=None, compare=False, repr=False)
    same_step: tuple[NonFiniteEvent, ...] = field(default=(), compare=False, repr=False)

    def to_json(self) -> dict:
        """The event, the other events of its step, and the statistics before it
        (``_numbers``: counts as integers, NaN and Inf as strings, absent as null)."""
        out = NonFiniteEvent(**{k: getattr(self, k) for k in NonFiniteEvent.__dataclass_fields__}).to_json()
        out["same_step"] = [e.to_json() for e in self.same_step]
        if self.history is not None:
            h = self.history
            out["history"] = [statistics_row({"step": int(s), **{k: h[k].sel(step=s).item()
                                                                 for k in fmt.STATS}}, fmt.STATS)
                              for s in h.step.values]
        return out


def events_of(index: RunIndex, rank: int | None = None) -> list[NonFiniteEvent]:
    """One rank's events, or with ``rank=None`` every rank's, ordered by step, then
    forward before backward, then execution order (then rank)."""
    ranks = index.ranks if rank is None else [index.rank(rank)]
    return sorted((e for r in ranks for e in index.states[r].events), key=lambda e: e.sort_key)


def first_nonfinite(index: RunIndex, stats, rank: int | None = None,
                    history: int = 5) -> FirstNonFinite | None:
    """The earliest non-finite capture across every rank (or of ``rank``), with the
    ``history`` steps of statistics before it (``stats(kind, layers, rank)``) and
    the other events of its step."""
    evs = events_of(index, rank)
    if not evs:
        return None
    first = evs[0]
    rank = first.rank
    hist = None
    if first.kind in index.kinds_of(rank) and first.layer in index.stats_layers(first.kind, rank):
        ds = one_layer(stats(first.kind, Names([first.layer]), rank))
        hist = ds.sel(step=ds.step[ds.step <= first.step][-(history + 1):]).compute()
    same = tuple(e for e in evs if e.step == first.step and e is not first)
    return FirstNonFinite(**{k: getattr(first, k) for k in first.__dataclass_fields__},
                          history=hist, same_step=same)


def bundle(index: RunIndex, rank: int | None = None):
    """The replay bundle of the first event that stored one: its attributes, and
    a reader of its arrays (name -> numpy array and logical dtype), as
    ``recorder.replay.replay_bundle`` takes them."""
    hits = [e for e in events_of(index, rank) if e.replay and e.replay.get("bundle")]
    if not hits:
        raise ConfigError(f"{index.path!r} holds no replay bundle; record with "
                          f"on_nonfinite='replay' (a bundle is stored when a replay names "
                          f"an op)")
    path = hits[0].replay["bundle"]

    def read(name: str) -> tuple[np.ndarray, str | None]:
        arr = index.source.array(f"{path}/{fmt.node_name(name)}")
        if np.dtype(arr.dtype).name not in fmt.STORED_DTYPES:
            raise StoreFormatError(f"{index.path!r}: {path}/{name} holds {arr.dtype}")
        return np.asarray(arr[...]), dict(arr.attrs).get(fmt.LOGICAL_ATTR)
    return index.source.attrs(path), read


def replay_lines(found: dict) -> list[str]:
    """What a replay (``on_nonfinite="replay"``, ``Run.replay``) found, as lines of text
    (``tensortape nan``, ``replay`` and the browser view print these): the op and its
    module; where the op ran and the user's call that led there (one line where they
    are one: the user's own code); the op's inputs."""
    if not found.get("op"):
        of = f" of {found['module'] or '(root)'}" if "module" in found else ""
        return [f"replay{of}: {found.get('note')}"]
    where = f"{found.get('module') or '(root)'} ({found.get('module_class')})"
    if found.get("phase") == "backward":
        head = (f"made by {found['op']} in {found.get('node', '?')}, in the backward of {where}; "
                f"the forward op that made that node")
        lib, lib_code = found.get("forward_library_source"), found.get("forward_library_code")
        user, code = found.get("forward_source", "?"), found.get("forward_code")
    else:
        head = f"made by {found['op']} in {where}"
        lib, lib_code = found.get("library_source"), found.get("library_code")
        user, code = found.get("source"), found.get("code")
    if lib:
        out = [f"{head} ran at {lib} (library code)", *_code(lib_code),
               f"  called from {user} (your code)", *_code(code)]
    else:
        out = [f"{head}, at {user}", *_code(code)]
    for i, t in enumerate(found.get("inputs", [])):
        stats = ", ".join(f"{k} {t[k]:.4g}" if isinstance(t[k], float) else f"{k} {t[k]}"
                          for k in ("min", "max", "abs_max", "nan", "posinf", "neginf") if k in t)
        out.append(f"  input {i}: {t['dtype']}{t['shape']}  {stats}")
    return out


def _code(text) -> list[str]:
    return [f"    {text}"] if text else []
