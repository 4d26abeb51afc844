"""Gradient accumulation (two micro-batches a step): compare, first_divergence, the
browser's headline and `tensortape nan` read every micro-batch.

The truth is where the fault was put (an Inf, or a finite change, in one
micro-batch of one step) and what plain forward hooks on the same model saw;
never tensortape's own helpers."""
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import example, given, strategies as st
from torch import nn

from tensortape import Recorder, cli, open_run
from tensortape.analysis import compare_runs, first_divergence

from conftest import examples
from test_serve import Served

STEPS = 6
MICRO = 2
ORDER = ("wpe", "drop", "fc", "head")          # execution order of the recorded modules


class Net(nn.Module):
    """A small language-model-like stack: embedding, dropout (off), two linears."""

    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(16, 8)
        self.drop = nn.Dropout(0.0)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.drop(self.wpe(x)))))


def train(path, tensors_every, fault=None, samples=None):
    """``STEPS`` optimizer steps of ``MICRO`` micro-batches each, recorded at ``path``;
    ``fault`` = (step, micro-batches, how): the dropout's output there gets
    ``micro + 1`` Infs in its last sample (``"inf"``) or is scaled by 1.5
    (``"scale"``), by a hook registered before the recorder's; ``samples``: the
    recorder's ``max_samples`` (full tensors keep only the first).  Returns what
    plain forward hooks saw: {(module, step, micro): output}."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    at = {}

    def inject(module, args, out):
        if fault and at["step"] == fault[0] and at["micro"] in fault[1]:
            out = out.clone()
            if fault[2] == "inf":
                out[-1, 1, : at["micro"] + 1] = math.inf
            else:
                out = out * 1.5
            return out

    seen = {}
    model.drop.register_forward_hook(inject)
    for name in ORDER:
        getattr(model, name).register_forward_hook(
            lambda m, a, out, name=name: seen.__setitem__(
                (name, at["step"], at["micro"]), out.detach().clone().numpy()))
    with Recorder(model, path, layers=list(ORDER), tensors_every=tensors_every,
                  max_samples=samples, max_bytes=None, stats_every=1) as rec:
        for step in range(STEPS):
            with rec.step(step):
                for micro in range(MICRO):
                    at.update(step=step, micro=micro)
                    x = (torch.arange(12).reshape(3, 4) * (step + 1) + micro) % 16
                    model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return seen


def truth(seen_a, seen_b):
    """The first (step, module) whose output plain hooks saw differ, in step then
    execution order (the activations come before any gradient)."""
    for step in range(STEPS):
        for name in ORDER:
            for micro in range(MICRO):
                a, b = seen_a[(name, step, micro)], seen_b[(name, step, micro)]
                if not np.array_equal(a, b, equal_nan=True):
                    return step, name
    return None


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The run without a fault, per (tensors_every, max_samples), recorded once."""
    made = {}

    def get(every, samples):
        if (every, samples) not in made:
            path = str(tmp_path_factory.mktemp("clean") / "a.zarr")
            made[(every, samples)] = path, train(path, every, samples=samples)
        return made[(every, samples)]
    return get


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    return tmp_path_factory


@examples(3)
@given(step=st.integers(0, STEPS - 2), micro=st.integers(0, MICRO - 1),
       every=st.sampled_from([1, 2, 3, None]), how=st.sampled_from(["inf", "scale"]),
       samples=st.sampled_from([None, 1]))
