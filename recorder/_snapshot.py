"""Faithful copies taken at capture time, so later in-place ops change nothing."""

from __future__ import annotations

import torch

__all__ = ["Snapshot"]


class Snapshot:
    """A host copy of a tensor; on CUDA an async copy into pinned memory."""

    __slots__ = ("_host", "_event", "nbytes")

    def __init__(self, t: torch.Tensor, max_samples: int | None, dtype: torch.dtype | None):
        t = t.detach()
        if max_samples is not None and t.dim() > 0:
            t = t[:max_samples]
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if t.device.type == "cpu":
            self._host = t.clone(memory_format=torch.contiguous_format)
            self._event = None
        else:
            pin = t.device.type == "cuda"
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._host.copy_(t, non_blocking=pin)
            self._event = None
            if pin:
                self._event = torch.cuda.Event()
                self._event.record()
        self.nbytes = self._host.numel() * self._host.element_size()

    def host(self) -> torch.Tensor:
        """The copy, once it has landed (waits for the device copy if needed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
