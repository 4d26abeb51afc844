"""on_nonfinite="replay": the aten op and the line that made a step's first NaN/Inf.

Each test makes a real fault at a known step, in a known line of this file, and
checks through the public API (``run.first_nonfinite().replay`` and
``tensortape nan``) that the replay names that op, that line, the producer
module (not a module that only passed the NaN on), and the op's inputs; and
that training is untouched (parameters bit-identical to a run without the
recorder, with dropout and BatchNorm in the producer).
"""
import functools
import inspect
import math
import os
import random
import socket
import subprocess
import sys
import textwrap

import numpy as np
import torch
import zarr
from click.testing import CliRunner
from torch import nn

from tensortape.analysis import open_run
from tensortape.cli import cli
from conftest import train
from tensortape.recorder import Recorder

HERE = __file__


def line_of(fn, text):
    """``file:line`` of the line of ``fn`` holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return f"{HERE}:{hits[0]}"


class LayerNorm(nn.Module):
    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / var.sqrt()


class Softmax(nn.Module):
    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


class LogAttention(nn.TransformerEncoderLayer):
    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = super()._sa_block(x, attn_mask, key_padding_mask, is_causal)
        return torch.log(x)


class Scale(nn.Module):
    """A layer that turns its input into 0 at a step the test picks: 0 * log(0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.broken = False

    def forward(self, x):
        y = self.lin(x)
        if self.broken:
            y = y * 0
            return y * torch.log(y)
        return y


def replayed(tmp_path, model, steps, batch, fault=None, **kw):
    path = str(tmp_path / "run.zarr")
    with Recorder(model, path, on_nonfinite="replay", tensors_every=None, **{"stats_every": 1, **kw}) as rec:
        train(model, steps, batch, rec, fault=fault)
    return open_run(path)


def batch6(i):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(i))


def record_layernorm(tmp_path, steps):
    """At step 2 the Linear before the LayerNorm is zeroed, its bias 0.5: every row
    constant, a zero variance."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), LayerNorm(), nn.Linear(6, 3))

    def fault(model, i):
        if i == 2:
            with torch.no_grad():
                model[0].weight.zero_()
                model[0].bias.fill_(0.5)
    return replayed(tmp_path, m, steps, batch6, fault)


def record_sqrt(tmp_path):
    """SqrtAt breaks at step 1: a finite forward, a NaN made in backward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), SqrtAt(), nn.Linear(6, 3))

    def fault(model, i):
        model[1].zero = i == 1
    return replayed(tmp_path, m, 2, batch6, fault)


def test_a_layernorm_dividing_by_a_zero_variance(tmp_path):
    run = record_layernorm(tmp_path, 4)
    first = run.first_nonfinite()
    assert (first.step, first.layer, first.kind) == (2, "1", "activations")
    r = first.replay
    assert r["op"] == "aten::div.Tensor" and r["module"] == "1" and r["module_class"] == "LayerNorm"
    assert r["source"] == line_of(LayerNorm.forward, "/ var.sqrt()")
    numerator, denominator = r["inputs"]
    assert denominator["shape"] == [4, 1] and denominator["max"] == 0.0
    assert numerator["abs_max"] == 0.0 and numerator["nan"] == 0
    out = CliRunner().invoke(cli, ["nan", str(tmp_path / "run.zarr")])
    assert out.exit_code == 1
    assert f"made by aten::div.Tensor in 1 (LayerNorm), at {r['source']}" in out.output
    assert "return (x - mu) / var.sqrt()" in out.output


def test_a_softmax_whose_exp_overflows_in_float16(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), Softmax()).half()

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randn(4, 8, generator=g) * (40.0 if i == 3 else 0.1)).half()

    run = replayed(tmp_path, m, 5, batch)
    first = run.first_nonfinite()
    assert first.step == 3
    r = first.replay
    assert r["op"] == "aten::exp" and r["module_class"] == "Softmax"
    assert r["source"] == line_of(Softmax.forward, "torch.exp(x)")
    (x,) = r["inputs"]
    assert x["dtype"] == "float16" and x["max"] > math.log(65504)