@example(step=2, micro=1, every=2, how="scale", samples=None)    # a finite change, micro-batch 1
@example(step=3, micro=1, every=3, how="inf", samples=None)      # Infs in a full tensor
@example(step=1, micro=0, every=1, how="inf", samples=1)         # Infs past the kept samples
def test_the_first_divergence_is_where_the_fault_was_put(clean, where, step, micro, every, how,
                                                         samples):
    """Full tensors every ``every`` steps, of the first ``samples`` samples: where
    they hold the fault (any micro-batch) they show it, and where they do not (an
    Inf past ``max_samples``) the statistics still do."""
    a, seen_a = clean(every, samples)
    b = str(where.mktemp("faulty") / "b.zarr")
    seen_b = train(b, every, (step, (micro,), how), samples)
    assert truth(seen_a, seen_b) == (step, "drop")              # plain hooks agree with the fault
    assert first_divergence(a, b) == (step, "drop")
    r = CliRunner().invoke(cli.cli, ["compare", a, b, "--format", "json"])
    assert r.exit_code == 1, r.output
    got = json.loads(r.stdout)["first_divergence"]
    assert (got["step"], got["layer"]) == (step, "drop")
    served = Served(a, b)                                       # the browser's headline
    try:
        status, body = served.get("compare-map", kind="activations", width=1000)
    finally:
        served.close()
    assert status == 200 and body["first_divergence"] == {"step": step, "layer": "drop"}
    ds = compare_runs(a, b)
    for s in range(step):                                       # the same before the fault
        assert float(ds["stat_rel"].sel(step=s, layer="drop")) == 0
    if every is not None and step % every == 0:                 # full tensors at the fault's step
        x = ds.sel(step=step, layer="drop")
        if how == "inf" and samples:                            # past the kept samples
            assert float(x.rel_l2) == 0 and float(x.stat_rel) > 1e-3
        elif how == "inf":                                      # apart: no angle, no ratio
            assert float(x.rel_l2) == math.inf and float(x.max_abs) == math.inf
            assert float(x.sqnr_db) == -math.inf and math.isnan(float(x.cosine))
            cosine = json.loads(r.stdout)["layers"]["drop"]["cosine"]
            assert cosine == "nan"                              # the worst step's, not 1
        else:                                                   # every micro-batch, as one batch
            fa = np.concatenate([seen_a[("drop", step, m)][:samples].ravel() for m in range(MICRO)])
            fb = np.concatenate([seen_b[("drop", step, m)][:samples].ravel() for m in range(MICRO)])
            fa, fb = fa.astype(np.float64), fb.astype(np.float64)
            want = np.linalg.norm(fb - fa) / np.linalg.norm(fa)
            assert float(x.rel_l2) == pytest.approx(want, rel=1e-12)
            assert float(x.max_abs) == pytest.approx(np.abs(fb - fa).max(), rel=1e-12)
            cos = fa @ fb / (np.linalg.norm(fa) * np.linalg.norm(fb))
            assert float(x.cosine) == pytest.approx(cos, rel=1e-12)


def test_nan_labels_the_micro_batch_count_and_the_whole_step_count(tmp_path):
    """The header counts the first event's micro-batch; the history table counts
    whole steps (every micro-batch together); the other events their own
    micro-batch: each says which, and each is what plain hooks saw."""
    a = str(tmp_path / "a.zarr")
    seen = train(a, None, (3, (0, 1), "inf"))                  # 1 Inf, then 2 Infs
    r = CliRunner().invoke(cli.cli, ["nan", a])
    assert r.exit_code == 1, r.output
    lines = r.stdout.splitlines()
    infs = [int(np.isposinf(seen[("drop", 3, m)]).sum()) for m in range(MICRO)]
    assert infs == [1, 2]
    assert lines[0] == ("first non-finite: step 3, layer drop, activations (forward); in "
                        "micro-batch 0: 0 NaN, 1 +Inf, 0 -Inf")
    table = lines.index("drop (activations) in the steps before step 3, and at it; each step "
                        "whole (its micro-batches together):")
    row = lines[table + 3 + 3].split()      # after the two header lines: steps 0, 1, 2, then 3
    assert row[0] == "3" and row[-2] == "3"                     # 1 + 2
    assert "  drop (activations), in micro-batch 1: 0 NaN, 2 +Inf, 0 -Inf" in lines
    for m in range(MICRO):
        nan_fc = int(np.isnan(seen[("fc", 3, m)]).sum())
        inf_fc = int(np.isposinf(seen[("fc", 3, m)]).sum())
        ninf_fc = int(np.isneginf(seen[("fc", 3, m)]).sum())
        assert (f"  fc (activations), in micro-batch {m}: {nan_fc} NaN, {inf_fc} +Inf, "
                f"{ninf_fc} -Inf") in lines
