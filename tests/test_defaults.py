"""The defaults a user can leave on: ``Recorder(model, path)`` and nothing else.

What README's "What it keeps by default" promises, checked against the plain reference
recorder (``oracle.py``: hooks and numpy) driven with those documented settings written out:
statistics and histograms of every module's output and gradient at every step, no full tensors but, at a step holding a NaN/Inf, that step's and the
two steps' before it.  The CLI's
``record`` stores the same configuration as Python's zero-configuration run, and ``info``
says what a run keeps.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from torch import nn

from oracle import Oracle
from tensortape import Recorder, open_run
from tensortape.recorder import LayerNotFoundError
from tensortape.cli import cli

# README's words, written out: what a zero-configuration run records
DOCUMENTED = dict(capture=("activations", "gradients"), stats_every=1, tensors_every=None,
                  ring=2, on_nonfinite="dump")
STEPS = 7


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _x(step: int, nan: bool) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    if nan:
        x[1, 2] = float("nan")
    return x


@settings(max_examples=5, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.sets(st.integers(0, STEPS - 1), max_size=2))
def test_zero_config_keeps_statistics_every_step_and_the_full_tensors_around_a_nan(tmp_path, bad):
    """No optimizer step (the model stays finite): the steps in ``bad`` see a NaN in
    their input, every other step is clean."""
    store = str(tmp_path / f"run{len(os.listdir(tmp_path))}.zarr")
    model = Net()
    twin = copy.deepcopy(model)
    oracle = Oracle(twin, "*", **DOCUMENTED)
    with Recorder(model, store) as rec:
        for s in range(STEPS):
            with rec.step(s):
                oracle.begin(s)
                for m in (model, twin):
                    m(_x(s, s in bad)).square().mean().backward()
                oracle.end()
            for m in (model, twin):
                m.zero_grad()
    oracle.close()
    run = open_run(store)
    assert run.layers == oracle.names()
    for kind in ("activations", "gradients"):
        assert run.steps(kind).tolist() == list(range(STEPS))          # statistics every step
        ds = run.stats(kind).compute()
        for s, k, name in oracle.keys():
            if k != kind:
                continue
            want, got = oracle.stats(s, kind, name), ds.sel(step=s, layer=name)
            for stat in ("count", "nan", "min", "max"):
                assert float(got[stat]) == want[stat] or np.isnan(want[stat]), (s, name, stat)
            np.testing.assert_array_equal(run.histogram(name, kind, step=s).values,
                                          oracle.histogram(s, kind, name))
    want = oracle.tensors()
    stored = {(k, n, s) for k in ("activations", "gradients") for n in run.layers
              for s in _tensor_steps(run, k, n)}
    assert stored == {(k, n, s) for k, n, s, _ in want}                # those steps, no others
    assert {s for _, _, s in stored} == {s - d for s in bad for d in range(3) if s - d >= 0}
    for (kind, name, s, micro), t in want.items():
        np.testing.assert_array_equal(run.tensor(name, kind, step=s, micro=micro).values,
                                      t.numpy(), err_msg=f"{kind} {name} {s}")
    assert [e.step for e in run.events][:1] == sorted(bad)[:1]
    assert {e.step for e in run.events} == bad                         # counted every step


def _tensor_steps(run, kind: str, layer: str) -> list[int]:
    try:
        return [int(s) for s in run.steps(kind, tensors=True, layer=layer)]
    except LayerNotFoundError:               # none of its full tensors is stored
        return []


SCRIPT = """
import sys, torch
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(3):
    m(torch.randn(8, 4)).square().mean().backward()
    opt.step(); opt.zero_grad()