def test_log_of_a_negative_inside_a_transformer_layers_attention(tmp_path):
    torch.manual_seed(0)
    layer = LogAttention(16, 2, 32, dropout=0.0, batch_first=True)
    m = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def batch(i):
        return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i))

    run = replayed(tmp_path, m, 1, batch)
    first = run.first_nonfinite()
    r = first.replay
    # the attention block's own children (self_attn, its out_proj) are finite: the
    # producer is the layer, the deepest recorded module whose inputs were finite
    assert r["module"] == "layers.0" and r["module_class"] == "LogAttention"
    assert r["op"] == "aten::log"
    assert r["source"] == line_of(LogAttention._sa_block, "torch.log(x)")
    assert r["inputs"][0]["min"] < 0


def test_the_producer_is_the_layer_that_made_it_not_those_that_passed_it_on(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Scale(), nn.Linear(8, 8), nn.Tanh(),
                      nn.Linear(8, 8))

    def fault(model, i):
        model[2].broken = i == 2

    def batch(i):
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))

    run = replayed(tmp_path, m, 3, batch, fault)
    nan_layers = [e.layer for e in run.events if e.step == 2 and e.kind == "activations"]
    assert nan_layers[:4] == ["2", "3", "4", "5"]          # made in 2, passed through 3-5
    r = run.first_nonfinite().replay
    # log(0) is the first op whose inputs are finite and output is not (-inf); 0 * -inf
    # then makes the NaN
    assert r["module"] == "2" and r["op"] == "aten::log"
    assert r["source"] == line_of(Scale.forward, "return y * torch.log(y)")
    assert r["inputs"][0]["abs_max"] == 0.0


def test_a_compiled_model_is_replayed_eagerly(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), LayerNorm(), nn.Linear(6, 3))
    compiled = torch.compile(m, backend="eager")

    def batch(i):
        return torch.zeros(4, 6) if i == 1 else torch.randn(4, 6, generator=torch.Generator().manual_seed(i))

    def fault(model, i):
        if i == 1:
            with torch.no_grad():
                m[0].weight.zero_()
                m[0].bias.zero_()
    run = replayed(tmp_path, compiled, 2, batch, fault)
    r = run.first_nonfinite().replay
    assert r["op"] == "aten::div.Tensor" and r["module"] == "1"
    assert r["source"] == line_of(LayerNorm.forward, "/ var.sqrt()")


