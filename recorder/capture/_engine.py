"""A statistics engine: how the summary kernels run on one device type.

An engine turns tensors into summary vectors on their own device, with no
host sync: ``reduce`` (one tensor), ``reduce_many`` (a step's tiny tensors at
once) and ``count_nonfinite`` (a step without statistics).  The kernels are
the pure functions of ``_summary``; ``Engine`` runs them fused by
``torch.compile`` where that works on the device, eagerly otherwise (the same
numbers), and counts codes with ``index_add_``.  It takes tensors as
``_summary.prepared`` makes them: what form a capture takes is decided before
(``_summary.form``), never here.

Engines register themselves, as einops' backends do: a subclass that names
its ``family`` joins the registry (``registered``), and says which device
types it serves.  The torch family is in ``_engines``, the Triton one in
``_triton``; the demotion order over the families is declared once, in
``_engines.ORDER``.  This module imports neither.

Training thread (and autograd's threads, for gradients): kernels compile on
the thread of their first use (``Engine._run``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import ClassVar

import torch

from .. import histogram
from ..quiet import quiet, warn
from ._summary import (COUNTS, FIELDS, LANES, batched_dtype, codes, exp_bits_of, finite_top, joined,
                       lane_codes, nonfinite_counts, pieces, reductions, scale_of,
                       segment_reductions, shift_of, widened)

__all__ = ["Engine", "registered"]

_families: dict[str, list[type["Engine"]]] = {}

_told = False


@contextlib.contextmanager
def _told_after(seconds: float, message: str):
    """Print ``message`` on stderr once per process if the block takes longer
    than ``seconds`` (a timer, so a fast block says nothing)."""
    if _told:
        yield
        return

    def tell():
        global _told
        if not _told:
            _told = True
            print(message, file=sys.stderr, flush=True)
    timer = threading.Timer(seconds, tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def registered(family: str) -> list[type["Engine"]]:
    """The engine classes of ``family`` registered so far, in definition order."""
    return list(_families.get(family, ()))


def _groups(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """Consecutive ranges of ``sizes`` of at most ``n`` in all (one that alone holds
    more: a range of its own)."""
    cuts, total = [0], 0
    for i, size in enumerate(sizes):
        if total and total + size > n:
            cuts.append(i)
            total = 0
        total += size
    return list(zip(cuts, cuts[1:] + [len(sizes)]))


def _lengths(sizes: list[int], device: torch.device) -> torch.Tensor:
    """``sizes`` as an int64 tensor on ``device``, copied without a host wait."""
    lengths = torch.tensor(sizes)
    if device.type == "cuda":                  # from pinned memory: no host wait
        return lengths.pin_memory().to(device, non_blocking=True)
    return lengths if device.type == "cpu" else lengths.to(device)


def _segment_ids(flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """For each element of ``flat`` (tensors of ``lengths``, concatenated), the index
    of its tensor: on ``flat``'s device, with no device sync."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=flat.device), lengths,
                                   output_size=flat.numel())      # known here: no device sync


