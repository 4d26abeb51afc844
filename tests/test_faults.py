"""The fault matrix: a store on a small tmpfs that fills up, turns read-only, or is slow.

The tests mount and unmount the file system themselves and are skipped, with the
reason, where that is not allowed (not root, or no mount in this container).
With ``on_error="warn"`` training goes on, statistics are kept and written once the
store can be written again, and what was lost is counted; with ``"raise"`` one
clear error; either way every committed step stays intact.
"""
import contextlib
import os
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from tensortape.analysis import open_run
from tensortape.recorder import Recorder, RecorderError

UNWRITABLE = "store could not be written"


@contextlib.contextmanager
def tmpfs(path, size: str):
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield str(path)
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(path, mode):
    subprocess.run(["mount", "-o", f"remount,{mode}", path], check=True)


def _fill(path):
    """Write a file until the file system is full; return it."""
    filler = os.path.join(path, "filler")
    block = b"\0" * (64 << 10)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass
    return filler


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _train(model, rec, steps, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in steps:
        with rec.step(i):
            loss = model(x[i]).square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()


def _run(store, fault=None, on_error="warn", model=None):
    """20 steps; the fault (a context manager) is on for steps 5-14.  No disk budget: a
    small fake disk's "auto" budget would warn of its own, which is not under test."""
    model = model or _model()
    x = torch.randn(20, 16, 32, generator=torch.Generator().manual_seed(1))
    with Recorder(model, store, layers=["0", "2"], flush_interval=0.05, on_error=on_error,
                  max_bytes=None, tensors_every=1, stats_every=1) as rec:
        _train(model, rec, range(5), x)
        rec.flush()
        with fault() if fault else contextlib.nullcontext():
            _train(model, rec, range(5, 15), x)
            rec.flush()                             # the writer meets the fault (a flush
                                                    # tries once, and returns under "warn")
        deadline = time.monotonic() + 300           # ... and writes again once it is gone,
        while 14 not in (live := open_run(store).steps()) and time.monotonic() < deadline:
            time.sleep(0.05)                        # while training waits here
        _train(model, rec, range(15, 20), x)
    return model, live


def _full_disk(mnt):
    @contextlib.contextmanager
    def fault():
        filler = _fill(mnt)
        try:
            yield
        finally:
            os.remove(filler)
    return fault


def _read_only(mnt):
    @contextlib.contextmanager
    def fault():
        _remount(mnt, "ro")
        try:
            yield
        finally:
            _remount(mnt, "rw")
    return fault


FAULTS = {"disk full": _full_disk, "read-only": _read_only}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_warn_trains_on_and_writes_again(tmp_path, name):
    ref_model, _ = _run(str(tmp_path / "ref.zarr"))
    ref = open_run(str(tmp_path / "ref.zarr"))
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        store = os.path.join(mnt, "run.zarr")
        with pytest.warns(RuntimeWarning, match="cannot be written.*training goes on") as told:
            model, live = _run(store, FAULTS[name](mnt))
        assert sum("cannot be written" in str(w.message) for w in told) == 1   # once a fault
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)                # training went on, untouched
        assert 14 in live.tolist()                  # written again while training
        run = open_run(store)
        assert run.status == "complete"
        assert run.steps().tolist() == list(range(20))   # statistics of every step, exact
        for kind in ("activations", "gradients"):
            assert run.stats(kind).equals(ref.stats(kind))
        lost = sum(20 - len(run.steps(kind, tensors=True)) for kind in run.kinds
                   for _ in run.tensor_layers(kind))
        assert lost > 0 and run.dropped == lost == run.attrs["drop_reasons"][UNWRITABLE]
        for kind in run.kinds:                      # each full tensor kept is the reference's
            for layer in run.tensor_layers(kind):
                got, want = run.tensor(layer, kind), ref.tensor(layer, kind)
                np.testing.assert_array_equal(got.values, want.sel(step=got.step).values)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_raise_stops_with_one_error_and_keeps_what_was_committed(tmp_path, name):
    _run(str(tmp_path / "ref.zarr"))
    ref = open_run(str(tmp_path / "ref.zarr"))
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        store = os.path.join(mnt, "run.zarr")
        model = _model()
        with pytest.raises(RecorderError, match="writing the store failed") as err:
            _run(store, FAULTS[name](mnt), on_error="raise", model=model)
        assert len(str(err.value).splitlines()) == 1
        assert not any(m._forward_hooks for m in model.modules())    # the hooks are gone
        run = open_run(store)
        assert run.status == "interrupted"
        steps = run.steps().tolist()
        assert steps[:5] == list(range(5))          # committed before the fault
        assert run.stats().equals(ref.stats().sel(step=steps))


class _SlowFS:
    """A local file system whose every file write first waits 30 ms (a slow disk)."""

    @staticmethod
    def register():
        from fsspec import register_implementation
        from fsspec.implementations.local import LocalFileSystem

        class Slow(LocalFileSystem):
            protocol = "slowdisk"

            def __init__(self, *args, **kw):
                super().__init__(*args, auto_mkdir=True, **kw)

            def open(self, path, mode="rb", **kw):
                if "w" in mode:
                    time.sleep(0.03)
                return super().open(path, mode, **kw)

        register_implementation("slowdisk", Slow, clobber=True)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fixed_mmap_threshold() -> None:
    """glibc serves a block of 1 MiB or more by mmap, given back when freed, from now
    on.  By default the threshold follows the largest block freed, so the 4 MiB
    buffers of one step end up in the heap and stay in RSS after they are freed: the
    allocator's retention (64-70 MiB here), not memory anyone holds."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)        # M_MMAP_THRESHOLD
    except (OSError, AttributeError):                       # not glibc: nothing to fix
        pass


def test_a_slow_disk_holds_memory_to_the_bound_and_loses_nothing(tmp_path):
    _SlowFS.register()
    _fixed_mmap_threshold()
    with tmpfs(tmp_path / "mnt", "512m") as mnt:
        store = f"slowdisk://{mnt}/run.zarr"
        lin = torch.nn.Linear(1024, 1024)
        x = torch.randn(1024, 1024)                 # 4 MiB a full tensor
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.wait(0.005):
                peak.append(_rss())
        sampler = threading.Thread(target=sample)
        with Recorder(lin, store, layers="", capture="activations", compression=None,
                      max_pending_bytes=8 << 20, flush_interval=1.0, tensors_every=1, stats_every=1) as rec:
            for i in range(40):                     # 160 MiB of tensors in all
                if i == 8:                          # warmed up (kernels compiled, buffers made)
                    rec.flush()
                    base, train = _rss(), time.monotonic()
                    sampler.start()
                with rec.step(i), torch.no_grad():
                    lin(x + i)
            train = time.monotonic() - train
        stop.set()
        sampler.join()
        assert train > 0.5                          # the disk held training back ...
        assert max(peak) - base < 40 << 20          # ... not a queue: 128 MiB were recorded
        run = open_run(store)
        assert run.steps("activations", tensors=True).tolist() == list(range(40))
        with torch.no_grad():
            np.testing.assert_array_equal(run.tensor("(root)", step=39).values,
                                          lin(x + 39).numpy())