"""


def test_the_cli_records_with_the_recorders_defaults(tmp_path):
    """``tensortape record`` with no flags stores the configuration a Python
    ``Recorder(model, path)`` stores: one meaning for an argument in both."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cli_store, py_store = str(tmp_path / "cli.zarr"), str(tmp_path / "py.zarr")
    p = subprocess.run([sys.executable, "-m", "tensortape", "record", "-o", cli_store, "--",
                        "python", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with Recorder(m, py_store) as rec:
        with rec.step():
            m(torch.randn(8, 4)).square().mean().backward()
    a, b = open_run(cli_store).config, open_run(py_store).config
    for key in ("capture", "tensors_every", "stats_every", "ring", "on_nonfinite", "max_samples",
                "tensor_dtype", "compression", "flush_interval", "close_timeout"):
        assert a[key] == b[key], key
    assert (b["stats_every"], b["tensors_every"], b["ring"], b["on_nonfinite"]) == \
        (1, None, 2, "dump")


def test_info_says_what_a_run_keeps(tmp_path):
    store = str(tmp_path / "r.zarr")
    m = Net()
    with Recorder(m, store) as rec:
        with rec.step():
            m(_x(0, False)).sum().backward()
    out = CliRunner().invoke(cli, ["info", store]).output
    line = next(x for x in out.splitlines() if x.startswith("records"))
    assert "statistics every step" in line and "NaN/Inf counted" not in line
    assert "full tensors none" in line
    assert "ring of 2 steps before" in line and "on_nonfinite='dump'" in line
    j = CliRunner().invoke(cli, ["info", store, "--format", "json"]).output
    assert '"ring": 2' in j and '"on_nonfinite": "dump"' in j


def test_a_ring_default_follows_on_nonfinite(tmp_path):
    """``ring`` left out: 2 steps where ``on_nonfinite`` dumps them, none where it only
    records (a ring there would never be stored)."""
    m = Net()
    for policy, ring in (("record", 0), ("dump", 2), ("raise", 2)):
        store = str(tmp_path / f"{policy}.zarr")
        with Recorder(m, store, on_nonfinite=policy) as rec:
            with rec.step():
                m(_x(0, False)).sum().backward()
        assert open_run(store).config["ring"] == ring, policy


class Spread(nn.Module):
    """Tiny outputs in three float dtypes (their gradients too), one output past the
    batched sizes (``_summary.SMALL`` and ``FEW``), and an in-place op after a capture that turns an
    Inf into a finite value: the counts are of the tensor as it was captured."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(1)
        self.fc1, self.act, self.fc2 = nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)
        self.wide = nn.Linear(6, 16400)                 # 4 x 16400 elements: not batched
        self.dtype = dtype

    def forward(self, x):
        h = self.fc1(x)
        y = self.fc2(self.act(h.to(self.dtype)).float())
        y.clamp_(-1e30, 1e30)                           # fc2's Inf is gone after its capture
        return y.sum() + self.wide(x).mean()


@settings(max_examples=8, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stats_every=st.integers(1, 3), dumps=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       bad=st.dictionaries(st.integers(0, STEPS - 1),
                           st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5),
                                              st.sampled_from([float("nan"), float("inf"),
                                                               -float("inf")])),
                                    min_size=1, max_size=4), max_size=4))
def test_steps_without_statistics_count_nan_and_inf_exactly(tmp_path, stats_every, dumps, dtype,
                                                            bad):
    """Every step's NaN/+Inf/-Inf counts of every output and gradient, as plain hooks
    count them at capture time, whether or not the step has statistics (between
    statistics the tiny tensors are counted in one batch a step), with a ring or not."""
    store = str(tmp_path / f"run{len(os.listdir(tmp_path))}.zarr")
    model = Spread(dtype)
    twin = copy.deepcopy(model)
    kw = dict(capture=("activations", "gradients"), stats_every=stats_every, tensors_every=None,
              ring=2 if dumps else 0, on_nonfinite="dump" if dumps else "record")
    oracle = Oracle(twin, "*", **kw)
    with Recorder(model, store, **kw) as rec:
        for s in range(STEPS):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(s))
            for row, col, value in bad.get(s, []):
                x[row, col] = value
            with rec.step(s):
                oracle.begin(s)
                for m in (model, twin):
                    m(x).backward()
                oracle.end()
    oracle.close()
    events = [(e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf)
              for e in open_run(store).events]
    assert events == oracle.events()
    assert {e[0] for e in events} == set(bad)