class Engine:
    """Runs the summary kernels on one device type."""

    family: ClassVar[str | None] = None     # the family a subclass registers in (``registered``)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            _families.setdefault(cls.family, []).append(cls)

    @classmethod
    def serves(cls, device_type: str) -> bool:
        """Whether the engine is one for ``device_type`` (``TENSORTAPE_ENGINE``
        naming a family makes its first engine serve every device)."""
        return True

    def __init__(self, device_type: str, compile: bool):
        self.device_type = device_type
        self.compile = compile
        # elements a kernel takes at once: a larger tensor goes in pieces (``pieces``), so its
        # temporaries (eager: ~30 bytes an element; compiled: its codes) stay this size's
        self.piece = 1 << (21 if device_type == "cpu" else 23)
        self._compiled: dict = {}
        self._slots: dict = {}
        self._lock = threading.Lock()
        self._warned = False

    # --- the public face ---------------------------------------------------------
    def __repr__(self) -> str:
        kernels = "compiled" if self.compile else "eager"
        return f"{type(self).__name__}({self.device_type}, {kernels})"

    @torch.compiler.disable
    def count_nonfinite(self, x: torch.Tensor) -> torch.Tensor:
        """NaN, +Inf and -Inf counts of a prepared float tensor (``COUNTS``, float64,
        on its device); no sync."""
        counts = [self._run(nonfinite_counts, widened(p)) for p in pieces(x, self.piece)]
        return counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)

    @torch.compiler.disable
    def count_nonfinite_many(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """``count_nonfinite`` of many small float tensors of one device, in a few
        kernels for all of them: a (tensors x ``COUNTS``) table, float64; nothing
        reads back from the device.  In groups of at most
        ``self.piece`` elements, as ``reduce_many``."""
        sizes = [x.numel() for x in xs]
        return torch.cat([self._count_batch(xs[a:b], sizes[a:b])
                          for a, b in _groups(sizes, self.piece)])

    def _count_batch(self, xs: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
        flat = torch.cat([widened(x).reshape(-1) for x in xs])   # 16-bit floats: float32
        table = torch.zeros((len(xs), len(COUNTS)), dtype=torch.float64, device=flat.device)
        inf = float("inf")
        bad = torch.stack([torch.isnan(flat), flat == inf, flat == -inf], 1)
        seg = _segment_ids(flat, _lengths(sizes, flat.device))
        return table.index_add_(0, seg, bad.to(torch.float64))

    @torch.compiler.disable
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The summary vector of a prepared, non-empty float tensor, on its device
        (``Holds.SUMMARY``); no sync.  A piece at a time (``self.piece`` elements,
        an 8-bit float widened a piece at a time): counts, minimum, maximum and
        histogram as of the whole, the sums but for rounding."""
        exp_bits = exp_bits_of(x)              # its code width: 11 (float64) or 8
        parts = pieces(x, self.piece)
        args = (shift_of(x),)
        if exp_bits == 11:                     # float64: the sums' scale, of the whole tensor
            args += (scale_of(torch.stack([self._run(finite_top, p) for p in parts]).amax()),)
        width = LANES * histogram.code_width(exp_bits)
        counts, sums = None, []
        for p in parts:
            p = widened(p)
            k = self._bincount(self._run(lane_codes, p), width)
            counts = k if counts is None else counts.add_(k)
            sums.append(self._run(reductions, p, *args))
        return torch.cat([joined(sums), self.to_slots(counts, exp_bits)])

    def to_slots(self, code_counts: torch.Tensor, exp_bits: int) -> torch.Tensor:
        """Counts of codes (any number of lanes of ``code_width``, on a device) -> the
        ``histogram.SLOTS`` counts of a summary vector, float64, on that device."""
        table = self.slots(code_counts.device, exp_bits)
        lanes = code_counts.numel() // len(table)
        out = torch.zeros(histogram.SLOTS, dtype=torch.float64, device=code_counts.device)
        return out.index_add_(0, table.repeat(lanes), code_counts.reshape(-1).to(torch.float64))

    def slots(self, device: torch.device, exp_bits: int) -> torch.Tensor:
        """``histogram.code_slots`` on ``device`` (kept: one copy to each device)."""
        key = (device, exp_bits)
        table = self._slots.get(key)
        if table is None:
            table = self._slots[key] = torch.from_numpy(histogram.code_slots(exp_bits)).to(device)
        return table

    @torch.compiler.disable
    def reduce_many(self, xs: list[torch.Tensor], exp_bits: int) -> torch.Tensor:
        """``reduce`` of many small float tensors of one device and code width, with
        a few kernels for all of them: segment reductions, and one count of codes
        offset by segment.  A (tensors x vector) table of the vectors ``reduce``
        would give.  A batch of more than ``self.piece`` elements goes in groups of
        at most that many (bounded temporaries, as ``reduce``'s pieces)."""
        sizes = [x.numel() for x in xs]
        if sum(sizes) > self.piece:
            return torch.cat([self._reduce_batch(xs[a:b], sizes[a:b], exp_bits)
                              for a, b in _groups(sizes, self.piece)])
        return self._reduce_batch(xs, sizes, exp_bits)

    def _reduce_batch(self, xs: list[torch.Tensor], sizes: list[int],
                      exp_bits: int) -> torch.Tensor:
        device = xs[0].device
        flat = torch.cat([x.reshape(-1) for x in xs])        # 16-bit floats promote to float32
        flat = flat.to(batched_dtype(exp_bits))
        lengths = _lengths(sizes, device)
        seg = _segment_ids(flat, lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        slot = self.slots(device, exp_bits)[self._run(codes, flat)]   # tiny tensors: a gather
        head = len(FIELDS)
        table = torch.zeros((len(xs), head + histogram.SLOTS), dtype=torch.float64, device=device)
        table[:, :head] = segment_reductions(flat, seg, starts, lengths)
        ones = torch.ones(1, dtype=torch.float64, device=device).expand(flat.numel())
        # the counts, in place, as float64
        table.view(-1).index_add_(0, slot + seg * (head + histogram.SLOTS) + head, ones)
        return table

    # --- how kernels run ------------------------------------------------------------
    def _parallel(self, x: torch.Tensor) -> bool:
        return False

    def _run(self, fn, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        """``fn(x, *args)`` as one fused kernel, compiled once per (kernel, dtype, threading).

        A kernel compiles on the thread of its first use, the training thread:
        a ``torch.compile`` session sets the process-wide ``is_compiling()`` flag,
        which optimizers and models read, so compiling on another thread would
        change the user's code paths while it runs.  The kernels ignore element
        order, so a contiguous tensor goes in flat (one compiled shape for every
        rank); a tensor that is not contiguous runs the eager kernel (no
        recompile per stride pattern)."""
        if not self.compile or not x.is_contiguous():
            return fn(x, *args)
        x = x.reshape(-1)
        key = (fn, x.dtype, self._parallel(x))
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._lock:
                if key not in self._compiled:
                    self._compile(key, x.device, args)
                compiled = self._compiled[key]
        if compiled is not False:
            try:   # one grad mode: no recompiles between forward and backward; a recompile's
                with torch.no_grad(), quiet():   # warnings are the compiler's (``quiet``)
                    return compiled(x, *args)
            except Exception as e:   # a compiled kernel must never break training
                self._compiled[key] = False
                self._warn(fn, e)
        return fn(x, *args)

    def later(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of ``dtype`` is better summarised later, on the writer
        thread (``_numba``: while its kernels compile); here never."""
        return False

    def fail(self, dtype: torch.dtype, error: BaseException) -> None:
        """A kernel of ``dtype`` failed on the writer thread, on a capture left to it
        (``later``); here nothing is left to it."""

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Prepare what a tensor of ``dtype`` on ``device`` takes, before the first
        step (the Triton engine compiles its kernel in the background; the torch
        kernels compile at their first use, see ``_run``)."""

    def _compile(self, key: tuple, device: torch.device, args: tuple) -> None:
        """Compile one key and check it on a probe (with the first call's other
        ``args``); a failure leaves that key to the eager kernel, with one warning."""
        fn, dtype, parallel = key
        try:      # the compiler's warnings never fail the kernel (``quiet``)
            with quiet(), _told_after(1.0, "tensortape: compiling the statistics kernels, once "
                                           "per dtype (a few seconds, the first steps only)"):
                probe = torch.tensor([1.0, float("nan"), 0.0, -float("inf")], device=device,
                                     dtype=dtype)
                options = {"cpp.dynamic_threads": parallel} if self.device_type == "cpu" else {}
                # a code object of its own: Dynamo's recompile limit counts per code object,
                # and each (kernel, dtype, threading) is one compiled function
                own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                         fn.__defaults__, fn.__closure__)
                compiled = torch.compile(own, dynamic=True, options=options)
                with torch.no_grad():
                    torch.testing.assert_close(compiled(probe, *args), fn(probe, *args),
                                               equal_nan=True)
            self._compiled[key] = compiled
        except Exception as e:
            self._compiled[key] = False
            self._warn(fn, e)

    def _warn(self, fn, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            warn(f"tensortape: torch.compile of the {self.device_type} statistics kernel "
                 f"{fn.__name__} failed ({type(e).__name__}: {str(e)[:120]}); using the eager "
                 f"kernels, with the same results (set TENSORTAPE_COMPILE=0 to skip compiling)")

    def _bincount(self, code: torch.Tensor, n: int) -> torch.Tensor:
        ones = torch.ones(1, dtype=torch.int64, device=code.device).expand(code.numel())
        return torch.zeros(n, dtype=torch.int64, device=code.device).index_add_(0, code, ones)