class Noisy(nn.Module):
    """Dropout and BatchNorm before a log: the replay must restore RNG and stats."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.log(self.lin(self.drop(self.bn(x))))


def bits(ts):
    return [t.detach().view(torch.int32) if t.dtype == torch.float32 else t.detach() for t in ts]


def test_training_is_untouched_by_a_replay(tmp_path):
    def batch(i):
        return torch.randn(16, 8, generator=torch.Generator().manual_seed(i))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), Noisy(), nn.Linear(8, 2))

    ref = model()
    torch.manual_seed(1)
    want = train(ref, 4, batch)
    rng_want = torch.get_rng_state()
    m = model()
    torch.manual_seed(1)
    run = replayed(tmp_path, m, 4, batch)
    assert torch.equal(torch.get_rng_state(), rng_want)         # dropout's RNG restored
    for a, b in zip(bits(m.parameters()), bits(want)):          # bit-identical, NaN included
        assert torch.equal(a, b)
    for a, b in zip(bits(m.buffers()), bits(ref.buffers())):    # BatchNorm's statistics too
        assert torch.equal(a, b)
    r = run.first_nonfinite().replay
    assert r["op"] == "aten::log" and r["module"] == "1"


def test_off_by_default_and_capped(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), LayerNorm(), nn.Linear(6, 3))

    def batch(i):
        return torch.zeros(4, 6)

    def fault(model, i):
        with torch.no_grad():
            m[0].weight.zero_()
            m[0].bias.zero_()
    path = str(tmp_path / "plain.zarr")
    with Recorder(m, path, tensors_every=None, stats_every=1) as rec:
        train(m, 1, batch, rec, fault=fault)
    assert open_run(path).first_nonfinite().replay is None       # "record": no replay
    run = replayed(tmp_path, m, 2, batch, fault, max_replay_bytes=64)
    assert run.first_nonfinite().replay is None
    assert run.attrs["drop_reasons"]["replay inputs past max_replay_bytes"] > 0
    np.testing.assert_array_equal(run.steps(), [0, 1])


class SqrtAt(nn.Module):
    """sqrt of its input times 0 at a step the test picks: finite forward, and in
    backward an infinite gradient at 0 that the product turns into NaN."""

    def __init__(self):
        super().__init__()
        self.zero = False

    def forward(self, x):
        y = x * (0.0 if self.zero else 1.0)
        return torch.sqrt(y.abs() + (0.0 if self.zero else 1.0))


def test_backward_sqrt_at_zero_names_the_node_and_its_forward_line(tmp_path):
    run = record_sqrt(tmp_path)
    first = run.first_nonfinite()
    assert (first.step, first.phase) == (1, "backward")       # the forward was finite
    r = first.replay
    assert r["phase"] == "backward" and r["module"] == "1" and r["module_class"] == "SqrtAt"
    assert r["node"] == "SqrtBackward0"
    assert r["forward_source"] == line_of(SqrtAt.forward, "torch.sqrt(")
    assert any(t.get("max") == 0.0 for t in r["inputs"])      # the sqrt's result, 0
    out = CliRunner().invoke(cli, ["nan", str(tmp_path / "run.zarr")])
    assert "SqrtBackward0" in out.output and r["forward_source"] in out.output


class HandNorm(nn.Module):
    """A norm written by hand: sqrt of a sum of squares, 0 for a zero row."""

    def forward(self, x):
        return x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6)


def test_backward_of_a_hand_written_norm_of_a_zero_vector(tmp_path):
    # (torch.linalg.vector_norm's own backward is 0 at a zero vector in torch 2.13:
    # no NaN to name; written by hand, the sqrt at 0 makes one)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 5), HandNorm(), nn.Linear(5, 2))

    def fault(model, i):
        if i == 1:
            with torch.no_grad():
                model[0].weight.zero_()
                model[0].bias.zero_()

    def batch(i):
        return torch.randn(3, 5, generator=torch.Generator().manual_seed(i))

    run = replayed(tmp_path, m, 2, batch, fault)
    first = run.first_nonfinite()
    assert (first.step, first.phase) == (1, "backward")
    r = first.replay
    assert r["module"] == "1" and r["node"] == "SqrtBackward0"
    assert r["forward_source"] == line_of(HandNorm.forward, "torch.sqrt(")


def layernorm_model():
    """A fresh model of the LayerNorm test's architecture (for ``tensortape replay``)."""
    return nn.Sequential(nn.Linear(6, 6), LayerNorm(), nn.Linear(6, 3))


def sqrt_model():
    m = nn.Sequential(nn.Linear(6, 6), SqrtAt(), nn.Linear(6, 3))
    m[1].zero = True
    return m


def test_the_bundle_replays_offline_in_a_model_the_user_builds(tmp_path):
    run = record_layernorm(tmp_path, 3)
    live = run.first_nonfinite().replay
    assert live["bundle"] == "rank0/replay/step2"
    fresh = layernorm_model()                  # other weights: the bundle brings the recorded
    again = run.replay(fresh)
    for k in ("op", "source", "code", "inputs", "module", "module_class"):
        assert again[k] == live[k], k
    out = CliRunner().invoke(cli, ["replay", str(tmp_path / "run.zarr"), "--model",
                                   "test_replay:layernorm_model"])
    assert out.exit_code == 0, out.output
    assert f"made by aten::div.Tensor in 1 (LayerNorm), at {live['source']}" in out.output


