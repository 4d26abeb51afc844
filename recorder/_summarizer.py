"""What form each capture takes, and the engines that make it.

For each captured tensor the ``Summarizer`` takes, as the step's ``Plan``
says:

- its full tensor, when the step keeps them (a ``Snapshot``, through the
  ``Stager``; one it cannot take is counted in the ``DropLedger``);
- its summary, in the form ``_summary.form`` decides: a summary vector from
  the statistics engine for the tensor's device and dtype; at a step without
  statistics the exact NaN/Inf counts; for a tiny float tensor, a copy that
  waits for the step's batch; for a tensor without float values, nothing (its
  element count is all).

Nothing waits for a device, and nothing keeps a reference to the user's
tensor.  At the step's end ``pack`` summarises the tiny tensors in one batch
per device and code width, stacks the other vectors of a device into blocks,
and starts each device's copy to the host.

An engine that fails on a capture raises ``EngineFailed``, which carries the
tensor: the fault path (``demote``) moves that (device type, dtype) to the
next engine of the demotion order (``_engines.ORDER``).

Training thread (the hooks, and the step's end), and autograd's threads for
gradients: a ``Capture`` is built on the thread that took it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._config import RecorderConfig
from ._drops import DropLedger
from ._engines import Engines
from ._record import Block, Meta, Packed, Plan
from ._snapshot import Snapshot, Stager, unstorable
from ._summary import Form, Holds, empty_summary, form, prepared, widened
from .errors import TensortapeWarning

__all__ = ["Capture", "EngineFailed", "Summarizer"]


@dataclass(slots=True)
class Capture:
    """A capture of the open step, until the step ends."""
    order: int
    kind: str
    name: str
    micro: int
    exp_bits: int                   # its code width (``exp_bits_of``)
    numel: int
    form: Form                      # SUMMARY, NONFINITE, SMALL or COUNT (EMPTY: a SUMMARY)
    vec: torch.Tensor | None        # the device vector (or the tiny copy) until the step ends
    snap: Snapshot | None


class EngineFailed(Exception):
    """A statistics engine raised on ``tensor``: the error, and the tensor whose
    (device type, dtype) the fault path demotes."""

    def __init__(self, error: Exception, tensor: torch.Tensor):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.tensor = error, tensor


_HOLDS = {Form.SUMMARY: Holds.SUMMARY, Form.NONFINITE: Holds.NONFINITE}
# the members as module constants: an Enum attribute costs a lookup per capture
_COUNT, _EMPTY, _SMALL, _SUMMARY = Form.COUNT, Form.EMPTY, Form.SMALL, Form.SUMMARY


class Summarizer:
    """A recording's capture forms, engines and snapshot memory (see the module)."""

    def __init__(self, config: RecorderConfig, ledger: DropLedger, fault):
        self.config = config
        self.ledger = ledger
        self._fault = fault                     # fault(error, kind, name, n): counted and told
        self.engines = Engines()
        self.stager = Stager(config.max_device_bytes, config.max_pinned_bytes)

    def warm(self, model: torch.nn.Module) -> None:
        """Prepare the statistics engines for the float dtypes and devices of the
        model's parameters and buffers (``Engine.warm``: on CUDA the Triton kernel
        compiles in the background; the first capture of any other dtype
        prepares its own)."""
        try:
            seen = {(t.dtype, t.device) for t in (*model.parameters(), *model.buffers())
                    if t.is_floating_point() and t.device.type != "meta"}
            for dtype, device in seen:
                self.engines.warm(dtype, device)
        except Exception:               # only a head start: the captures compile what they need
            pass

    # --- a capture -----------------------------------------------------------------------
    def take(self, kind: str, name: str, micro: int, tensor: torch.Tensor, plan: Plan) -> Capture:
        """The capture of a detached ``tensor`` (its ``order`` is set by the caller).
        Raises ``EngineFailed`` when the engine fails."""
        snap = None
        if plan.keep:                           # its full tensor (inline: once per capture)
            reason = unstorable(tensor)
            if reason is None:
                snap = self.stager.take(tensor, self.config.max_samples, self.config.tensor_dtype)
                if isinstance(snap, str):       # a cap: the reason none was taken
                    reason, snap = snap, None
            if reason is not None:
                self.ledger.drop(reason)
        f, exp_bits, numel = form(tensor, plan.stats)
        vec = None
        if f is _SMALL:
            vec = widened(tensor).clone()
        elif f is _EMPTY:
            f, vec = _SUMMARY, empty_summary()
        elif f is not _COUNT:
            engine = self.engines.for_tensor(tensor)
            try:
                if f is _SUMMARY:
                    vec = engine.reduce(prepared(tensor))
                else:
                    vec = engine.count_nonfinite(prepared(tensor))
            except TensortapeWarning:   # made an error by the user's filter: their policy
                raise
            except Exception as e:
                raise EngineFailed(e, tensor) from e
        return Capture(0, kind, name, micro, exp_bits, numel, f, vec, snap)

    def demote(self, tensor: torch.Tensor) -> str:
        """After ``EngineFailed`` on ``tensor``: its (device type, dtype) moves to the
        next engine; what happened, in words."""
        failed = self.engines.for_tensor(tensor)
        after = self.engines.demote(tensor)
        return (f"{failed} failed on {tensor.dtype}, "
                + (f"{after} takes over" if after else "no other engine is left"))

    # --- the step's end ------------------------------------------------------------------
    def pack(self, caps: list[Capture]) -> tuple[list[Meta], list[Block], Packed | None]:
        """Batch the tiny tensors, stack the other vectors of a device and form into
        blocks, and start each device's copy to the host without waiting (a pinned
        buffer and an event on CUDA).  A failed batch is counted (``fault``), its
        captures left with their element counts."""
        groups: dict = {}          # (device, form, code width of tiny ones) -> capture indices
        for i, c in enumerate(caps):
            if c.vec is not None:
                key = (c.vec.device, c.form, c.exp_bits if c.form is _SMALL else 0)
                groups.setdefault(key, []).append(i)
        made = []                  # (device, matrix, what it holds, capture indices)
        for (device, f, e), idx in groups.items():
            vecs = [caps[i].vec for i in idx]
            if f is Form.SMALL:
                engine = self.engines.for_tensor(vecs[0])
                try:
                    made.append((device, engine.reduce_many(vecs, e), Holds.SUMMARY, idx))
                except Exception as err:     # the guard: these captures' statistics are dropped
                    self._fault(EngineFailed(err, vecs[0]), "statistics",
                                f"{len(idx)} small tensors", len(idx))
                    for i in idx:
                        caps[i].form, caps[i].vec = Form.COUNT, None
                continue
            made.append((device, torch.stack(vecs), _HOLDS[f], idx))
        metas = [Meta(c.order, c.kind, c.name, c.micro, c.numel) for c in caps]
        blocks, parts, start = [], [], 0
        for device in dict.fromkeys(d for d, *_ in made):
            mine = [b for b in made if b[0] == device]
            for _, mat, holds, idx in mine:
                for row, i in enumerate(idx):
                    c = caps[i]
                    metas[i] = Meta(c.order, c.kind, c.name, c.micro, c.numel, len(blocks), row)
                blocks.append(Block(holds, mat.shape[0], mat.shape[1], start))
                start += mat.numel()
            mats = [mat.reshape(-1) for _, mat, *_ in mine]
            parts.append(self.to_host(mats[0] if len(mats) == 1 else torch.cat(mats)))
        for c in caps:
            c.vec = None
        return metas, blocks, Packed(parts) if parts else None

    def to_host(self, flat: torch.Tensor) -> Snapshot:
        """A float64 vector's host copy, started now: on CUDA into a pinned slot on
        the current stream, with an event that the writer waits for (the vector's
        memory is reused only after the copy, on the same stream); elsewhere, a copy
        (none on the CPU)."""
        flat = flat.to(torch.float64)
        if flat.device.type == "cuda":
            return self.stager.pinned_copy(flat)
        return Snapshot(flat if flat.device.type == "cpu" else flat.to("cpu"))
