"""Named scalars a step logs (``rec.log``): checked at the call, read at the step's end.

``check`` turns the user's dict into names and values at the public boundary
(one ``ConfigError`` line for anything that is not a name -> number mapping).
``ScalarLog`` keeps them on the training thread:

- logged while a step is open, a tensor is kept by reference and read when the
  step ends, with the summaries: its value at the step's end is the one stored;
- logged after a step ended (a trainer's ``on_log``), the values belong to that
  step; a tensor is copied on its device at once (no sync) and read when the
  next step ends, or at close.

``pack`` (at a step's end) starts the tensors' copies to the host, one stacked
vector per device, as the summaries' are (``Summarizer.to_host``); the writer
thread reads them (``Logged.values``).  Nothing here waits for a device.

The store side: ``columns`` makes the rank's scalars table (``format.SCALAR_COLUMNS``);
each name's index in the rank state's ``scalar_names`` is ``RankLog``'s.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .. import format as fmt
from ._drops import cause
from ..store._layout import SMALL_CHUNK_ROWS, new_array, step_column
from ._record import Packed
from ..errors import ConfigError

__all__ = ["Logged", "ScalarLog", "check", "columns", "resolve"]

BEFORE_FIRST = "scalars logged before the first step"


def check(values) -> dict:
    """The logged ``values`` as {name: float or 0-dim tensor}; ``ConfigError`` naming
    the problem and the fix for anything else.  Reads no tensor."""
    if not isinstance(values, dict):
        raise ConfigError(f"rec.log takes a dict of name -> number, e.g. rec.log({{'loss': "
                          f"loss, 'lr': lr}}); got {type(values).__name__}")
    out = {}
    for name, v in values.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"rec.log: the name {name!r} is not a non-empty string; name each "
                              f"scalar, e.g. rec.log({{'loss': loss}})")
        if isinstance(v, torch.Tensor):
            if v.dim() != 0 or v.is_complex():
                raise ConfigError(f"rec.log: {name!r} is a {str(v.dtype).removeprefix('torch.')} "
                                  f"tensor of shape {list(v.shape)}; log a real 0-dim tensor "
                                  f"(e.g. loss.mean()) or a number")
            out[name] = v.detach()
        elif isinstance(v, numbers.Real) or (isinstance(v, (np.generic, np.ndarray))
                                             and np.ndim(v) == 0 and np.isrealobj(v)
                                             and np.asarray(v).dtype.kind in "biuf"):
            out[name] = float(v)
        else:
            raise ConfigError(f"rec.log: {name!r} is {type(v).__name__} {v!r:.40}, not a number; "
                              f"log Python or numpy numbers, or real 0-dim tensors")
    return out


@dataclass
class Logged:
    """One step's scalars on their way to the writer: the plain numbers, and the
    tensors' values (at ``at``) in ``packed``, copying to the host."""
    step: int
    names: list[str]
    floats: np.ndarray
    at: list[int]
    packed: Packed | None

    def values(self) -> np.ndarray:
        """Every value (waits for the tensors' copies: the writer thread does)."""
        out = self.floats.copy()
        if self.packed is not None:
            out[self.at] = self.packed.host()
        return out


class ScalarLog:
    """The scalars of the open step and of the last one (see the module)."""

    def __init__(self, drops, warn_once):
        self.drops, self._warn_once = drops, warn_once
        self.open: dict = {}                      # the open step's
        self.late: dict[int, dict] = {}           # logged after their step ended

    def log(self, values: dict, open_step: int | None, last_step: int | None) -> None:
        if open_step is not None:
            self.open.update(values)
            return
        if last_step is None:
            self.drops.drop(BEFORE_FIRST, len(values))
            self._warn_once("log before", "tensortape: rec.log was called before the first "
                            "step; its scalars are dropped and counted (log inside a step, or "
                            "after it)")
            return
        copied = {k: v.to(torch.float64, copy=True) if isinstance(v, torch.Tensor) else v
                  for k, v in values.items()}     # the value now: a copy on its device
        self.late.setdefault(last_step, {}).update(copied)

    def pack(self, step: int | None, to_host) -> list[Logged]:
        """What was logged since the last pack, the tensors' copies started
        (``step``: the step that ends now; None at close); a failure drops those
        scalars, counted."""
        batches = list(self.late.items())
        if step is not None and self.open:
            batches.append((step, self.open))
        self.late, self.open = {}, {}
        out = []
        for s, values in batches:
            try:
                out.append(_pack(s, values, to_host))
            except Exception as e:                # never into training: counted
                why = cause(e)
                self.drops.drop(f"scalars failed ({why})", len(values))
                self._warn_once(why, f"tensortape: the scalars of step {s} could not be read "
                                f"({why}); they are dropped and counted; training goes on")
        return out


def _pack(step: int, values: dict, to_host) -> Logged:
    names = list(values)
    floats = np.array([v if isinstance(v, float) else np.nan for v in values.values()])
    by_device: dict = {}
    for i, v in enumerate(values.values()):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    at, parts = [], []
    for idx in by_device.values():
        vec = torch.stack([values[names[i]].to(torch.float64) for i in idx])
        parts.append(to_host(vec))
        at += idx
    return Logged(step, names, floats, at, Packed(parts) if parts else None)


def resolve(batches: list[Logged], drops: dict) -> list[tuple[int, list[str], np.ndarray]]:
    """On the writer thread: each batch's (step, names, values); a batch whose
    tensors cannot be read is counted in ``drops`` (a record's, by reason)."""
    out = []
    for b in batches:
        try:
            out.append((b.step, b.names, b.values()))
        except Exception as e:
            reason = f"scalars failed ({type(e).__name__})"
            drops[reason] = drops.get(reason, 0) + len(b.names)
    return out


def columns(g) -> dict:
    """A new scalars table in ``g`` (``format.SCALAR_COLUMNS``)."""
    g.update_attributes({fmt.EVERY_CHUNK: True})
    return {"step": step_column(g, "step", fill=-1), "name": step_column(g, "name", fill=-1),
            "value": new_array(g, "value", (0,), (SMALL_CHUNK_ROWS,),
                               "float64", np.nan, ["step"])}