class RootNamedRoot(nn.Module):
    """A submodule literally named "(root)": the root's label becomes "(root)'"; the
    root divides by a zero variance when that submodule's output is constant."""

    def __init__(self):
        super().__init__()
        self.add_module("(root)", nn.Linear(6, 6))

    def forward(self, x):
        return LayerNorm()(getattr(self, "(root)")(x))


def test_a_bundle_of_the_root_replays_whatever_the_root_is_labelled(tmp_path):
    def fault(model, i):
        if i == 1:
            with torch.no_grad():
                getattr(model, "(root)").weight.zero_()
                getattr(model, "(root)").bias.fill_(0.5)
    torch.manual_seed(0)
    run = replayed(tmp_path, RootNamedRoot(), 2, batch6, fault)
    live = run.first_nonfinite().replay
    assert live["module"] == "(root)'" and live["bundle"] == "rank0/replay/step1"
    torch.manual_seed(1)
    again = run.replay(RootNamedRoot())       # the bundle names the root by its path, ""
    for k in ("op", "module", "module_class"):
        assert again[k] == live[k], k


def test_a_backward_bundle_replays_offline(tmp_path):
    run = record_sqrt(tmp_path)
    live = run.first_nonfinite().replay
    again = run.replay(sqrt_model())
    for k in ("op", "node", "forward_source", "inputs", "module", "phase"):
        assert again[k] == live[k], k


def test_no_bundle_is_a_one_line_error(tmp_path):
    torch.manual_seed(0)
    m = layernorm_model()
    path = str(tmp_path / "plain.zarr")
    with Recorder(m, path, tensors_every=None, stats_every=1) as rec:
        train(m, 1, lambda i: torch.randn(2, 6), rec)
    out = CliRunner().invoke(cli, ["replay", path, "--model", "test_replay:layernorm_model"])
    assert out.exit_code == 2 and "holds no replay bundle" in out.output
    out = CliRunner().invoke(cli, ["replay", path, "--model", "nowhere"])
    assert out.exit_code == 2 and "is not pkg.module:factory" in out.output


class Divide(nn.Module):
    """Divides by a learned scale, which the test sets to 0 at a step."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return x / self.scale


def test_the_bundle_brings_the_recorded_parameters(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), Divide(), nn.Linear(6, 3))

    def fault(model, i):
        if i == 1:
            with torch.no_grad():
                model[1].scale[2] = 0.0

    run = replayed(tmp_path, m, 2, batch6, fault)
    live = run.first_nonfinite().replay
    assert live["op"] == "aten::div.Tensor" and live["module"] == "1"
    fresh = nn.Sequential(nn.Linear(6, 6), Divide(), nn.Linear(6, 3))     # scale all ones
    again = run.replay(fresh)
    assert again["op"] == live["op"] and again["source"] == live["source"]
    assert fresh[1].scale[2].item() == 0.0                  # the recorded parameters, loaded


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_a_nan_made_between_recorded_modules_is_said_so(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), Log(), nn.Linear(6, 3))     # log of negatives
    path = str(tmp_path / "run.zarr")
    with Recorder(m, path, layers=["0", "2"], on_nonfinite="replay", tensors_every=None, stats_every=1) as rec:
        train(m, 1, batch6, rec)
    r = open_run(path).first_nonfinite().replay
    assert r["op"] is None and "between recorded modules" in r["note"] and "bundle" not in r
    out = CliRunner().invoke(cli, ["nan", path])
    assert out.exit_code == 1 and "replay: no recorded module made it" in out.output


# --- issue 30: RNGs, the capture's counts, the cap ------------------------------------------
class DrawsThenLogs(nn.Module):
    """Draws from Python's and numpy's global RNGs, then takes a log (of negatives)."""

    def forward(self, x):
        jitter = 1.0 + 0.0 * random.random() + 0.0 * float(np.random.rand())
        return torch.log(x * jitter)


def test_pythons_and_numpys_rngs_are_restored_after_a_replay(tmp_path):
    def run(rec_path):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 6), DrawsThenLogs(), nn.Linear(6, 3))
        random.seed(7)
        np.random.seed(7)
        if rec_path is None:
            train(m, 2, batch6)
        else:
            with Recorder(m, rec_path, on_nonfinite="replay", tensors_every=None, stats_every=1) as rec:
                train(m, 2, batch6, rec)
        return random.random(), float(np.random.rand())

    path = str(tmp_path / "run.zarr")
    assert run(path) == run(None)
    assert open_run(path).first_nonfinite().replay["op"] == "aten::log"


class CleansInPlace(nn.Module):
    """Its ``log`` makes NaN, which its own code cleans in place after the call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.log = Log()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        y = self.log(self.lin(x))
        y.nan_to_num_()
        return self.head(y)


