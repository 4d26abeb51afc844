"""Faithful copies taken at capture time, so later in-place ops change nothing.

On the CPU a snapshot is a clone.  On CUDA it is taken in two moves that never
block the training thread:

1. a device-side clone on the compute stream, ordered before any later
   in-place op on the tensor (so the copy is faithful), at device bandwidth;
2. a copy of that clone into pinned host memory on a side stream, which waits
   for the clone and then overlaps with the rest of the step's compute.

Pinned host buffers come from torch's caching host allocator, which reuses
them.  The device clones in flight are bounded (``MAX_IN_FLIGHT`` bytes): past
it, the oldest copies are waited for.  The writer waits for each copy (its
event) before reading it.
"""

from __future__ import annotations

import collections
import threading

import torch

__all__ = ["Snapshot", "unstorable"]

MAX_IN_FLIGHT = 2 << 30
_side: dict = {}
_in_flight: collections.deque = collections.deque()   # (event, nbytes), oldest first
_in_flight_bytes = 0
_lock = threading.Lock()


# dtypes whose full tensors the store holds (bfloat16 and float8 as their bits, complex32
# widened to complex64; see ``_store.to_numpy``)
STORABLE = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                                 "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
      if hasattr(torch, n))})


def unstorable(t: torch.Tensor) -> str | None:
    """Why the full tensor ``t`` cannot be stored (a drop reason), or None."""
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} tensors cannot be stored"
    if t.dtype not in STORABLE:
        return f"{str(t.dtype).removeprefix('torch.')} tensors cannot be stored"
    return None


def _side_stream(device: torch.device):
    stream = _side.get(device)
    if stream is None:
        stream = _side[device] = torch.cuda.Stream(device)
    return stream


class Snapshot:
    """A host copy of a tensor; on CUDA an asynchronous one (see the module)."""

    __slots__ = ("_host", "_event", "_clone", "nbytes")

    def __init__(self, t: torch.Tensor, max_samples: int | None, dtype: torch.dtype | None):
        t = t.detach()
        if max_samples is not None and t.dim() > 0:
            t = t[:max_samples]
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        self._event = self._clone = None
        if t.device.type == "cpu":
            self._host = t.clone(memory_format=torch.contiguous_format)
        elif t.device.type == "cuda":
            self._clone = t.clone(memory_format=torch.contiguous_format)
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            side = _side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                self._host.copy_(self._clone, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(side)
            _track(self._event, self._clone.numel() * self._clone.element_size())
        else:
            self._host = t.to("cpu", copy=True)
        self.nbytes = self._host.numel() * self._host.element_size()

    def host(self) -> torch.Tensor:
        """The copy, once it has landed (waits for the device copy if needed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._clone = None
        return self._host


def _track(event, nbytes: int) -> None:
    """Count a copy in flight; past the bound, wait for the oldest ones."""
    global _in_flight_bytes
    with _lock:
        _in_flight.append((event, nbytes))
        _in_flight_bytes += nbytes
        while _in_flight and (_in_flight[0][0].query() or _in_flight_bytes > MAX_IN_FLIGHT):
            old, n = _in_flight.popleft()
            old.synchronize()
            _in_flight_bytes -= n
