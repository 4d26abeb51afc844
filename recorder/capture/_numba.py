"""The CPU statistics engine on numba: one read of each tensor (the family ``"numba"``).

``NumbaEngine`` gives the summary vectors of ``_summary``'s layout from the
kernels of ``_nbkernels``: the sums, minimum, maximum and histogram slot
counts of a tensor come from one read of its bits (bfloat16, float16 and the
8-bit floats too: no widened copy).  Counts and histograms equal the torch
engines' exactly, and so do the minimum and maximum but for the sign of a
zero (-0 orders below +0 here); the float64 sums are taken around the first
finite element (the torch kernels' shift is another finite element) and
equal theirs but for rounding.

- A tensor of ``PARALLEL_MIN`` elements or more is split across
  ``torch.get_num_threads()`` threads (the calling one and a pool's), each
  counting codes into private rows; the counts and sums are merged at the
  end, in chunk order.  The kernels hold no GIL.
- A step's tiny tensors go through one kernel call (``reduce_many``).
- A float64 tensor whose extremes ask for a scale (``_summary.scale_exponent``:
  past ``2 ** 448`` or below ``2 ** -448``) is read a second time, for its
  scaled sums (``_rescale``); no other tensor is.

**Compiled once per machine, never in this process.**  numba caches the kernels
on disk (``cache=True``).  A dtype's kernels are compiled by a child process
(``_compile_apart``, waited for by a background thread), then loaded from the
cache on the thread that asks (``ready``): at ``Recorder.attach`` for the
model's dtypes when the cache holds them (``warm``), else once the child has
ended.  Until then (``later``) the training thread leaves
that dtype's tensors to the writer thread (``_summarizer.Later``: a copy of
each), which waits for the child and loads the kernels there (``settle``),
so no step waits for a compiler and the numbers are this engine's; past the
copies' bound, the eager torch kernels take them (the same counts, minimum,
maximum and histograms).  A load that fails is kept and makes ``reduce``
raise: the fault path demotes that dtype to the next engine of
``_engines.ORDER``.  Where no child can run or no cache can be written, the
load compiles in this process (seconds, once).

Training thread (and autograd's threads); ``settle`` and the kernels on the
writer thread for the captures left to it; the child waited for on a thread
of its own.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import subprocess
import sys
import threading

import numpy as np
import torch

from . import _nbkernels as K
from ._engine import Engine
from ..quiet import quiet
from ._summary import FIELDS, NARROW, VECTOR, batched_dtype, scale_exponent

__all__ = ["NumbaEngine"]

PARALLEL_MIN = 1 << 18          # elements from which a tensor is split across threads
_CHUNK_MAX = 1 << 30            # elements per chunk at most (a lane's int32 counts stay exact)
_NICE = 10                      # the compile apart's niceness (added to this process's)

_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of threads kept for the process: ``compile`` (one thread) or
    ``stats`` (the chunks of large tensors)."""
    pool = _pools.get(name)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(name)
            if pool is None:
                pool = _pools[name] = concurrent.futures.ThreadPoolExecutor(
                    workers, thread_name_prefix=f"tensortape-{name}")
    return pool


_TABLES = {8: K.slot_table(8), 11: K.slot_table(11)}
# per float dtype: the torch dtype its bits are viewed as, and its ``K.READS`` key
_BITS = {torch.float64: (torch.float64, "float64"), torch.float32: (torch.float32, "float32"),
         torch.bfloat16: (torch.int16, "bfloat16"), torch.float16: (torch.int16, "float16")}
_BITS.update({d: (torch.uint8, "float8") for d in NARROW})
assert K.HEAD == len(FIELDS)
_decoders: dict[torch.dtype, np.ndarray] = {}


