"""What a capture costs in memory: at most twice the tensor, plus a fixed allowance.

The first capture of a dtype on a fresh machine is the worst case: numba's kernels are still
compiling, so the capture is either copied for the writer (at most ``512 MiB`` of copies, and
half of ``max_pending_bytes``) or, past that bound, summarised by the torch kernels on the
training thread.  The eager torch kernels once took about 30 bytes of temporaries an element
(a 64 MiB bfloat16 tensor grew the process by 0.8 GiB; a float8 one by 1.8 GiB), which is how a
capture could kill training.

Each engine runs in a fresh process with empty numba and inductor caches, and records one
large tensor of every float dtype, a recording each; the peak resident memory (``VmHWM``,
reset before each step through ``/proc/self/clear_refs``) may grow by at most twice the
tensor's size plus ``ALLOWANCE``.  glibc's ``malloc`` is told to map every large block
itself (``MALLOC_MMAP_THRESHOLD_``), so memory freed by one recording is given back before
the next one's is measured.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 64 << 20                       # bytes of each tensor
ALLOWANCE = 96 << 20                  # bytes beyond twice the tensor: fixed costs
FLOAT8 = [n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                      "float8_e8m0fnu") if hasattr(torch, n)]
DTYPES = ["float32", "float64", "bfloat16", "float16"] + FLOAT8

MEASURE = textwrap.dedent("""
    import json, os, sys, torch
    from torch import nn
    from tensortape import Recorder

    size, dtypes, store = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    options = eval(sys.argv[4])

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(key))

    class Emit(nn.Module):
        def forward(self):
            return self.x

    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        x = torch.empty(size // dtype.itemsize, dtype=dtype)
        g = torch.Generator().manual_seed(0)
        for part in x.split(1 << 20):              # made a little at a time: a low peak
            part.copy_(torch.randn(part.numel(), generator=g) * 3)
        model = Emit()
        model.x = x
        rec = Recorder(model, f"{store}/{name}.zarr", layers="", capture="activations",
                       tensors_every=None, **options).attach()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                           # the peak, from now
        before = status("VmRSS:")
        with rec.step():
            model()
        rec.flush()                                # the writer has summarised it too
        out[name] = status("VmHWM:") - before
        rec.close()
        del model, x
    print(json.dumps(out), flush=True)
    os._exit(0)                 # not waiting for numba's compiles apart, nice'd on a busy machine
""")

CASES = {
    # numba, compiling apart: the capture is copied, the writer summarises it (its patience,
    # a third of close_timeout, runs out first: the torch kernels, on the copy)
    "numba, copied": ({"TENSORTAPE_ENGINE": "numba"}, {"close_timeout": 3.0}),
    # numba, compiling apart, past the copies' bound: the torch kernels, on the training thread
    "numba, past the copies' bound": ({"TENSORTAPE_ENGINE": "numba"},
                                      {"max_pending_bytes": SIZE}),
    "torch, eager": ({"TENSORTAPE_ENGINE": "torch", "TENSORTAPE_COMPILE": "0"}, {}),
}


def _measure(tmp_path, env, options, dtypes):
    env = dict(os.environ, **env, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), MALLOC_MMAP_THRESHOLD_="1048576")
    p = subprocess.run([sys.executable, "-c", MEASURE, str(SIZE), ",".join(dtypes),
                        str(tmp_path / "runs"), repr(options)],
                       env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if p.returncode and "clear_refs" in p.stderr:
        pytest.skip("this kernel does not let a process reset its peak memory")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("case", list(CASES))
def test_a_capture_costs_at_most_twice_its_tensor(tmp_path, case):
    if "numba" in case:
        pytest.importorskip("numba")
    env, options = CASES[case]
    grew = _measure(tmp_path, env, options, DTYPES)
    over = {d: f"{g / SIZE:.2f}x" for d, g in grew.items() if g > 2 * SIZE + ALLOWANCE}
    assert not over, f"{case}: the peak grew by more than twice the tensor: {over}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_compiled_torch_kernels_too(tmp_path):
    """The compiled torch kernels, compiled in this process on an empty cache: their codes
    are a tensor's worth of integers, twice a bfloat16's, four times a float8's (widened
    first, once)."""
    env = {"TENSORTAPE_ENGINE": "torch", "TENSORTAPE_COMPILE": "1"}
    grew = _measure(tmp_path, env, {}, ["bfloat16", FLOAT8[0]])
    over = {d: f"{g / SIZE:.2f}x" for d, g in grew.items() if g > 2 * SIZE + ALLOWANCE}
    assert not over, f"compiled: the peak grew by more than twice the tensor: {over}"
