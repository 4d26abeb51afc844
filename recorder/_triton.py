"""The CUDA statistics engine: one fused Triton pass per tensor.

One kernel reads each element once and produces everything a summary vector
needs (``_summary``'s layout, the same numbers as the CPU engine):

- the NaN-safe sums around the tensor's first element, in float64 lanes as
  on the CPU (a float32 ``x - shift`` loses digits when the mean is far from
  zero; the pass stays memory-bound, so float64 costs nothing measurable on an
  H100, an estimate still to be measured),
  minimum and maximum of the finite values;
- the histogram codes of ``histogram.encode``, counted with relaxed atomics into
  one of ``SLICES`` slices (program ``p`` counts into slice ``p % SLICES``,
  so a run of equal codes, the zeros of a ReLU, contends within a few
  programs, never across the GPU); the slices are summed at the end.

A fixed grid of programs strides over the tensor.  The slices (``SLICES x
codes`` int32, 263 KB) and the programs' partial sums are a scratch kept per
device and stream and zeroed by one memset per tensor, so a tensor costs its
own read, not a histogram buffer's.  Nothing is read back to the host: the
vector stays on the device until the step's one copy.

float64 tensors take the torch kernels (``_engine.Engine``: their sums scaled
where their magnitudes ask for it), and so do the 8-bit floats (widened a piece
at a time: a whole widened copy would be four times the tensor) and a step's
tiny tensors (batched, ``reduce_many``).  Triton runs on CPU tensors too under
``TRITON_INTERPRET=1``, which is how CI tests this engine against the CPU one.

The engine registers itself in the family ``"triton"`` (``_engine``);
``_engines.ORDER`` says where it stands in the demotion order, and imports
this module only when a chain reaches it.

Training thread (and autograd's threads); ``warm`` compiles the kernel on a
background thread of its own (``_compiler``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import torch
import triton
import triton.language as tl

from . import histogram
from ._engine import Engine
from ._quiet import quiet
from ._summary import NARROW, shift_of

__all__ = ["TritonEngine"]

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _compiler() -> concurrent.futures.ThreadPoolExecutor:
    """The one background thread that compiles the Triton kernel before it is
    needed (Triton's compiler, unlike ``torch.compile``, sets no process-wide flag)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensortape-compile")
    return _pool


_RAW = histogram.raw_codes(8)                 # float32 codes (16-bit floats are coded as float32)
_WIDTH = histogram.code_width(8)
_SHIFT = histogram.code_shift(8)


@triton.jit
def _as_float32(raw, BF16: tl.constexpr):
    """Loaded elements as float32; bfloat16 arrives as its int16 bits and is
    widened by a shift (exact, subnormals included, on any backend)."""
    if BF16:
        return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


@triton.jit
def _summary_kernel(x_ptr, n, shift_ptr, parts_ptr, hist_ptr, BLOCK: tl.constexpr, RAW: tl.constexpr,
                    WIDTH: tl.constexpr, SHIFT: tl.constexpr, BF16: tl.constexpr,
                    SLICES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)       # 64-bit offsets: n may pass 2**31
    programs = tl.num_programs(0).to(tl.int64)
    inf = float("inf")
    shift64 = tl.load(shift_ptr)                      # ``_summary.shift_of``: float64
    acc_s = tl.zeros([BLOCK], dtype=tl.float64)       # float64 lanes: x - shift is exact there
    acc_q = tl.zeros([BLOCK], dtype=tl.float64)
    acc_lo = tl.full([BLOCK], inf, dtype=tl.float32)
    acc_hi = tl.full([BLOCK], -inf, dtype=tl.float32)
    lanes = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + lanes
        inside = offs < n
        v = _as_float32(tl.load(x_ptr + offs, mask=inside, other=0), BF16)
        finite = inside & (v == v) & (tl.abs(v) != inf)
        d = tl.where(finite, v.to(tl.float64) - shift64, 0.0)
        acc_s += d
        acc_q += d * d
        acc_lo = tl.minimum(acc_lo, tl.where(finite, v, inf))
        acc_hi = tl.maximum(acc_hi, tl.where(finite, v, -inf))
        bits = v.to(tl.int32, bitcast=True)
        code = (bits >> SHIFT) & (RAW - 1)
        code = tl.where(v == 0.0, RAW + (bits < 0).to(tl.int32), code)
        code = tl.where(v == inf, RAW + 2, code)
        code = tl.where(v == -inf, RAW + 3, code)
        tl.atomic_add(hist_ptr + (pid % SLICES) * WIDTH + code, 1, mask=inside, sem="relaxed")
    tl.store(parts_ptr + pid * 4 + 0, tl.sum(acc_s, axis=0))
    tl.store(parts_ptr + pid * 4 + 1, tl.sum(acc_q, axis=0))
    tl.store(parts_ptr + pid * 4 + 2, tl.min(acc_lo, axis=0).to(tl.float64))
    tl.store(parts_ptr + pid * 4 + 3, tl.max(acc_hi, axis=0).to(tl.float64))


class TritonEngine(Engine):
    """Accelerator statistics in one fused pass (falls back to the torch kernels
    for float64, the 8-bit floats and a step's tiny tensors)."""

    family = "triton"
    BLOCK = 1024
    SLICES = 32

    def __init__(self, device_type: str, compile: bool):
        super().__init__(device_type, compile)
        self._programs: dict = {}
        self._scratch: dict = {}

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Also compile the Triton kernel for ``dtype`` in the background: one
        launch on a small tensor there."""
        super().warm(dtype, device)
        if device.type == "cuda" and dtype in (torch.float32, torch.float16, torch.bfloat16):
            _compiler().submit(self._launch_once, dtype, device)

    def _launch_once(self, dtype: torch.dtype, device: torch.device) -> None:
        try:
            self.reduce(torch.zeros(2 * self.BLOCK, dtype=dtype, device=device))
        except Exception:                # the first capture will meet it, under the guard
            pass

    def _buffers(self, x: torch.Tensor, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The partial sums and the zeroed histogram slices, kept per device, stream
        and thread (stream order makes a reuse safe: the last tensor's sums were
        read by kernels queued before this one's; backward may run on another
        thread)."""
        stream = torch.cuda.current_stream(x.device) if x.device.type == "cuda" else None
        key = (x.device, stream, threading.get_ident())
        scratch = self._scratch.get(key)
        if scratch is None:
            scratch = self._scratch[key] = (
                torch.empty((self._grid_cap(x), 4), dtype=torch.float64, device=x.device),
                torch.empty((self.SLICES, _WIDTH), dtype=torch.int32, device=x.device))
        parts, hist = scratch
        hist.zero_()
        return parts[:grid], hist

    def _grid(self, x: torch.Tensor) -> int:
        return max(1, min(self._grid_cap(x), triton.cdiv(x.numel(), self.BLOCK)))

    def _grid_cap(self, x: torch.Tensor) -> int:
        cap = self._programs.get(x.device)
        if cap is None:
            if x.device.type == "cuda":
                sms = torch.cuda.get_device_properties(x.device).multi_processor_count
                cap = 4 * sms
            else:                       # the interpreter: few programs, it runs them one by one
                cap = 8
            self._programs[x.device] = cap
        return cap

    @torch.compiler.disable
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64 or x.dtype in NARROW:     # the torch kernels
            return super().reduce(x)
        if not x.is_contiguous():
            x = x.contiguous()
        n, grid = x.numel(), self._grid(x)
        parts, hist = self._buffers(x, grid)
        bf16 = x.dtype == torch.bfloat16
        shift = shift_of(x)
        where = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
        with where, quiet():            # on the tensor's device; Triton's own warnings (its
            # compile, at the first launch) never fail the kernel (``_quiet``)
            _summary_kernel[(grid,)](x.view(torch.int16) if bf16 else x, n, shift.reshape(1), parts, hist,
                                     BLOCK=self.BLOCK, RAW=_RAW, WIDTH=_WIDTH, SHIFT=_SHIFT,
                                     BF16=bf16, SLICES=self.SLICES)
        head = torch.stack([torch.full((), n, dtype=torch.float64, device=x.device), shift,
                            parts[:, 0].sum(), parts[:, 1].sum(), parts[:, 2].min(),
                            parts[:, 3].max()])
        return torch.cat([head, self.to_slots(hist.sum(0, dtype=torch.int64), 8)])
