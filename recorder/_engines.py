"""Statistics engines: one per device type, picked per tensor.

An engine turns tensors into summary vectors on their own device, with no
host sync (``reduce``, ``reduce_many`` for a step's tiny tensors at once, and
``count_nonfinite`` for steps without statistics).  The kernels are the pure
functions of ``_summary``; an engine decides how to run them: fused by
``torch.compile`` where that works on the device, eagerly otherwise (the same
numbers), and how to count codes.

- ``CpuEngine``: large tensors get kernels that OpenMP splits across threads,
  small ones serial kernels; ``bincount`` is split across threads.
- ``DeviceEngine``: any accelerator; codes are counted with ``index_add_``
  (``bincount`` there reads its maximum back to the host, a sync per tensor).
- ``TritonEngine`` (``_triton``): CUDA, when Triton is there (it ships with
  CUDA builds of torch): one fused pass per tensor.

``Engines`` holds a recording's choice: for each (device type, dtype) a chain
of engines, best first (Triton, the compiled torch kernels, the eager ones).
When one fails, the capture is dropped (counted) and that (device, dtype) is
demoted to the next engine in its chain (``demote``).

``TENSORTAPE_COMPILE=0`` leaves the compiled kernels out of every chain.
``TENSORTAPE_ENGINE`` picks the first engine: ``auto`` (the default, as above),
``torch`` (never Triton) or ``triton`` (Triton for every device: on CPU tensors
it needs ``TRITON_INTERPRET=1``, which is how the tests check it against the
CPU engine).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import types

import torch

from . import format as fmt
from ._quiet import quiet, warn
from .errors import ConfigError
from ._summary import (FIELDS, LANES, Summaries, codes, empty_summary, exp_bits_of, finalize,
                       lane_codes, memory_order, nonfinite_counts, reductions,
                       segment_reductions, widened)

__all__ = ["Engine", "Engines", "engine_choice", "summarize"]

SMALL = 1 << 13                # elements below which a tensor waits for the step's batch
_PARALLEL_MIN = 1 << 18        # elements from which CPU work is split across threads

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


class Engine:
    """Runs the summary kernels on one device type."""

    def __init__(self, device_type: str, compile: bool):
        self.device_type = device_type
        self.compile = compile
        self._compiled: dict = {}
        self._slots: dict = {}
        self._lock = threading.Lock()
        self._warned = False

    # --- the public face ---------------------------------------------------------
    @staticmethod
    def is_small(x: torch.Tensor) -> bool:
        """Whether ``x`` waits for the step's batched summary (``reduce_many``):
        for tiny tensors the fixed cost of a kernel call exceeds the work."""
        return x.is_floating_point() and 0 < x.numel() < SMALL

    def __repr__(self) -> str:
        kernels = "compiled" if self.compile else "eager"
        return f"{type(self).__name__}({self.device_type}, {kernels})"

    @torch.compiler.disable
    def count_nonfinite(self, x: torch.Tensor) -> torch.Tensor:
        """NaN, +Inf and -Inf counts of a float tensor (float64, on its device); no sync."""
        return self._run(nonfinite_counts, memory_order(widened(x.detach())))

    @torch.compiler.disable
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The summary vector of ``x``, on ``x``'s device; no sync."""
        x = memory_order(widened(x.detach()))
        exp_bits = exp_bits_of(x)
        if exp_bits == 0:
            return torch.full((1,), x.numel(), dtype=torch.float64, device=x.device)
        if x.numel() == 0:
            return empty_summary().to(x.device)
        width = fmt.code_width(exp_bits)
        counts = self._bincount(self._run(lane_codes, x), LANES * width)
        return torch.cat([self._run(reductions, x), self.to_slots(counts, exp_bits)])

    def to_slots(self, code_counts: torch.Tensor, exp_bits: int) -> torch.Tensor:
        """Counts of codes (any number of lanes of ``code_width``, on a device) -> the
        ``format.SLOTS`` counts of a summary vector, float64, on that device."""
        table = self.slots(code_counts.device, exp_bits)
        lanes = code_counts.numel() // len(table)
        out = torch.zeros(fmt.SLOTS, dtype=torch.float64, device=code_counts.device)
        return out.index_add_(0, table.repeat(lanes), code_counts.reshape(-1).to(torch.float64))

    def slots(self, device: torch.device, exp_bits: int) -> torch.Tensor:
        """``format.code_slots`` on ``device`` (kept: one copy to each device)."""
        key = (device, exp_bits)
        table = self._slots.get(key)
        if table is None:
            table = self._slots[key] = torch.from_numpy(fmt.code_slots(exp_bits)).to(device)
        return table

    @torch.compiler.disable
    def reduce_many(self, xs: list[torch.Tensor], exp_bits: int) -> torch.Tensor:
        """``reduce`` of many small float tensors of one device and code width, with
        a few kernels for all of them: segment reductions, and one count of codes
        offset by segment.  A (tensors x vector) table of the vectors ``reduce``
        would give."""
        device = xs[0].device
        flat = torch.cat([x.reshape(-1) for x in xs])        # 16-bit floats promote to float32
        flat = flat.to(torch.float64 if exp_bits == 11 else torch.float32)
        sizes = [x.numel() for x in xs]
        lengths = torch.tensor(sizes)
        if device.type == "cuda":                  # from pinned memory: no host wait
            lengths = lengths.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            lengths = lengths.to(device)
        seg = torch.repeat_interleave(torch.arange(len(xs), device=device), lengths,
                                      output_size=flat.numel())   # known here: no device sync
        starts = torch.cumsum(lengths, 0) - lengths
        slot = self.slots(device, exp_bits)[self._run(codes, flat)]   # tiny tensors: a gather
        head = len(FIELDS)
        table = torch.zeros((len(xs), head + fmt.SLOTS), dtype=torch.float64, device=device)
        table[:, :head] = segment_reductions(flat, seg, starts, lengths)
        ones = torch.ones(1, dtype=torch.float64, device=device).expand(flat.numel())
        table.view(-1).index_add_(0, slot + seg * (head + fmt.SLOTS) + head, ones)   # the counts,
        return table                                                  # in place, as float64

    # --- how kernels run ------------------------------------------------------------
    def _parallel(self, x: torch.Tensor) -> bool:
        return False

    def _run(self, fn, x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` as one fused kernel, compiled once per (kernel, dtype, threading).

        A kernel compiles on the thread of its first use, the training thread:
        a ``torch.compile`` session sets the process-wide ``is_compiling()`` flag,
        which optimizers and models read, so compiling on another thread would
        change the user's code paths while it runs.  The kernels ignore element
        order, so a contiguous tensor goes in flat (one compiled shape for every
        rank); a tensor that is not contiguous runs the eager kernel (no
        recompile per stride pattern)."""
        if not self.compile or not x.is_contiguous():
            return fn(x)
        x = x.reshape(-1)
        key = (fn, x.dtype, self._parallel(x))
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._lock:
                if key not in self._compiled:
                    self._compile(key, x.device)
                compiled = self._compiled[key]
        if compiled is not False:
            try:   # one grad mode: no recompiles between forward and backward; a recompile's
                with torch.no_grad(), quiet():   # warnings are the compiler's (``_quiet``)
                    return compiled(x)
            except Exception as e:   # a compiled kernel must never break training
                self._compiled[key] = False
                self._warn(fn, e)
        return fn(x)

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Prepare what a tensor of ``dtype`` on ``device`` takes, before the first
        step (the Triton engine compiles its kernel in the background; the torch
        kernels compile at their first use, see ``_run``)."""

    def _compile(self, key: tuple, device: torch.device) -> None:
        """Compile one key and check it on a probe; a failure leaves that key to
        the eager kernel, with one warning."""
        fn, dtype, parallel = key
        try:      # the compiler's warnings never fail the kernel (``_quiet``)
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
                    torch.testing.assert_close(compiled(probe), fn(probe), equal_nan=True)
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


class CpuEngine(Engine):
    _pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _parallel(self, x: torch.Tensor) -> bool:
        # the size is unknown at compile time, so inductor would run a large tensor
        # on one thread; a parallel region costs more than it saves on small ones
        return x.numel() >= _PARALLEL_MIN

    def _bincount(self, code: torch.Tensor, n: int) -> torch.Tensor:
        """``bincount`` runs on one thread: large inputs are split and the parts
        run concurrently (torch releases the GIL); their counts add up exactly."""
        parts = min(torch.get_num_threads(), 4, code.numel() // _PARALLEL_MIN)
        if parts < 2:
            return torch.bincount(code, minlength=n)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    3, thread_name_prefix="tensortape-bincount")
        chunks = code.chunk(parts)
        futures = [self._pool.submit(torch.bincount, c, minlength=n) for c in chunks[1:]]
        counts = torch.bincount(chunks[0], minlength=n)
        for f in futures:
            counts += f.result()
        return counts


class DeviceEngine(Engine):
    """Any accelerator (CUDA, MPS, XPU): the torch kernels, counted by ``index_add_``."""


ENGINES = ("auto", "torch", "triton")
_instances: dict[tuple, Engine] = {}
_instances_lock = threading.Lock()


def engine_choice() -> str:
    """``TENSORTAPE_ENGINE``, checked: ``ConfigError`` (one line naming the valid
    values) for anything else.  The Recorder calls it at construction, before
    anything is written."""
    choice = os.environ.get("TENSORTAPE_ENGINE", "auto")
    if choice not in ENGINES:
        raise ConfigError(f"TENSORTAPE_ENGINE={choice!r} is not valid; use one of "
                          f"{', '.join(ENGINES)} (or leave it unset)")
    return choice


def _compile_enabled() -> bool:
    return os.environ.get("TENSORTAPE_COMPILE", "1") not in ("0", "false", "no")


def _instance(cls: type, device_type: str, compile: bool) -> Engine:
    """One engine per (class, device type, kernels) in the process: compiled
    kernels are cached there."""
    key = (cls, device_type, compile)
    engine = _instances.get(key)
    if engine is None:
        with _instances_lock:
            engine = _instances.setdefault(key, cls(device_type, compile))
    return engine


def _triton_class(required: bool):
    try:
        with quiet():                   # importing Triton may warn: not the user's news
            from ._triton import TritonEngine
        return TritonEngine
    except Exception as e:              # no Triton here: the torch kernels, the same numbers
        if required:
            warn(f"tensortape: TENSORTAPE_ENGINE=triton, but Triton is not usable "
                 f"({type(e).__name__}: {e}); using the torch kernels")
        return None


class Engines:
    """A recording's statistics engines: per (device type, dtype) a chain, best
    first, and how far each has been demoted.  The settings are read once, here."""

    def __init__(self, compile: bool | None = None, choice: str | None = None):
        self.compile = _compile_enabled() if compile is None else compile and _compile_enabled()
        self.choice = engine_choice() if choice is None else choice
        if self.choice not in ENGINES:
            raise ConfigError(f"engine {self.choice!r} is not valid; use one of "
                              f"{', '.join(ENGINES)}")
        self._chains: dict[str, list[Engine]] = {}
        self._level: dict[tuple, int] = {}

    def chain(self, device_type: str) -> list[Engine]:
        chain = self._chains.get(device_type)
        if chain is None:
            base = CpuEngine if device_type == "cpu" else DeviceEngine
            classes = []
            if self.choice == "triton" or (self.choice == "auto" and device_type == "cuda"):
                triton = _triton_class(self.choice == "triton")
                if triton is not None:
                    classes.append((triton, self.compile))
            if self.compile:
                classes.append((base, True))
            classes.append((base, False))
            chain = self._chains[device_type] = [_instance(c, device_type, k) for c, k in classes]
        return chain

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Prepare every engine a tensor of ``dtype`` on ``device`` may take
        (``Engine.warm``)."""
        for engine in self.chain(device.type):
            engine.warm(dtype, device)

    def for_tensor(self, x: torch.Tensor) -> Engine:
        """The engine for ``x``'s device type and dtype."""
        chain = self.chain(x.device.type)
        return chain[min(self._level.get((x.device.type, x.dtype), 0), len(chain) - 1)]

    def demote(self, x: torch.Tensor) -> Engine | None:
        """After a failure on ``x``: the next engine for its device type and dtype
        (None when there is none left: it stays with the last)."""
        key = (x.device.type, x.dtype)
        chain = self.chain(x.device.type)
        level = self._level.get(key, 0) + 1
        if level >= len(chain):
            return None
        self._level[key] = level
        return chain[level]


def summarize(x: torch.Tensor, compile: bool | None = None) -> Summaries:
    """Statistics and histogram of one tensor, on the host (one sync)."""
    x = x.detach()
    engine = Engines(compile).for_tensor(x)
    return finalize([engine.reduce(x).cpu().numpy()])
