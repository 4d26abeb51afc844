"""Faithful copies taken at capture time, and the memory they live in.

On the CPU a snapshot is a copy into host memory reused step to step
(``_hostpool.HostPool``).  On an accelerator (CUDA) the ``Stager``
takes it in two moves that never block the training thread:

1. a device-side clone on the compute stream, ordered before any later
   in-place op on the tensor (so the copy is faithful), at device bandwidth;
2. a copy of that clone into a pinned host slot on a side stream, which waits
   for the clone and then overlaps with the rest of the step's compute.  The
   clone is marked as used by the side stream (``record_stream``) and dropped
   at once: the caching allocator reuses its memory only after the copy.

The stager bounds both memories, never by waiting: the device bytes of the
clones whose copies are still in flight (``max_device_bytes``) and the pinned
host bytes of its slots (``max_pinned_bytes``).  A snapshot that would pass a
cap is not taken; the capture's full tensor is dropped and counted with the
reason, and its statistics are kept.  Pinned slots come from a pool that grows
up to its cap and reuses its slots (by power-of-two size); the writer gives a
slot back once it has stored the tensor, and the ring keeps its steps in
ordinary host memory (``Snapshot.unpin``, a copy into the host pool), so the
pinned pool only holds what is on its way to the writer.

How the copies are made is a ``Copies`` object per device type (``CudaCopies``
for CUDA); a test can install a fake one for the CPU and check the caps there.
"""

from __future__ import annotations

import collections
import threading

import torch

from ._hostpool import HostPool

__all__ = ["Snapshot", "Stager", "unstorable"]

DEVICE_CAP = "device memory for snapshots full (max_device_bytes)"
PINNED_CAP = "pinned memory for snapshots full (max_pinned_bytes)"
MIN_SLOT = 1 << 12

# dtypes whose full tensors the store holds (bfloat16 and float8 as their bits, complex32
# widened to complex64; see ``_layout.to_numpy``)
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


