"""Bounded memory on an accelerator, checked on the CPU with a fake device.

The fake stands in for CUDA's copies (``recorder.capture._snapshot.COPIES``): it keeps
a "device clone" alive until its copy to the host lands, and lands a copy only
after the recorder has asked about it a few times (a slow device).  It measures
the device and pinned bytes alive at every moment, and which thread ever waits
for a copy.  The tests check, through the public API and against plain hooks:

- the device and pinned bytes never pass ``max_device_bytes`` and
  ``max_pinned_bytes``; past them full tensors are dropped and counted, with
  the cap's name, and every full tensor that is stored is bit-exact;
- the training thread never waits for a copy;
- pinned slots are reused: a long run allocates no more than a short one;
- the ring's steps are kept in ordinary host memory, and dumped bit-exact.
"""
import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from tensortape.recorder.capture import _snapshot

KIB = 1 << 10


class Event:
    def __init__(self, nbytes, lands_after):
        self.nbytes, self.queries, self.lands_after, self.landed = nbytes, 0, lands_after, False


class FakeDevice:
    """CUDA's copies, played on the CPU by a slow device (see the module)."""

    def __init__(self, lands_after=3):
        self.lands_after = lands_after
        self.device = self.device_peak = 0
        self.pinned_now = self.pinned_peak = self.pinned_made = 0
        self.waited_on = set()
        self.lock = threading.Lock()

    def pinned(self, nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.pinned_now += nbytes
            self.pinned_made += nbytes
            self.pinned_peak = max(self.pinned_peak, self.pinned_now)
        weakref.finalize(t, self._freed, nbytes)
        return t

    def _freed(self, nbytes):
        with self.lock:
            self.pinned_now -= nbytes

    def start(self, t, host):
        host.copy_(t)                     # faithful at capture, as the clone is
        nbytes = t.numel() * t.element_size()
        with self.lock:
            self.device += nbytes         # the clone lives until its copy lands
            self.device_peak = max(self.device_peak, self.device)
        return Event(nbytes, self.lands_after)

    def _land(self, event):
        with self.lock:
            if not event.landed:
                event.landed = True
                self.device -= event.nbytes

    def done(self, event):
        event.queries += 1
        if event.queries >= event.lands_after:
            self._land(event)
        return event.landed

    def wait(self, event):
        self.waited_on.add(threading.current_thread().name)
        self._land(event)


@pytest.fixture
def device(monkeypatch):
    fake = FakeDevice()
    monkeypatch.setitem(_snapshot.COPIES, "cpu", fake)
    return fake


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Tanh())


def run_steps(m, rec, steps, seen, nan_at=None, flush=False):
    """Train; ``seen`` gets every activation by plain hooks: (name, step) -> copy."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = {"i": None}
    for name, mod in m.named_modules():
        mod.register_forward_hook(
            lambda mod, a, out, name=name or "(root)": seen.__setitem__((name, step["i"]),
                                                                        out.detach().clone()))
    for i in range(steps):
        step["i"] = i
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i))
        if i == nan_at:
            x[0, 0] = float("nan")
        with rec.step(i):
            loss = m(x).square().mean()
            loss.backward()
        if i != nan_at:                   # the NaN stays in its step
            opt.step()
        opt.zero_grad()
        if flush:
            rec.flush()


def stored_activations(path):
    run = open_run(path)
    out = {}
    for name in run.tensor_layers("activations"):
        for step in run.steps("activations", tensors=True, layer=name).tolist():
            out[(name, step)] = run.tensor(name, "activations", step=step).values
    return run, out


def test_the_caps_hold_and_what_passes_them_is_dropped_and_counted(device, tmp_path):
    # one activation is 32 x 128 x 4 = 16 KiB (or 8 KiB); a gradient the same
    m, seen = model(), {}
    with Recorder(m, tmp_path / "run", capture=("activations",), max_device_bytes=40 * KIB,
                  max_pinned_bytes=96 * KIB, flush_interval=0.05, tensors_every=1, stats_every=1) as rec:
        run_steps(m, rec, 12, seen)
    assert device.device_peak <= 40 * KIB
    assert device.pinned_peak <= 96 * KIB
    run, stored = stored_activations(tmp_path / "run")
    reasons = run.attrs["drop_reasons"]
    capped = reasons.get(_snapshot.DEVICE_CAP, 0) + reasons.get(_snapshot.PINNED_CAP, 0)
    assert capped > 0, reasons
    assert len(stored) + capped == len(seen)           # every capture stored or counted
    for key, values in stored.items():
        np.testing.assert_array_equal(values, seen[key].numpy(), err_msg=str(key))
    assert "MainThread" not in device.waited_on


def test_slots_are_reused_and_nothing_is_dropped_under_roomy_caps(device, tmp_path):
    m, seen = model(), {}
    with Recorder(m, tmp_path / "run", capture=("activations",), flush_interval=0.05, tensors_every=1, stats_every=1) as rec:
        run_steps(m, rec, 40, seen, flush=True)      # the writer keeps up: a step in flight
    run, stored = stored_activations(tmp_path / "run")
    assert run.dropped == 0
    assert stored.keys() == seen.keys()
    for key, values in stored.items():
        np.testing.assert_array_equal(values, seen[key].numpy(), err_msg=str(key))
    step_bytes = sum(v.numel() * v.element_size() for (_, s), v in seen.items() if s == 0)
    assert device.pinned_made <= 2 * step_bytes      # 40 steps through the slots of one
    assert "MainThread" not in device.waited_on


def test_the_ring_lives_in_host_memory_and_dumps_bit_exact(device, tmp_path):
    m, seen = model(), {}
    with Recorder(m, tmp_path / "run", capture=("activations",), tensors_every=None, ring=3,
                  on_nonfinite="dump", flush_interval=0.05, stats_every=1) as rec:
        run_steps(m, rec, 30, seen, nan_at=20, flush=True)
    run, stored = stored_activations(tmp_path / "run")
    assert run.dropped == 0
    assert sorted({s for _, s in stored}) == [17, 18, 19, 20]
    for key, values in stored.items():
        np.testing.assert_array_equal(values, seen[key].numpy(), err_msg=str(key))
    # a ring holding its pinned slots would need four steps of them
    step_bytes = sum(v.numel() * v.element_size() for (_, s), v in seen.items() if s == 0)
    assert device.pinned_made <= 2 * step_bytes
    assert "MainThread" not in device.waited_on


def test_a_snapshot_freed_while_the_pool_allocates_never_deadlocks(device):
    """A snapshot's finaliser gives its slot back; it may run inside ``take`` (any
    allocation can free the last reference), while the pool's lock is held."""
    stager = _snapshot.Stager(1 << 20, 1 << 20)
    held = [stager.take(torch.ones(1000), None, None)]       # a 4 KiB slot
    held[0].host()
    real = device.pinned

    def pinned(nbytes):
        held.clear()                                         # its finaliser runs here
        return real(nbytes)
    device.pinned = pinned
    t = threading.Thread(target=stager.take, args=(torch.ones(5000), None, None), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "take() deadlocked on a slot given back inside it"