def test_an_output_cleaned_in_place_after_the_call_is_judged_by_its_capture(tmp_path):
    torch.manual_seed(0)
    m = CleansInPlace()
    path = str(tmp_path / "run.zarr")
    with Recorder(m, path, layers="*", on_nonfinite="replay", tensors_every=None, stats_every=1) as rec:
        train(m, 1, batch6, rec)
    r = open_run(path).first_nonfinite().replay
    assert r["op"] == "aten::log" and r["module"] == "log", r
    assert r["source"] == line_of(Log.forward, "torch.log(")


def test_the_cap_counts_outputs_and_output_gradients(tmp_path):
    from tensortape.recorder.replay._keeper import Keeper
    k = Keeper(1 << 20)
    x, y, g = torch.zeros(10), torch.zeros(20), torch.zeros(30)
    k.enter("m", "m", 0, nn.Identity(), (x,), {})
    k.bind("m", "", 1)
    k.leave("m", y)
    k.grad(1, g)
    assert k.nbytes == 4 * (10 + 20 + 30) and k.dropped == 0
    # the inputs of the one recorded module (4 x 512 float32: 8 KiB) fit under 12 KiB, with
    # its outputs they do not: nothing is kept, and that is counted
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 512), Log(), nn.Linear(512, 3))
    path = str(tmp_path / "run.zarr")
    with Recorder(m, path, layers=["1"], on_nonfinite="replay", tensors_every=None,
                  max_replay_bytes=12 << 10, stats_every=1) as rec:
        train(m, 1, batch6, rec)
    run = open_run(path)
    assert run.first_nonfinite() is not None and run.first_nonfinite().replay is None
    assert run.attrs["drop_reasons"]["replay inputs past max_replay_bytes"] > 0


# --- a replay never runs a collective (FSDP2 on two gloo ranks) -------------------------------
FSDP_REPLAY_WORKER = textwrap.dedent("""
    import os, sys, json
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from tensortape.recorder import Recorder
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    where = os.environ["NAN_IN"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bad = False

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            return h * 0 / (h * 0) if self.bad else h

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = Block(), Block(), nn.Linear(4, 2)
            self.bad = False

        def forward(self, x):
            h = self.b(self.a(x))
            if self.bad:
                h = h * 0 / (h * 0)
            return self.head(h)

    model = Root()
    for m in (model.a, model.b, model):
        fully_shard(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = "?"
    try:
        with Recorder(model, store, layers="*", on_nonfinite="replay", tensors_every=None, stats_every=1) as rec:
            for i in range(3):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
                bad = rank == 1 and i == 1
                model.bad = bad and where == "root"
                model.a.bad = bad and where == "block"
                with rec.step(i):
                    model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        result = "ok"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    open(f"{out}/result{rank}", "w").write(result)
    dist.destroy_process_group()
""")


def _two_ranks(worker, store, out, **env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", worker, store, str(out)], cwd=root,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       RANK=str(r), WORLD_SIZE="2", PYTHONPATH=root, **env))
             for r in range(2)]
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(out / f"result{r}").read_text() for r in range(2)]


def test_fsdp2_a_nan_made_in_the_root_or_a_sharded_block_is_not_replayed_across_ranks(tmp_path):
    for where, module in (("root", "(root)"), ("block", "a")):
        store = str(tmp_path / f"{where}.zarr")
        assert _two_ranks(FSDP_REPLAY_WORKER, store, tmp_path, NAN_IN=where) == ["ok", "ok"]
        assert zarr.open_group(store, mode="r").attrs["status"] == "complete"
        first = open_run(store).first_nonfinite(rank=1)
        assert first.step == 1, first
        r = first.replay
        assert r["op"] is None and r["module"] == module, r
        assert "FSDP" in r["collective"] and "not replayed" in r["note"], r