class CudaCopies:
    """How a CUDA tensor is copied to a pinned slot without waiting."""

    def __init__(self):
        self._side: dict = {}

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def start(self, t: torch.Tensor, host: torch.Tensor):
        """Clone ``t`` on its stream, copy the clone into ``host`` on a side stream;
        the event that says the copy is done."""
        clone = t.clone(memory_format=torch.contiguous_format)
        side = self._side.get(t.device)
        if side is None:
            side = self._side[t.device] = torch.cuda.Stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(clone, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        clone.record_stream(side)         # its memory is reused only after the copy
        return event

    @staticmethod
    def done(event) -> bool:
        return event.query()

    @staticmethod
    def wait(event) -> None:
        event.synchronize()


COPIES: dict[str, object] = {"cuda": CudaCopies()}


class Stager:
    """The memory of a recording's snapshots: device bytes in flight and a pool
    of pinned slots, each under its cap (see the module)."""

    def __init__(self, max_device_bytes: int = 1 << 30, max_pinned_bytes: int = 2 << 30,
                 max_host_bytes: int = 1 << 30):
        self.pool = HostPool(max_host_bytes)   # ordinary host memory: CPU snapshots, the ring
        self.max_device_bytes = max_device_bytes
        self.max_pinned_bytes = max_pinned_bytes
        self._lock = threading.Lock()
        self._flight: collections.deque = collections.deque()   # (copies, event, nbytes)
        self.device_bytes = 0
        self.pinned_bytes = 0                 # every slot the pool holds, free or in use
        self._free: dict[int, list[torch.Tensor]] = {}
        # slots given back, taken into the pool under the lock; a deque, so that giving
        # one back never takes the lock (a snapshot's finaliser may run inside ``take``)
        self._returned: collections.deque = collections.deque()

    def take(self, t: torch.Tensor, max_samples: int | None,
             dtype: torch.dtype | None) -> "Snapshot | str":
        """A snapshot of a detached ``t``, or the reason none was taken (a cap)."""
        if max_samples is not None and t.dim() > 0:
            t = t[:max_samples]
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if t.is_cpu and "cpu" not in COPIES:
            return Snapshot(self.pool.copy(t))
        copies = COPIES.get(t.device.type)
        if copies is None:
            return Snapshot(t.to("cpu", copy=True))
        nbytes = t.numel() * t.element_size()
        with self._lock:
            self._reclaim()
            if self.device_bytes + nbytes > self.max_device_bytes:
                return DEVICE_CAP
            slot = self._slot(copies, nbytes)
            if slot is None:
                return PINNED_CAP
            self.device_bytes += nbytes
        host = slot[:nbytes].view(t.dtype).view(t.shape) if nbytes else \
            torch.empty(t.shape, dtype=t.dtype)
        try:
            event = copies.start(t, host)
        except BaseException:                  # nothing in flight: the bytes are free again
            with self._lock:
                self.device_bytes -= nbytes
            self.give_back(slot)
            raise
        with self._lock:
            self._flight.append((copies, event, nbytes))
        return Snapshot(host, copies, event, self, slot)

    def pinned_copy(self, flat: torch.Tensor) -> "Snapshot":
        """A CUDA vector's copy into a pinned slot, on its stream, with an event (a
        step's summaries); past the cap, a pinned buffer of its own (they are small)."""
        copies = COPIES["cuda"]
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            self._reclaim()
            slot = self._slot(copies, nbytes)
        own = slot if slot is not None else copies.pinned(max(nbytes, 1))
        host = own[:nbytes].view(flat.dtype)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
        return Snapshot(host, copies, event, self if slot is not None else None, slot)

    def _reclaim(self) -> None:
        """Forget the copies that are done (their clones' memory is free again), and
        take the slots given back into the pool (lock held)."""
        while self._returned:
            slot, reusable = self._returned.popleft()
            if reusable:
                self._free.setdefault(slot.numel(), []).append(slot)
            else:
                self.pinned_bytes -= slot.numel()
        while self._flight and self._flight[0][0].done(self._flight[0][1]):
            _, _, n = self._flight.popleft()
            self.device_bytes -= n

    def _slot(self, copies, nbytes: int) -> torch.Tensor | None:
        """A pinned slot of at least ``nbytes`` (lock held), or None past the cap."""
        size = max(MIN_SLOT, 1 << max(nbytes - 1, 0).bit_length())
        free = self._free.get(size)
        if free:
            return free.pop()
        if self.pinned_bytes + size > self.max_pinned_bytes:
            for other, slots in self._free.items():      # give back free slots of other sizes
                while slots and self.pinned_bytes + size > self.max_pinned_bytes:
                    slots.pop()
                    self.pinned_bytes -= other
            if self.pinned_bytes + size > self.max_pinned_bytes:
                return None
        self.pinned_bytes += size
        return copies.pinned(size)

    def give_back(self, slot: torch.Tensor, reusable: bool = True) -> None:
        """A slot the writer is done with; one whose copy may still be landing is
        not reused (torch frees it after the copy) and leaves the pool.  It never
        waits for the lock: the pool takes it in at its next use."""
        self._returned.append((slot, reusable))


class Snapshot:
    """A host copy of a tensor; on an accelerator an asynchronous one in a pinned
    slot (see the module)."""

    __slots__ = ("_host", "_copies", "_event", "_stager", "_slot", "nbytes")

    def __init__(self, host: torch.Tensor, copies=None, event=None, stager: Stager | None = None,
                 slot: torch.Tensor | None = None):
        self._host, self._copies, self._event = host, copies, event
        self._stager, self._slot = stager, slot
        self.nbytes = host.numel() * host.element_size()

    def host(self) -> torch.Tensor:
        """The copy, once it has landed (waits for the device copy: the writer does)."""
        if self._event is not None:
            self._copies.wait(self._event)
            self._event = None
        return self._host

    def local(self) -> torch.Tensor | None:
        """The copy when it is already whole in ordinary host memory (a CPU clone),
        else None: a tiny capture's summary reads it instead of a copy of its own."""
        return self._host if self._event is None and self._slot is None else None

    def unpin(self) -> None:
        """Move the copy into ordinary host memory and give its pinned slot back
        (the ring's steps live there)."""
        if self._slot is not None:
            host = self._stager.pool.copy(self.host())
            self.release()
            self._host = host

    def release(self) -> None:
        """Give the pinned slot back once the copy is read (the writer has stored it)."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self._host = None
            if self._stager is not None:
                self._stager.give_back(slot, self._event is None)

    def __del__(self):                  # a snapshot never stored: never waits for its copy
        try:
            if self._event is not None and self._copies.done(self._event):
                self._event = None
            self.release()
        except Exception:
            pass
