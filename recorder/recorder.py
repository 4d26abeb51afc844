"""The Recorder: hooks chosen layers of a model and records them step by step."""

from __future__ import annotations

import collections
import os
import threading
import warnings
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
from torch import nn

from . import format as fmt
from .config import RecorderConfig
from .errors import InspectionError, NonFiniteError
from .hooks import HookSet
from .selection import select_layers, unwrap
from .snapshot import Snapshot
from .store import RunStore, check_mode, open_root
from .summary import finalize_layers, is_small, nonfinite, reduce, reduce_many
from .writer import StepRecord, Writer

__all__ = ["Recorder"]

MAX_EVENTS = 1000


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_ranks_then(world: int, error: BaseException | None) -> None:
    """Wait for every rank (under torch.distributed), then raise ``error`` if any."""
    if world > 1:
        torch.distributed.barrier()
    if error is not None:
        raise error


class _Capture:
    __slots__ = ("order", "kind", "name", "vec", "small", "light", "snap", "ref")

    def __init__(self, order, kind, name, vec, small, light, snap, ref):
        self.order, self.kind, self.name = order, kind, name
        self.vec, self.small, self.light, self.snap, self.ref = vec, small, light, snap, ref


class _StepScope:
    """What ``rec.step()`` returns: ending it ends the step."""

    def __init__(self, rec: "Recorder"):
        self._rec = rec

    def __enter__(self):
        return self._rec

    def __exit__(self, exc_type, exc, tb):
        self._rec._end_step(raise_nonfinite=exc_type is None)
        return False


