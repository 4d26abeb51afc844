"""The CPU statistics engines side by side, per tensor, against one read pass.

    python bench/bench_engines.py [--reps N]

Contenders, on the same tensors (the TransformerEncoder's 2-8 MB activations and
gradients of ``bench_recorder.py``, bfloat16 copies of two and a float8 copy of
one):

- ``x.sum()``: one read of the tensor, the floor (of its bytes, for float8);
- ``numba``: ``recorder.capture._numba.NumbaEngine`` (one read; a tensor split across
  threads by a pool of Python threads running ``nogil`` kernels);
- ``numba prange``: the same kernel run by ``@njit(parallel=True)`` over the
  chunks (numba's threading layer instead of the pool);
- ``torch compiled``: ``CpuEngine`` with ``torch.compile``d kernels (two
  fused kernels and a split ``bincount``: the engine before numba; float8
  widened to float32 first);
- ``torch eager``: the same kernels, eager.

And a step's tiny tensors: ``reduce_many`` of 402 tensors of 64 elements (the
``many`` workload's), per tensor.  Prints times, MB/s and the ratio to the
floor (best of ``--reps`` calls each); every contender's numbers are checked equal to the eager engine's
(counts, minimum, maximum and histogram exactly; sums to 1e-9).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from numba import njit, prange

from tensortape.recorder.capture import _nbkernels as K
from tensortape.recorder.capture._engines import CpuEngine
from tensortape.recorder.capture._numba import NumbaEngine, bits, _splits
from tensortape.recorder.capture._summary import VECTOR, prepared


@njit(parallel=True, nogil=True, cache=True)
def _prange(a, dec, shift, cuts, parts, counts, special):
    for p in prange(len(cuts) - 1):
        s, q, lo, hi = K.chunk(a, cuts[p], cuts[p + 1], dec, shift, None, counts[p], special[p])
        parts[p, 0], parts[p, 1], parts[p, 2], parts[p, 3] = s, q, lo, hi


def prange_reduce(x):
    a, dec, table = bits(x)
    shift = K.shift_of(a, 0, a.size, dec)
    cuts = np.array(_splits(a.size, torch.get_num_threads()), np.int64)
    parts = np.empty((len(cuts) - 1, 4))
    counts = np.zeros((len(cuts) - 1, K.LANES, table.size >> 1), np.int32)
    special = np.zeros((len(cuts) - 1, 4), np.int64)
    _prange(a, dec, shift, cuts, parts, counts, special)
    out = np.empty(VECTOR)
    K.finish(a.size, shift, parts, counts, special, table, out)
    return torch.from_numpy(out)


def tensors():
    """The TransformerEncoder's captured tensors (bench_recorder's ``kernel`` mode)."""
    from bench_recorder import hand_hooks, transformer
    m, x, layers = transformer()
    seen = []
    hand_hooks(m, layers, lambda k, t: seen.append((k, t.detach().clone())))
    m(x).pow(2).mean().backward()
    picked = seen[:: max(1, len(seen) // 4)]
    return picked + [(k + " bf16", t.bfloat16()) for k, t in picked[:2]] + [
        (k + " fp8", t.clamp(-448, 448).to(torch.float8_e4m3fn)) for k, t in picked[:1]]


def timed(fn, x, reps):
    """The best of ``reps`` calls (a shared machine: the minimum is the least noisy)."""
    fn(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return min(times)


def same(a, b, what):
    a, b = a.numpy(), b.numpy()
    exact = np.r_[0, 1, 4, 5, 6:a.shape[-1]]
    assert np.array_equal(a[..., exact], b[..., exact]), what
    np.testing.assert_allclose(a[..., 2:4], b[..., 2:4], rtol=1e-9, atol=1e-300, err_msg=what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    numba_engine = NumbaEngine("cpu", True)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        numba_engine.ready(dtype, wait=True)
    eager, compiled = CpuEngine("cpu", False), CpuEngine("cpu", True)
    contenders = {"numba": numba_engine.reduce, "numba prange": prange_reduce,
                  "torch compiled": compiled.reduce, "torch eager": eager.reduce}
    print(f"threads={torch.get_num_threads()}; per tensor, best of {args.reps}")
    # an 8-bit float as it is: each engine reads it its way
    cases = [(name, prepared(t)) for name, t in tensors()]
    for name, t in cases:                      # every contender checked (and compiled) first
        for cname, fn in contenders.items():
            same(fn(t), eager.reduce(t), cname)
    for name, t in cases:
        floor = timed(lambda t: (t.view(torch.uint8) if t.element_size() == 1 else t).sum(), t, args.reps)
        mb = t.numel() * t.element_size() / 1e6
        where = "from cache" if mb / floor > 60e3 else "from memory"   # MB/s past any DRAM's
        print(f"{name:30s} {str(t.dtype)[6:]:8s} {mb:5.1f} MB  x.sum() {mb / floor:6.0f} MB/s"
              f" (read {where})")
        for cname, fn in contenders.items():
            s = timed(fn, t, args.reps)
            note = "  (the floor is slower: a busy machine, not a reading)" if s < floor else ""
            print(f"    {cname:16s} {s * 1e3:7.2f} ms {mb / s:6.0f} MB/s  {s / floor:5.1f}x the floor"
                  f"{note}")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 16, generator=g) for _ in range(402)]
    print(f"reduce_many of {len(xs)} tensors of {xs[0].numel()} elements, per tensor")
    for cname, engine in (("numba", numba_engine), ("torch compiled", compiled), ("torch eager", eager)):
        same(engine.reduce_many(xs, 8), eager.reduce_many(xs, 8), cname)
        s = timed(lambda xs: engine.reduce_many(xs, 8), xs, args.reps)
        print(f"    {cname:16s} {s / len(xs) * 1e6:7.2f} us")


if __name__ == "__main__":
    main()