def _decoder(dtype: torch.dtype) -> np.ndarray:
    """An 8-bit float's 256 values as float32 bits (as torch widens them)."""
    table = _decoders.get(dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(dtype).float().view(torch.int32)
        table = _decoders[dtype] = table.numpy().view(np.uint32).copy()
    return table


def bits(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A contiguous float tensor's elements as flat bits (a view, never a copy),
    its decoder table and its slot table."""
    as_torch, reads = _BITS[x.dtype]
    as_numpy, exp_bits = K.READS[reads]
    flat = x.reshape(-1)
    a = (flat if as_torch == x.dtype else flat.view(as_torch)).numpy()
    if a.dtype != as_numpy:
        a = a.view(as_numpy)
    return a, (_decoder(x.dtype) if as_torch == torch.uint8 else K.NO_TABLE), _TABLES[exp_bits]


try:                  # torch's one-call flattening of many tensors (what DDP's buckets use)
    _flatten = torch._C._nn.flatten_dense_tensors
except AttributeError:          # pragma: no cover - another torch
    def _flatten(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([x.reshape(-1) for x in xs])


def _flat(xs: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, one after another: tensors of one shape (a step of one
    layer width) stacked, at a third of the cost of flattening each."""
    shape = xs[0].shape
    if all(x.shape == shape for x in xs):
        return torch.stack(xs).reshape(-1)
    return _flatten(xs)


def _splits(n: int, threads: int) -> list[int]:
    """Chunk boundaries of ``n`` elements: one per thread from ``PARALLEL_MIN``,
    at most ``_CHUNK_MAX`` each, multiples of the lanes' block."""
    parts = max(min(threads, n // (PARALLEL_MIN // 2)), -(-n // _CHUNK_MAX), 1)
    step = -(-n // parts // K.BLOCK) * K.BLOCK
    return [min(n, i * step) for i in range(parts)] + [n]


def _compile_apart(reads: str) -> None:
    """Compile the kernels of ``reads`` (a ``K.READS`` key) in a child process, into
    numba's disk cache, unless its mark says they are there.  The compiler holds
    the GIL for seconds: in this process it would stall every thread that wants
    it, the training thread first.  A failure is left to the load (``_load``),
    which then compiles here."""
    if os.path.exists(K.cached_mark(reads)):
        return
    try:
        # at a low priority: on a machine that training keeps busy, the first steps
        # keep their cores (the compile takes longer, the eager kernels meanwhile)
        code = (f"import os\nif hasattr(os, 'nice'): os.nice({_NICE})\n"
                f"from {K.__name__} import compile_for; compile_for({reads!r}, mark=True)")
        subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600,
                       check=False)
    except Exception:
        pass


class NumbaEngine(Engine):
    """CPU statistics in one read per tensor (see the module); until a dtype's
    kernels are compiled, the eager torch kernels."""

    family = "numba"

    @classmethod
    def serves(cls, device_type: str) -> bool:
        return device_type == "cpu"

    def __init__(self, device_type: str, compile: bool):
        super().__init__(device_type, False)       # the fallback meanwhile: the eager kernels
        self._ready: dict[torch.dtype, concurrent.futures.Future | bool] = {}
        self._failed: dict[torch.dtype, BaseException] = {}    # loads that failed, raised again

    def __repr__(self) -> str:
        return f"NumbaEngine({self.device_type})"

    # --- compiling: apart, then loaded here ----------------------------------------------
    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Load ``dtype``'s kernels now when numba's cache holds them (about half a
        second, once: at ``Recorder.attach``), else start their compile apart."""
        if device.type == "cpu" and dtype in _BITS:
            self.ready(dtype)

    def ready(self, dtype: torch.dtype, wait: bool = False) -> bool:
        """Whether ``dtype``'s kernels are loaded.  If not: their compile apart is
        started (``_compile_apart``), and once it has ended (``wait``: until it
        has) they are loaded on this thread: the training thread's, or the writer's
        (``settle``), never a background thread of their own (a Python-heavy half
        second it would stretch into seconds of the training thread's waits for the
        GIL).  Raises what the load, or a kernel off the training thread (``fail``),
        raised: the fault path demotes."""
        state = self._state(dtype)
        if state is True:
            return True
        if not (wait or state.done()):
            return False
        state.result()
        with self._lock:
            if dtype in self._failed:           # once: a failed load is not tried again
                raise self._failed[dtype]
            if self._ready[dtype] is not True:
                try:
                    with quiet():   # numba's warnings are not the user's news (``quiet``)
                        K.compile_for(_BITS[dtype][1])   # a load from the cache (else a compile)
                except Exception as e:
                    self._failed[dtype] = e
                    raise
                self._ready[dtype] = True
        return True

    def _state(self, dtype: torch.dtype) -> concurrent.futures.Future | bool:
        """``dtype``'s state: True (loaded), or its compile apart (started now if not
        yet)."""
        state = self._ready.get(dtype)
        if state is None:
            with self._lock:
                if dtype not in self._ready:
                    self._ready[dtype] = _pool("compile", 1).submit(_compile_apart,
                                                                    _BITS[dtype][1])
            state = self._ready[dtype]
        return state

    # --- deferred summaries: the training thread copies, the writer summarises ----------
    def later(self, dtype: torch.dtype) -> bool:
        """Whether a tensor of ``dtype`` had better be summarised later, off the
        training thread (``_summarizer.Later``): its kernels are on their way (their
        compile apart started here if not yet), not loaded and not failed.  Never
        loads, never waits."""
        if dtype not in _BITS or dtype in self._failed:
            return False
        return self._state(dtype) is not True

    def fail(self, dtype: torch.dtype, error: BaseException) -> None:
        """A kernel of ``dtype`` failed on the writer thread (``_summarizer.Later``):
        kept, so that ``ready`` raises it on the training thread too, where the
        fault path demotes the dtype (warned once, that capture counted)."""
        done = concurrent.futures.Future()
        done.set_result(None)
        with self._lock:
            self._failed.setdefault(dtype, error)
            self._ready[dtype] = done

    def settle(self, dtype: torch.dtype, timeout: float) -> bool:
        """On the writer thread: wait up to ``timeout`` seconds for ``dtype``'s
        compile apart, then load its kernels here (``ready``); whether there is
        nothing more to wait for: loaded, or failed (the failure is kept: ``ready``
        raises it again, on the training thread too, where the fault path demotes
        the dtype)."""
        if dtype not in _BITS or dtype in self._failed:
            return True
        state = self._state(dtype)
        if state is not True:
            concurrent.futures.wait([state], max(timeout, 0.0))
        try:
            return self.ready(dtype)
        except Exception:
            return True

    # --- the engine ---------------------------------------------------------------------
    def _read(self, x: torch.Tensor):
        """``bits`` of ``x`` (contiguous first) once its dtype's kernels are ready;
        None before (the eager kernels take it)."""
        if not self.ready(x.dtype):
            return None
        return bits(x if x.is_contiguous() else x.contiguous())

    @torch.compiler.disable
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if (read := self._read(x)) is None:
            return super().reduce(x)
        a, dec, table = read
        out = torch.empty(VECTOR, dtype=torch.float64)
        threads = torch.get_num_threads()
        if (threads < 2 or a.size < PARALLEL_MIN) and a.size <= _CHUNK_MAX:
            K.one(a, dec, table, out.numpy())
        else:
            shift = K.shift_of(a, 0, a.size, dec)
            parts, counts, special = self._parts(a, dec, shift, None, table.size >> 1)
            K.finish(a.size, shift, parts, counts, special, table, out.numpy())
        self._rescale(a, dec, out, (0, a.size))
        return out

    def _parts(self, a: np.ndarray, dec: np.ndarray, shift: float, scale: float | None,
               codes: int):
        """``K.chunk`` of ``a`` split across threads (``_splits``): each chunk's (sum,
        sum of squares, min, max), its codes' counts (LANES x ``codes``; none if 0)
        and its special values' counts."""
        cuts = _splits(a.size, torch.get_num_threads())
        n = len(cuts) - 1
        parts = np.empty((n, 4))
        counts = np.zeros((n, K.LANES, codes), np.int32) if codes else None
        special = np.zeros((n, 4), np.int64)
        self._split(lambda p: K.chunk(a, cuts[p], cuts[p + 1], dec, shift, scale,
                                      K.UNCOUNTED if counts is None else counts[p], special[p]),
                    parts, n)
        return parts, counts, special

    def _rescale(self, a: np.ndarray, dec: np.ndarray, vecs: torch.Tensor, offsets) -> None:
        """The sums of the float64 tensors (``vecs``' rows, at ``offsets`` in ``a``)
        whose largest finite magnitude asks for a scale (``scale_exponent``: past
        ``2 ** 448`` or below ``2 ** -448``), taken again, scaled: a second read,
        for those rare tensors only (the first found their extremes)."""
        if a.dtype != np.uint64:
            return
        vecs = vecs.numpy().reshape(-1, VECTOR)
        exps = scale_exponent(np.maximum(np.abs(vecs[:, 4]), np.abs(vecs[:, 5])))
        for r in np.flatnonzero(exps):
            parts = self._parts(a[offsets[r]:offsets[r + 1]], dec, vecs[r, 1],
                                math.ldexp(1.0, -int(exps[r])), 0)[0]
            vecs[r, 2], vecs[r, 3] = parts[:, 0].sum(), parts[:, 1].sum()

    @staticmethod
    def _split(work, rows: np.ndarray, n: int) -> None:
        """``rows[p] = work(p)`` for each chunk ``p``: the first on this thread, the
        others on the pool's (the kernels release the GIL); all on this thread
        when torch is given one thread (a tensor of more than ``_CHUNK_MAX``)."""
        if torch.get_num_threads() < 2:
            for p in range(n):
                rows[p] = work(p)
            return
        pool = _pool("stats", max(1, (os.cpu_count() or 2) - 1))
        futures = [pool.submit(work, p) for p in range(1, n)]
        rows[0] = work(0)
        for p, f in enumerate(futures, 1):
            rows[p] = f.result()

    @torch.compiler.disable
    def count_nonfinite(self, x: torch.Tensor) -> torch.Tensor:
        if (read := self._read(x)) is None:
            return super().count_nonfinite(x)
        a, dec, _ = read
        cuts = _splits(a.size, torch.get_num_threads())
        counts = np.zeros((len(cuts) - 1, 3), np.int64)

        def work(p):
            K.nonfinite(a, cuts[p], cuts[p + 1], dec, counts[p])
            return counts[p]
        self._split(work, counts, len(cuts) - 1)
        return torch.from_numpy(counts.sum(0).astype(np.float64))

    @torch.compiler.disable
    def reduce_many(self, xs: list[torch.Tensor], exp_bits: int) -> torch.Tensor:
        dtype = batched_dtype(exp_bits)
        if xs[0].device.type != "cpu" or not self.ready(dtype):
            return super().reduce_many(xs, exp_bits)
        flat = _flat(xs).to(dtype)                                 # 16-bit floats: float32
        sizes = np.fromiter((x.numel() for x in xs), np.int64, len(xs))
        offsets = np.zeros(len(xs) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        a, dec, table = bits(flat)
        table_out = torch.empty((len(xs), VECTOR), dtype=torch.float64)
        K.many(a, offsets, 0, len(xs), dec, table, table_out.numpy())
        self._rescale(a, dec, table_out, offsets)
        return table_out
