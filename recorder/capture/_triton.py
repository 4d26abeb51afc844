"""The CUDA statistics engine: one fused Triton pass per tensor.

One kernel reads each element once and produces everything a summary vector
needs (``_summary``'s layout, the same numbers as the CPU engine):

- the NaN-safe sums around the tensor's first element, in float64 lanes as
  on the CPU (a float32 ``x - shift`` loses digits when the mean is far from
  zero; the pass stays memory-bound, so float64 costs nothing measurable on an
  H100, an estimate still to be measured),
  minimum and maximum of the finite values;
- the histogram codes of ``histogram.encode``.  Each program counts the codes of a
  window in its registers (``tl.histogram`` of ``LOCAL`` = 256 bins: the magnitudes of
  31 binades of each sign that end two binades above the largest finite one of the
  elements ``_shift`` samples, and ±0, ±Inf), then adds each count it has with one
  relaxed atomic into one of ``SLICES`` slices (program ``p`` into slice
  ``p % SLICES``); a code outside the window (a value far below or above the
  samples, a NaN) takes such an atomic at once.  The slices are summed at the end.  On an H200 this is 1.55x
  faster than an atomic an element (``HIST = 0``, kept to measure against:
  ``bench/bench_gpu.py``), and ``tl.histogram``'s cost grows with its bins.

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

from .. import histogram
from ._engine import Engine
from ..quiet import quiet
from ._summary import FIELDS, SHIFT_WINDOW, VECTOR

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
_OWN = (torch.float32, torch.float16, torch.bfloat16)     # the dtypes the kernels take


@triton.jit
def _as_float32(raw, BF16: tl.constexpr):
    """Loaded elements as float32; bfloat16 arrives as its int16 bits and is
    widened by a shift (exact, subnormals included, on any backend)."""
    if BF16:
        return ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


@triton.jit
def _shift(x_ptr, count, stride, BF16: tl.constexpr, WINDOW: tl.constexpr):
    """``_summary.shift_of`` of a contiguous tensor: the first finite one of its
    ``count`` elements ``stride`` apart, as float64 (0 if none is finite)."""
    i = tl.arange(0, WINDOW)
    inside = i < count
    v = _as_float32(tl.load(x_ptr + i.to(tl.int64) * stride, mask=inside, other=0), BF16)
    finite = inside & (v == v) & (tl.abs(v) != float("inf"))
    first = tl.min(tl.where(finite, i, WINDOW), axis=0)
    return tl.sum(tl.where(i == first, v.to(tl.float64), 0.0), axis=0)


@triton.jit
def _base(x_ptr, count, stride, BF16: tl.constexpr, WINDOW: tl.constexpr, SHIFT: tl.constexpr,
          HALF: tl.constexpr, SPAN: tl.constexpr):
    """The lowest magnitude code of the window counted in a program (``HIST == 2``):
    ``SPAN`` codes that end two binades above the largest finite one of the
    ``shift`` elements (codes outside it take the global atomics)."""
    i = tl.arange(0, WINDOW)
    inside = i < count
    v = _as_float32(tl.load(x_ptr + i.to(tl.int64) * stride, mask=inside, other=0), BF16)
    finite = inside & (v == v) & (tl.abs(v) != float("inf"))
    m = (v.to(tl.int32, bitcast=True) >> SHIFT) & (HALF - 1)
    top = tl.max(tl.where(finite, m, 0), axis=0)
    return tl.maximum(tl.minimum(top + 8, HALF) - SPAN, 0)


@triton.jit(do_not_specialize=["n", "count", "stride"])   # one compiled kernel per dtype
def _summary_kernel(x_ptr, n, count, stride, parts_ptr, hist_ptr, BLOCK: tl.constexpr,
                    RAW: tl.constexpr, WIDTH: tl.constexpr, SHIFT: tl.constexpr,
                    BF16: tl.constexpr, SLICES: tl.constexpr, WINDOW: tl.constexpr,
                    HIST: tl.constexpr, LOCAL: tl.constexpr, SPAN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)       # 64-bit offsets: n may pass 2**31
    programs = tl.num_programs(0).to(tl.int64)
    inf = float("inf")
    shift64 = _shift(x_ptr, count, stride, BF16, WINDOW)  # each program its own: no launch
    HALF: tl.constexpr = RAW // 2             # the codes of one sign
    base = _base(x_ptr, count, stride, BF16, WINDOW, SHIFT, HALF, SPAN)
    local = tl.zeros([LOCAL], dtype=tl.int32)
    slice_ptr = hist_ptr + (pid % SLICES) * WIDTH
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
        if HIST == 0:                          # one relaxed atomic an element
            tl.atomic_add(slice_ptr + code, 1, mask=inside, sem="relaxed")
        elif HIST == 2:                        # a window of magnitudes counted in the program
            special = code >= RAW
            rel = (code & (HALF - 1)) - base
            near = inside & (special | ((rel >= 0) & (rel < SPAN)))
            at = tl.where(special, 2 * SPAN + code - RAW, (code >= HALF).to(tl.int32) * SPAN + rel)
            local += tl.histogram(tl.where(near, at, LOCAL - 1), LOCAL)
            tl.atomic_add(slice_ptr + code, 1, mask=inside & ~near, sem="relaxed")
    if HIST == 2:                              # the program's counts, one atomic a code seen
        j = tl.arange(0, LOCAL)
        to = tl.where(j >= 2 * SPAN, RAW + j - 2 * SPAN, (j >= SPAN).to(tl.int32) * HALF
                      + base + j - (j >= SPAN).to(tl.int32) * SPAN)
        tl.atomic_add(slice_ptr + to, local, mask=(j < LOCAL - 1) & (to < WIDTH) & (local > 0),
                      sem="relaxed")
    tl.store(parts_ptr + pid * 5 + 0, tl.sum(acc_s, axis=0))
    tl.store(parts_ptr + pid * 5 + 1, tl.sum(acc_q, axis=0))
    tl.store(parts_ptr + pid * 5 + 2, tl.min(acc_lo, axis=0).to(tl.float64))
    tl.store(parts_ptr + pid * 5 + 3, tl.max(acc_hi, axis=0).to(tl.float64))
    tl.store(parts_ptr + pid * 5 + 4, shift64)


@triton.jit(do_not_specialize=["n", "grid"])               # one compiled kernel in all
def _finish_kernel(parts_ptr, grid, hist_ptr, slots_ptr, out_ptr, n, PARTS: tl.constexpr,
                   WIDTH: tl.constexpr, SLICES: tl.constexpr, HEAD: tl.constexpr,
                   SLOTS: tl.constexpr, CODES: tl.constexpr):
    """One program: the summary vector of the programs' parts and histogram slices
    (``_summary``'s layout), and the slices zeroed again for the next tensor."""
    rows = tl.arange(0, PARTS)
    used = rows < grid
    inf = float("inf")
    tl.store(out_ptr + 0, n.to(tl.float64))
    tl.store(out_ptr + 1, tl.load(parts_ptr + 4))
    tl.store(out_ptr + 2, tl.sum(tl.load(parts_ptr + rows * 5 + 0, mask=used, other=0.0), axis=0))
    tl.store(out_ptr + 3, tl.sum(tl.load(parts_ptr + rows * 5 + 1, mask=used, other=0.0), axis=0))
    tl.store(out_ptr + 4, tl.min(tl.load(parts_ptr + rows * 5 + 2, mask=used, other=inf), axis=0))
    tl.store(out_ptr + 5, tl.max(tl.load(parts_ptr + rows * 5 + 3, mask=used, other=-inf), axis=0))
    for s0 in range(0, SLOTS, CODES):
        s = s0 + tl.arange(0, CODES)
        tl.store(out_ptr + HEAD + s, tl.zeros([CODES], dtype=tl.float64), mask=s < SLOTS)
    tl.debug_barrier()                         # the zeros before the counts added to them
    slices = tl.arange(0, SLICES)[:, None] * WIDTH
    for c0 in range(0, WIDTH, CODES):
        c = c0 + tl.arange(0, CODES)
        valid = c < WIDTH
        where = hist_ptr + slices + c[None, :]
        total = tl.sum(tl.load(where, mask=valid[None, :], other=0).to(tl.int64), axis=0)
        tl.store(where, tl.zeros([SLICES, CODES], dtype=tl.int32), mask=valid[None, :])
        slot = tl.load(slots_ptr + c, mask=valid, other=0)
        tl.atomic_add(out_ptr + HEAD + slot, total.to(tl.float64), mask=valid & (total > 0),
                      sem="relaxed")


class TritonEngine(Engine):
    """Accelerator statistics in one fused pass (falls back to the torch kernels
    for float64, the 8-bit floats and a step's tiny tensors)."""

    family = "triton"
    BLOCK = 4096
    SLICES = 32
    HIST = 2            # how codes are counted: 0 an atomic each, 2 a window in the
    LOCAL = 256         # program (``_summary_kernel``; 3 none: a timing floor); its bins
    WARPS = 8

    def __init__(self, device_type: str, compile: bool):
        super().__init__(device_type, compile)
        self._programs: dict = {}
        self._scratch: dict = {}
        self._warming: dict = {}                  # dtype -> its background compile
        self._eager = Engine(device_type, False)  # meanwhile

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Also compile the Triton kernels in the background, for each dtype they
        take (autocast makes 16-bit activations of float32 weights): one launch on
        a small tensor there.  Until a dtype's are compiled, its tensors take the
        eager torch kernels (``reduce``), so no step waits for the compiler."""
        super().warm(dtype, device)
        if device.type == "cuda":
            for dt in _OWN:
                if dt not in self._warming:
                    self._warming[dt] = _compiler().submit(self._launch_once, dt, device)

    def _launch_once(self, dtype: torch.dtype, device: torch.device) -> None:
        try:
            self._launch(torch.zeros(2 * self.BLOCK + 1, dtype=dtype, device=device))
        except Exception:                # the first capture will meet it, under the guard
            pass

    def _buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The programs' parts and the histogram slices (zero: ``_finish_kernel``
        zeroes them again), kept per device, stream and thread (stream order makes
        a reuse safe: the last tensor's were read by kernels queued before this
        one's; backward may run on another thread)."""
        stream = torch.cuda.current_stream(x.device) if x.device.type == "cuda" else None
        key = (x.device, stream, threading.get_ident())
        scratch = self._scratch.get(key)
        if scratch is None:
            scratch = self._scratch[key] = (
                torch.empty((self._grid_cap(x), 5), dtype=torch.float64, device=x.device),
                torch.zeros((self.SLICES, _WIDTH), dtype=torch.int32, device=x.device))
        return scratch

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
        if x.dtype not in _OWN:                  # float64, 8-bit floats: the torch kernels
            return super().reduce(x)
        pending = self._warming.get(x.dtype)
        if pending is not None and not pending.done():    # compiling: the eager torch kernels
            return self._eager.reduce(x)
        return self._launch(x)

    def _launch(self, x: torch.Tensor) -> torch.Tensor:
        """Two launches, nothing else queued: the pass, then the vector."""
        if not x.is_contiguous():
            x = x.contiguous()
        n = x.numel()
        cap = self._grid_cap(x)
        grid = max(1, min(cap, triton.cdiv(n, self.BLOCK)))
        stride = max(1, n // SHIFT_WINDOW)                # ``shift_of``'s elements
        count = min(SHIFT_WINDOW, triton.cdiv(n, stride))
        parts, hist = self._buffers(x)
        out = torch.empty(VECTOR, dtype=torch.float64, device=x.device)
        bf16 = x.dtype == torch.bfloat16
        where = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
        try:
            with where, quiet():         # on the tensor's device; Triton's own warnings (its
                # compile, at the first launch) never fail the kernel (``quiet``)
                _summary_kernel[(grid,)](x.view(torch.int16) if bf16 else x, n, count, stride,
                                         parts, hist, BLOCK=self.BLOCK, RAW=_RAW, WIDTH=_WIDTH,
                                         SHIFT=_SHIFT, BF16=bf16, SLICES=self.SLICES,
                                         WINDOW=SHIFT_WINDOW, HIST=self.HIST, LOCAL=self.LOCAL,
                                         SPAN=(self.LOCAL - 6) // 2, num_warps=self.WARPS)
                _finish_kernel[(1,)](parts, grid, hist, self.slots(x.device, 8), out, n,
                                     PARTS=triton.next_power_of_2(cap), WIDTH=_WIDTH,
                                     SLICES=self.SLICES, HEAD=len(FIELDS),
                                     SLOTS=histogram.SLOTS, CODES=512)
        except BaseException:            # the slices may hold counts: fresh ones next time
            self._scratch.clear()
            raise
        return out
