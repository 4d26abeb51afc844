"""Host memory for snapshots, reused step to step.

A recording takes the same tensors every step, and its snapshots live a few
steps (the ring, the writer's inbox, a chunk write in flight) before they are
let go.  ``HostPool.copy`` copies a CPU tensor of ``MIN_BYTES`` or more into a
buffer of its (dtype, shape) that nothing holds any more (``copy_``), instead
of a fresh clone, whose pages the allocator may have to fault in afresh (a
large block is mapped anew each time); a smaller tensor is cloned.

**Never reused while held.**  A buffer is idle only when nothing but the pool
refers to it: no Python reference to the tensor the pool lent (a snapshot, a
capture's vector, a step record, the ring) and no other tensor or numpy array
on its memory (a view, a dtype view, an array a chunk write still holds: each
keeps the storage).  Both are counted by the runtime itself, on whichever
thread lets go, so nothing has to give a buffer back; the pool only looks.
Each (dtype, shape) keeps its buffers in the order lent, and looks at the
oldest few.

**Bounded.**  Buffers lent and idle come to at most ``max_bytes`` in all;
past it the idle ones of every shape are let go, and a copy that still does
not fit is a plain clone, as without the pool.  Where the runtime does not
say how many tensors share a storage, every copy is a plain clone.

Training thread and autograd's threads (``copy``, under a lock); the buffers
are let go on any thread.
"""

from __future__ import annotations

import collections
import sys
import threading

import torch

__all__ = ["HostPool"]

_PROBES = 3                      # buffers of one shape looked at per copy, oldest first
# smaller tensors are cloned: their copy costs what a clone does (allocation is cheap there), and
# the pool's bookkeeping would cost more (docs/PERFORMANCE.md, "Snapshots in reused memory")
MIN_BYTES = 1 << 20
# how many tensors share a storage (torch's own, as its CUDA graph trees ask it)
_shared = getattr(torch._C, "_storage_Use_Count", None)


class HostPool:
    """Host buffers for snapshots, reused once idle (see the module)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0                          # every buffer the pool holds, lent or idle
        self._lock = threading.Lock()
        # (dtype, shape) -> deque of (buffer, its storage), the oldest lent first
        self._shapes: dict[tuple, collections.deque] = {}

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU tensor ``t``: in an idle buffer when there
        is one (else a new one, within ``max_bytes``), or a clone (below ``MIN_BYTES``,
        past ``max_bytes``)."""
        if t.numel() * t.element_size() < MIN_BYTES:
            return t.clone(memory_format=torch.contiguous_format)
        key = (t.dtype, t.shape)
        buf = None
        with self._lock:
            bufs = self._shapes.get(key)
            for _ in range(min(_PROBES, len(bufs or ()))):
                entry = bufs[0]
                bufs.rotate(-1)                 # the oldest becomes the newest
                if _idle(entry):
                    buf = entry[0]              # lent: this frame holds it from now on
                    break
            else:
                buf = self._new(key, t)
        return buf.copy_(t) if buf is not None else t.clone(memory_format=torch.contiguous_format)

    def _new(self, key: tuple, t: torch.Tensor) -> torch.Tensor | None:
        """A new buffer for ``t``, lent (lock held); None past ``max_bytes`` (or
        where the pool cannot tell an idle buffer, or ``t`` is empty)."""
        nbytes = t.numel() * t.element_size()
        if _shared is None or not nbytes:
            return None
        if self.bytes + nbytes > self.max_bytes:
            self._let_go()
            if self.bytes + nbytes > self.max_bytes:
                return None
        buf = torch.empty(t.shape, dtype=t.dtype)
        self._shapes.setdefault(key, collections.deque()).append((buf, buf.untyped_storage()))
        self.bytes += nbytes
        return buf

    def _let_go(self) -> None:
        """Drop the idle buffers of every shape (lock held)."""
        for key, bufs in list(self._shapes.items()):
            kept = collections.deque()
            for entry in bufs:
                if _idle(entry):
                    self.bytes -= entry[1].nbytes()
                else:
                    kept.append(entry)
            if kept:
                self._shapes[key] = kept
            else:
                del self._shapes[key]


def _idle(entry: tuple) -> bool:
    """Whether nothing but the pool refers to a buffer: its tensor referred to by
    the pool's entry alone (and ``getrefcount``'s argument), its storage shared by
    that tensor and the entry's storage object alone."""
    return sys.getrefcount(entry[0]) == 2 and _shared(entry[1]._cdata) == 2
