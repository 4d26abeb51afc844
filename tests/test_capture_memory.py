"""What a capture costs in memory: at most twice the tensor, plus a fixed allowance.

The first capture of a dtype on a fresh machine is the worst case: numba's kernels are still
compiling, so the capture is either copied for the writer (at most ``512 MiB`` of copies, and
half of ``max_pending_bytes``) or, past that bound, summarised by the eager torch kernels on the
training thread; the torch engine compiles its kernels at that capture.  The eager torch
kernels once took about 30 bytes of temporaries an element (a 64 MiB bfloat16 tensor grew the
process by 0.8 GiB; a float8 one by 1.8 GiB), which is how a capture could kill training.

Each engine runs in a fresh process with empty numba and inductor caches and records one large
tensor of every float dtype, a recording each (numba: two, past the copies' bound and within
it); the peak resident memory (``VmHWM``, reset before each step through
``/proc/self/clear_refs``) may grow by at most twice the tensor plus ``ALLOWANCE``.  glibc's
``malloc`` is told to map every large block itself (``MALLOC_MMAP_THRESHOLD_``), so memory
freed by one recording is given back before the next one's is measured.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 64 << 20                       # bytes of each tensor
ALLOWANCE = 128 << 20                 # bytes beyond twice the tensor: fixed costs (numba's
                                      # kernels loaded, the torch kernels' pieces, a compile)
FLOAT8 = [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                      "float8_e8m0fnu") if hasattr(torch, n)]
DTYPES = ["float32", "float64", "bfloat16", "float16"] + FLOAT8

MEASURE = textwrap.dedent("""
    import gc, json, os, sys, torch
    from torch import nn
    from tensortape import Recorder

    size, dtypes, store = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    ways = eval(sys.argv[4])                       # {name: Recorder options}

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(key))

    class Emit(nn.Module):
        def forward(self):
            return self.x

    out = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        x = torch.empty(size // dtype.itemsize, dtype=dtype)
        g = torch.Generator().manual_seed(0)
        for part in x.split(1 << 20):              # made a little at a time: a low peak
            part.copy_(torch.randn(part.numel(), generator=g) * 3)
        for way, options in ways.items():
            model = Emit()
            model.x = x
            rec = Recorder(model, f"{store}/{dtype_name}-{len(out)}.zarr", layers="",
                           capture="activations", tensors_every=None, **{"stats_every": 1, **options}).attach()
            gc.collect()                           # the last recording's garbage, gone now
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                       # the peak, from now
            before = status("VmRSS:")
            with rec.step():
                model()
            rec.flush()                            # the writer has summarised it too
            out[f"{way}, {dtype_name}"] = status("VmHWM:") - before
            rec.close()
    print(json.dumps(out), flush=True)
    os._exit(0)           # not waiting for numba's compiles apart (the test ends them)
""")

# per engine, its ways of recording a first capture
ENGINES = {
    "numba": ({"TENSORTAPE_ENGINE": "numba"}, {
        # compiling apart, past the copies' bound: the eager torch kernels, on the training
        # thread (as with TENSORTAPE_COMPILE=0)
        "numba past the copies' bound": {"max_pending_bytes": SIZE},
        # compiling apart: copied, and summarised by the writer (its patience, a third of
        # close_timeout, runs out first: the eager torch kernels, on the copy)
        "numba copied": {"close_timeout": 3.0}}),
    # the torch kernels, compiled at the first capture of each dtype: a code an element
    "torch": ({"TENSORTAPE_ENGINE": "torch", "TENSORTAPE_COMPILE": "1"}, {"torch compiled": {}}),
}


def _start(tmp_path, env, ways):
    """A fresh process, in a session of its own, with empty caches, recording every dtype
    in each of ``ways``."""
    env = dict(os.environ, **env, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               MALLOC_MMAP_THRESHOLD_="1048576")
    return subprocess.Popen([sys.executable, "-c", MEASURE, str(SIZE), ",".join(DTYPES),
                             str(tmp_path / "runs"), repr(ways)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_capture_costs_at_most_twice_its_tensor(tmp_path):
    pytest.importorskip("numba")
    running = [_start(tmp_path / name, *ENGINES[name]) for name in ENGINES]   # at once
    grew = {}
    try:
        for p in running:
            out, err = p.communicate(timeout=1800)
            if p.returncode and "clear_refs" in err:
                pytest.skip("this kernel does not let a process reset its peak memory")
            assert p.returncode == 0, err[-3000:]
            grew.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in running:                          # numba's compiles apart, left running
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(grew) == 3 * len(DTYPES)
    over = {k: f"{g / SIZE:.2f}x" for k, g in grew.items() if g > 2 * SIZE + ALLOWANCE}
    assert not over, f"the peak grew past twice the tensor and {ALLOWANCE >> 20} MiB: {over}"