# --- replay names the user's line ---------------------------------------------------------------
def big_layernorm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def train_big_layernorm(model, rec):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(2):
        x = batch6(i) * (1e30 if i == 1 else 1.0)
        with rec.step(i):
            out = model(x)
            out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_torchs_own_module_is_named_by_the_users_line_that_called_it(tmp_path):
    m = big_layernorm_model()
    path = str(tmp_path / "run.zarr")
    with Recorder(m, path, on_nonfinite="replay", tensors_every=None, layers="*", stats_every=1) as rec:
        train_big_layernorm(m, rec)
    run = open_run(path)
    r = run.first_nonfinite().replay
    assert r["module"] == "1" and r["module_class"] == "LayerNorm", r
    assert r["op"] == "aten::native_layer_norm"
    assert r["source"] == line_of(train_big_layernorm, "out = model(x)"), r
    assert r["code"] == "out = model(x)"
    assert r["library_source"].split(":")[0].endswith("torch/nn/functional.py"), r
    again = run.replay(big_layernorm_model())     # offline: the user's frames, not tensortape's
    assert again["source"] == r["source"] and again["library_source"] == r["library_source"]


def test_in_backward_the_source_is_the_forward_line_that_made_the_node(tmp_path):
    r = record_sqrt(tmp_path).first_nonfinite().replay
    assert r["source"] == r["forward_source"] == line_of(SqrtAt.forward, "torch.sqrt(")


DDP_REPLAY_WORKER = textwrap.dedent("""
    import os, sys, json
    import torch, torch.distributed as dist
    from torch import nn
    from tensortape.recorder import Recorder
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)

    class GlobalCentre(nn.Module):
        \"\"\"Centres by the mean over every rank: an all-reduce in its forward.\"\"\"

        def forward(self, x):
            mean = x.detach().mean(0, keepdim=True)
            dist.all_reduce(mean)
            return x - mean / dist.get_world_size()

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.centre, self.head = nn.Linear(4, 4), GlobalCentre(), nn.Linear(4, 2)
            self.bad = False

        def forward(self, x):
            h = self.centre(self.lin(x))
            if self.bad:
                h = h * 0 / (h * 0)
            return self.head(h)

    inner = Root()
    model = nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = "?"
    try:
        with Recorder(model, store, layers="*", on_nonfinite="replay", tensors_every=None, stats_every=1) as rec:
            for i in range(3):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
                inner.bad = rank == 1 and i == 1
                with rec.step(i):
                    model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        result = "ok"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    open(f"{out}/result{rank}", "w").write(result)
    dist.destroy_process_group()
""")


def test_ddp_a_producer_with_a_collective_in_its_forward_is_stopped_before_it(tmp_path):
    # torch.nn.SyncBatchNorm runs on GPUs alone; a hand-written all-reduce in a forward
    # is what the dispatch-mode guard alone can see
    store = str(tmp_path / "ddp.zarr")
    assert _two_ranks(DDP_REPLAY_WORKER, store, tmp_path) == ["ok", "ok"]
    assert zarr.open_group(store, mode="r").attrs["status"] == "complete"
    first = open_run(store).first_nonfinite(rank=1)
    assert first.step == 1, first
    r = first.replay
    assert r["op"] is None and r["module"] == "(root)", r
    assert "c10d::allreduce_" in r["collective"] and "not replayed" in r["note"], r


def test_a_forward_hook_of_torch_distributed_on_a_descendant_rules_out_a_replay():
    from tensortape.recorder.replay._collectives import collectives

    def gather(module, args):                   # stands for FSDP's or TP's pre-forward hook
        return None
    gather.__module__ = "torch.distributed.tensor.parallel.style"
    m = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    assert collectives(m) is None
    m[1][1].register_forward_pre_hook(functools.partial(gather))
    assert "'1.1' in it" in collectives(m) and "torch.distributed" in collectives(m)
    assert collectives(m[0]) is None            # a sibling without it is replayed