class Recorder:
    """Record activations and gradients of chosen layers into a Zarr store.

    See the README and ``shared/SPEC.md`` for every argument.  Beyond the
    SPEC: ``flush_interval`` (seconds between commits, default 5),
    ``max_pending_bytes`` (snapshot bytes queued for the writer before the
    training thread waits, default 1 GiB) and ``compression`` of full tensors
    (``"auto"``: zstd level 1 where it shrinks an array's first step by 10% or
    more, else zstd's fast mode; or a zstd level for every array; or ``None``).
    """

    def __init__(self, model: nn.Module, store, *, layers="*",
                 capture=("activations", "gradients"), tensors_every=1, stats_every=1, ring=0,
                 on_nonfinite="record", max_samples=None, tensor_dtype=None, mode="w-",
                 metadata=None, flush_interval=5.0, max_pending_bytes=1 << 30,
                 compression="auto"):
        self.config = RecorderConfig.build(
            capture=capture, tensors_every=tensors_every, stats_every=stats_every, ring=ring,
            on_nonfinite=on_nonfinite, max_samples=max_samples, tensor_dtype=tensor_dtype,
            mode=mode, flush_interval=flush_interval, max_pending_bytes=max_pending_bytes,
            compression=compression)
        self.metadata = fmt.to_json(metadata or {})
        self.store_location = store if isinstance(store, str) else os.fspath(store)
        self.layers = select_layers(model, layers)
        self.rank, self._world = _rank_and_world()
        self._model_class = type(unwrap(model)).__qualname__
        self._hooks = HookSet(model, self.layers, self.config.capture, self._on_capture,
                              self._current_token)
        error = None
        try:
            check_mode(self.store_location, self.config.mode)   # before any hook
        except Exception as e:        # raised after the barrier, so no other rank hangs
            error = e
        _all_ranks_then(self._world, error)      # every rank looks before rank 0 creates
        self._writer: Writer | None = None
        self._closed = False
        self._step: int | None = None
        self._last_step: int | None = None
        self._token: object | None = None
        self._captures: list[_Capture] = []
        self._lock = threading.Lock()
        self._order = 0
        self._layers: dict[str, None] = {}
        self._events: list[dict] = []
        self._events_total = 0
        self._ring: collections.deque = collections.deque(maxlen=self.config.ring or None)
        self.dropped = 0
        self._warned_dropped = False

    # --- lifecycle ------------------------------------------------------------
    def attach(self) -> "Recorder":
        if self._closed:
            raise InspectionError("this Recorder is closed; create a new one to record again")
        if self._writer is not None:
            return self
        cfg = self.config
        root, error = None, None
        if self.rank == 0:                        # applies the mode to the run as a whole
            try:
                root = open_root(self.store_location, cfg.mode)
            except Exception as e:
                error = e
        _all_ranks_then(self._world, error)
        if root is None:
            root = open_root(self.store_location, cfg.mode, self.rank)
        store = RunStore(root, self.rank, cfg.compression)
        state = store.state if cfg.mode == "a" else {}
        state.update(rank=self.rank)
        self._layers = dict.fromkeys(state.get("layers", []))
        self._events = list(state.get("events", []))
        self._events_total = int(state.get("events_total", len(self._events)))
        self.dropped = int(state.get("dropped", 0))
        self._last_step = state.get("last_step")
        root_attrs = None
        if self.rank == 0:
            root_attrs = dict(root.attrs) if cfg.mode == "a" else {}
            root_attrs.update(
                tensortape_format=fmt.FORMAT_VERSION, status=fmt.STATUS_RECORDING,
                torch_version=torch.__version__, model_class=self._model_class,
                config=cfg.to_json(), metadata=self.metadata or root_attrs.get("metadata", {}),
                layers=list(self._layers), events=self._events, dropped=self.dropped)
            root_attrs.setdefault("created", datetime.now(timezone.utc).isoformat())
            store.commit(state, root_attrs)
        self._writer = Writer(store, state, root_attrs, cfg.flush_interval, cfg.max_pending_bytes)
        self._hooks.attach()
        return self

    def close(self, status: str = fmt.STATUS_COMPLETE) -> None:
        """End any open step, flush everything, and remove every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._step is not None:
                self._end_step(raise_nonfinite=False)
        finally:
            self._hooks.detach()
            self._ring.clear()
            if self._writer is not None:
                try:
                    self._writer.flush(status=status, final=True, state=dict(
                        layers=list(self._layers), events=list(self._events),
                        events_total=self._events_total, dropped=self.dropped))
                finally:
                    self._writer.close()

    def __enter__(self) -> "Recorder":
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(fmt.STATUS_INTERRUPTED if exc_type is not None else fmt.STATUS_COMPLETE)
        return False

    def __del__(self):
        hooks = getattr(self, "_hooks", None)
        if hooks is not None:
            hooks.detach()

    # --- steps ----------------------------------------------------------------
    def step(self, i: int | None = None) -> _StepScope:
        """Begin step ``i`` (default: the previous step plus 1, from 0)."""
        if self._writer is None:
            if self._closed:
                raise InspectionError("this Recorder is closed; create a new one to record again")
            self.attach()
        if self._step is not None:
            self._end_step(raise_nonfinite=True)
        if i is None:
            i = 0 if self._last_step is None else self._last_step + 1
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise InspectionError(f"step {i!r} is not an integer; call rec.step() or rec.step(int)")
        self._step, self._token = int(i), object()
        self._captures, self._order = [], 0
        self._hooks.new_step()
        return _StepScope(self)

    def flush(self) -> None:
        """Block until every finished step is written and committed."""
        if self._writer is not None:
            self._writer.flush()

    def _current_token(self) -> object:
        if self._token is None:
            raise InspectionError(
                "a hooked layer ran outside a step; wrap forward and backward in "
                "`with rec.step():` (or call rec.step() before them)")
        return self._token

    # --- capture (hook side) --------------------------------------------------
    def _on_capture(self, kind: str, name: str, tensor: torch.Tensor, token: object) -> None:
        if token is not self._token:
            self._drop(name)
            return
        cfg, step = self.config, self._step
        keep = cfg.persists(step) or cfg.ring > 0 or cfg.on_nonfinite != "record"
        snap = Snapshot(tensor, cfg.max_samples, cfg.tensor_dtype) if keep else None
        vec = small = light = ref = None
        if cfg.stats_at(step) and is_small(tensor):
            small = tensor.detach().clone()    # summarised with the step's other tiny tensors
        elif cfg.stats_at(step):
            vec = reduce(tensor)
        elif tensor.is_floating_point():
            light = tensor.detach().sum().reshape(1).to(torch.float64)
            exact_snap = snap is not None and cfg.max_samples is None and cfg.tensor_dtype is None
            ref = None if exact_snap else tensor.detach()
        with self._lock:
            self._captures.append(_Capture(self._order, kind, name, vec, small, light, snap, ref))
            self._order += 1
            if name not in self._layers:
                self._layers[name] = None

    def _drop(self, name: str) -> None:
        self.dropped += 1
        if not self._warned_dropped:
            self._warned_dropped = True
            warnings.warn(f"tensortape: the gradient of {name!r} arrived after its step ended and "
                          f"was dropped; run backward inside the step (`with rec.step(): ...`)",
                          stacklevel=2)

    # --- end of step ----------------------------------------------------------
    def _end_step(self, raise_nonfinite: bool) -> None:
        step, cfg = self._step, self.config
        if step is None:
            return
        try:
            if "weight_grads" in cfg.capture:
                for name, g in self._hooks.weight_grads():
                    self._on_capture("weight_grads", name, g, self._token)
        finally:
            self._token = None
            self._step = None
            self._last_step = step
        caps = sorted(self._captures, key=lambda c: (c.kind in fmt.BACKWARD_KINDS, c.order))
        self._captures = []
        rec = StepRecord(step)
        events = self._summaries(caps, rec)
        persist = cfg.persists(step)
        dump = bool(events) and cfg.on_nonfinite in ("dump", "raise")
        if dump:
            for old_step, old_caps in list(self._ring):
                if old_caps is not None:
                    self._put(StepRecord(old_step), old_caps)
            self._ring = collections.deque(((s, None) for s, _ in self._ring), maxlen=self._ring.maxlen)
        self._put(rec, caps if (persist or dump) else [])
        if cfg.ring:
            self._ring.append((step, None if (persist or dump) else caps))
        if events and cfg.on_nonfinite == "raise":
            self._writer.flush()
            if raise_nonfinite:
                e = events[0]
                raise NonFiniteError(
                    f"step {step}: {e['kind']} of layer {e['layer']!r} holds {e['nan']} NaN, "
                    f"{e['posinf']} +Inf and {e['neginf']} -Inf values (first of {len(events)} "
                    f"non-finite captures in this step); the ring and this step were dumped")

    def _summaries(self, caps: list[_Capture], rec: StepRecord) -> list[dict]:
        """Move every summary to the host at once, then find non-finite captures."""
        smalls = [c for c in caps if c.small is not None]
        for c, vec in zip(smalls, reduce_many([c.small for c in smalls])):
            c.vec, c.small = vec, None
        parts = [c.vec if c.vec is not None else c.light for c in caps
                 if c.vec is not None or c.light is not None]
        flat = torch.cat(parts).cpu().numpy() if parts else np.zeros(0)
        pos, events = 0, []
        stats_caps = []
        for c in caps:
            if c.vec is not None:
                n = c.vec.numel()
                vec = flat[pos: pos + n]
                pos += n
                stats_caps.append((c, vec))
            elif c.light is not None:
                pos += 1
                if not np.isfinite(flat[pos - 1]):
                    src = c.ref if c.ref is not None else c.snap.host()
                    vec = reduce(src).cpu().numpy()
                else:
                    vec = None
            else:
                vec = None
            c.vec = c.light = c.ref = None
            bad = nonfinite(vec) if vec is not None else (0, 0, 0)
            if any(bad):
                events.append({"step": rec.step, "layer": c.name, "kind": c.kind,
                               "nan": bad[0], "posinf": bad[1], "neginf": bad[2], "order": c.order,
                               "phase": "backward" if c.kind in fmt.BACKWARD_KINDS else "forward"})
        per_kind: dict[str, list] = {}
        for c, vec in stats_caps:
            per_kind.setdefault(c.kind, []).append((c.name, vec))
        rec.stats = {kind: finalize_layers(entries) for kind, entries in per_kind.items()}
        self._events_total += len(events)
        room = MAX_EVENTS - len(self._events)
        self._events.extend(events[:max(room, 0)])
        return events

    def _put(self, rec: StepRecord, caps: list[_Capture]) -> None:
        for c in caps:
            if c.snap is not None:
                rec.tensors.append((c.kind, c.name, c.snap))
                rec.nbytes += c.snap.nbytes
        if not rec.stats and not rec.tensors:
            return
        self._writer.put(rec, list(self._layers), self._events, self._events_total, self.dropped)