# --- a library's module: where the op ran, and the user's call that led there ----------------------
NORMLIB = textwrap.dedent('''
    import torch
    from torch import nn


    class RMSNorm(nn.Module):
        """Hugging Face Llama's RMS norm; the test sets its eps to 0."""

        def __init__(self, eps=1e-6):
            super().__init__()
            self.eps = eps

        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return hidden_states * torch.rsqrt(variance + self.eps)


    class Root(nn.Module):
        """A root whose input the test scales to 0: a finite forward, NaN in backward."""

        def __init__(self):
            super().__init__()
            self.scale = 1.0

        def forward(self, x):
            return torch.sqrt(x * x * self.scale)
''')


def installed_library(folder):
    """``normlib``, imported from a ``site-packages`` folder: a library, as transformers is."""
    import importlib.util
    path = folder / "site-packages" / "normlib.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(NORMLIB)
    spec = importlib.util.spec_from_file_location("normlib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(path)


def train_library_model(model, rec, fault):
    for i in range(2):
        fault(i)
        with rec.step(i):
            out = model(batch6(i))
            out.pow(2).mean().backward()


def record_library_fault(folder, where: str = "forward") -> tuple[str, str]:
    """A run whose first NaN is made in a library's module: its RMS norm (forward) or its
    square root (backward), at step 1.  The store and the library's file."""
    lib, path = installed_library(folder)
    torch.manual_seed(0)
    inner = lib.RMSNorm() if where == "forward" else lib.Root()
    m = nn.Sequential(nn.Linear(6, 6), inner, nn.Linear(6, 3))

    def fault(i):
        if i == 1 and where == "forward":
            inner.eps = 0.0
            with torch.no_grad():
                m[0].weight.zero_()
                m[0].bias.zero_()
        elif i == 1:
            inner.scale = 0.0
    store = str(folder / f"{where}.zarr")
    with Recorder(m, store, on_nonfinite="replay", tensors_every=None, layers="*", stats_every=1) as rec:
        train_library_model(m, rec, fault)
    return store, path


def test_a_library_modules_op_is_named_at_its_line_and_at_the_users_call(tmp_path):
    store, lib = record_library_fault(tmp_path, "forward")
    r = open_run(store).first_nonfinite().replay
    assert r["op"] == "aten::rsqrt" and r["module_class"] == "RMSNorm", r
    user = line_of(train_library_model, "out = model(")
    ran = f"{lib}:{NORMLIB.splitlines().index('        return hidden_states * torch.rsqrt(variance + self.eps)') + 1}"
    assert (r["library_source"], r["source"]) == (ran, user), r
    out = CliRunner().invoke(cli, ["nan", store])
    assert out.exit_code == 1
    text = out.output
    assert (f"made by aten::rsqrt in 1 (RMSNorm) ran at {ran} (library code)\n"
            f"    return hidden_states * torch.rsqrt(variance + self.eps)\n"
            f"  called from {user} (your code)\n"
            f"    out = model(batch6(i))\n") in text, text


def test_in_backward_a_library_forward_line_is_named_with_the_users_call(tmp_path):
    store, lib = record_library_fault(tmp_path, "backward")
    r = open_run(store).first_nonfinite().replay
    assert r["phase"] == "backward" and r["node"] == "SqrtBackward0", r
    ran = f"{lib}:{NORMLIB.splitlines().index('        return torch.sqrt(x * x * self.scale)') + 1}"
    user = line_of(train_library_model, "out = model(")
    assert (r["forward_library_source"], r["forward_source"]) == (ran, user), r
    text = CliRunner().invoke(cli, ["nan", store]).output
    assert (f"the forward op that made that node ran at {ran} (library code)\n"
            f"    return torch.sqrt(x * x * self.scale)\n"
            f"  called from {user} (your code)\n") in text, text
