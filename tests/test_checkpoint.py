"""Activation checkpointing is recorded as if it were not there.

``torch.utils.checkpoint`` runs a region's forward again inside backward.  Each
test records a checkpointed model with tensortape and the same model (same
weights, same inputs) without checkpointing with ``Plain``: forward hooks,
``Tensor.register_hook`` and numpy, nothing of tensortape.  The store must hold
what ``Plain`` saw: the same names (no ``name#1`` of a recomputation), every
full tensor bit for bit under its step and micro-batch, and its statistics.
"""
import collections
import contextlib
import copy
import fnmatch
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tensortape.analysis import open_run
from oracle import statistics
from tensortape.recorder import Recorder

KINDS = ("inputs", "activations", "gradients")
CHECKPOINTS = ("non-reentrant", "no-early-stop", "reentrant")


# --- the reference ---------------------------------------------------------------------
class Plain:
    """What the store must hold, from plain hooks on an un-checkpointed model: every
    capture by (kind, name, step, micro), names ``name#k`` for the k-th call in a
    forward pass of the root.  Modules here take and return single tensors."""

    def __init__(self, model: nn.Module, names, kinds=KINDS):
        self.kinds, self.step, self.micro = set(kinds), None, -1
        self.calls = collections.Counter()
        self.got: dict[tuple, torch.Tensor] = {}
        self.order: list[str] = []
        model.register_forward_pre_hook(self._root)
        mods = dict(model.named_modules())
        for n in names:
            if "inputs" in self.kinds:
                mods[n].register_forward_pre_hook(self._pre(n))
            mods[n].register_forward_hook(self._post(n))

    def begin(self, step):
        self.step, self.micro = step, -1

    def _root(self, module, args):
        self.micro += 1
        self.calls.clear()

    def _name(self, n, phase):
        k = self.calls[phase, n]
        self.calls[phase, n] += 1
        return (n or "(root)") + (f"#{k}" if k else "")

    def _add(self, kind, name, t, step, micro):
        if kind in self.kinds:
            assert (kind, name, step, micro) not in self.got
            self.got[kind, name, step, micro] = t.detach().clone()
            self.order.append(name)

    def _pre(self, n):
        def hook(module, args):
            self._add("inputs", self._name(n, "pre"), args[0], self.step, self.micro)
        return hook

    def _post(self, n):
        def hook(module, args, out):
            name, step, micro = self._name(n, "post"), self.step, self.micro
            self._add("activations", name, out, step, micro)
            if out.requires_grad:
                out.register_hook(lambda g: self._add("gradients", name, g, step, micro))
        return hook


def check(run, plain, exact=True):
    """The store against ``Plain``: names, full tensors, statistics."""
    assert set(run.layers) == set(plain.order), set(run.layers) ^ set(plain.order)
    for kind in plain.kinds:
        want = {k: t for k, t in plain.got.items() if k[0] == kind}
        ds = run.stats(kind).compute()
        assert set(ds.layer.values.tolist()) == {n for _, n, _, _ in want}, kind
        rows = collections.defaultdict(dict)        # one read per (name, micro): every step
        for (_, name, step, micro), t in want.items():
            rows[name, micro][step] = t.numpy()
        for (name, micro), steps in rows.items():
            got = run.tensor(name, kind, micro=micro)
            assert got.step.values.tolist() == sorted(steps), (kind, name, micro)
            for step, values in zip(got.step.values.tolist(), got.values):
                what = f"{kind} {name} step {step} micro {micro}"
                if exact:
                    np.testing.assert_array_equal(values, steps[step], err_msg=what)
                else:
                    np.testing.assert_allclose(values, steps[step], rtol=1e-4, atol=1e-6,
                                               err_msg=what)
        for step in ds.step.values.tolist():
            for name in ds.layer.values.tolist():
                parts = [t for (_, n, s, _), t in want.items() if (n, s) == (name, step)]
                expect, row = statistics(parts), ds.sel(step=step, layer=name)
                assert int(row["count"]) == expect["count"], (kind, name, step)
                for stat in ("mean", "std", "min", "max", "abs_max", "norm"):
                    np.testing.assert_allclose(float(row[stat]), expect[stat],
                                               rtol=1e-9 if exact else 1e-4, atol=1e-12,
                                               err_msg=f"{kind} {name} {step} {stat}")


# --- a model with every shape of checkpointing ---------------------------------------------
class Block(nn.Module):
    """``twice`` runs twice inside the block, one after the other."""

    def __init__(self):
        super().__init__()
        self.fc1, self.twice, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.twice(torch.tanh(self.twice(torch.relu(self.fc1(x)))))) + x


class Net(nn.Module):
    """Two blocks checkpointed once each (like a transformer's layers), one block
    checkpointed ``shared`` times (like ALBERT's shared layer), and two plain
    layers around them."""

    def __init__(self, how="none", shared=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.shared = Block()
        self.how, self.n = how, shared

    def _run(self, block, h):
        if self.how == "none":
            return block(h)
        return checkpoint(block, h, use_reentrant=self.how == "reentrant")

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = self._run(b, h)
        for _ in range(self.n):
            h = self._run(self.shared, h)
        return self.head(h)


NAMES = ["", "blocks.1", "shared", "shared.twice"]     # the root, a block, the shared one


def batch(seed, rows=4, features=6):
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))


def train(model, steps, begin, wrap=None):
    """``steps``: per step, groups of micro-batches; each group's summed loss has one
    backward (a group of one: backward after each forward).  ``wrap(model, x)``
    calls the model (checkpointing the root, say)."""
    seed = 0
    for i, groups in enumerate(steps):
        with begin(i):
            for group in groups:
                loss = 0
                for _ in range(group):
                    x = batch(seed)
                    seed += 1
                    loss = loss + (model(x) if wrap is None else wrap(model, x)).square().mean()
                loss.backward()


def recorded(model, store, steps, names, wrap=None, kinds=KINDS, **kw):
    with Recorder(model, store, layers=names, capture=kinds, **{"stats_every": 1, "tensors_every": 1, **kw}) as rec:
        train(model, steps, rec.step, wrap=wrap)
    return open_run(store)


def reference(steps, names, wrap=None, kinds=KINDS, **net):
    model = Net("none", **net)
    plain = Plain(model, names, kinds)

    def begin(i):
        plain.begin(i)
        return contextlib.nullcontext()

    train(model, steps, begin, wrap=wrap)
    return plain


def early_stop(how):
    return set_checkpoint_early_stop(how != "no-early-stop")


# a summed backward over two forwards, then a backward after one forward; and the other way
SCHEDULE = [[2, 1], [1, 2]]


@pytest.mark.parametrize("how", CHECKPOINTS)
def test_eager_checkpointing_records_what_a_plain_model_does(tmp_path, how):
    model = Net(how)
    names = NAMES
    with early_stop(how):
        run = recorded(model, str(tmp_path / "r.zarr"), SCHEDULE, names)
    check(run, reference(SCHEDULE, names))


@pytest.mark.parametrize("how", CHECKPOINTS)
def test_gradients_alone(tmp_path, how):
    """Without activations, a reentrant checkpoint's forward (no grad) captures
    nothing, yet its calls are named there, in order."""
    model, kinds = Net(how), ("gradients",)
    with early_stop(how):
        run = recorded(model, str(tmp_path / "r.zarr"), SCHEDULE, NAMES, kinds=kinds)
    check(run, reference(SCHEDULE, NAMES, kinds=kinds))


@pytest.mark.parametrize("how", ("non-reentrant", "reentrant"))
def test_a_checkpointed_root_is_one_pass(tmp_path, how):
    """The root itself checkpointed (every other call): its recomputation is no new
    micro-batch, and a reentrant checkpoint's forward (run without grad) is no
    evaluation pass, also after a pass with grad."""
    model = Net("none", shared=1)
    names = NAMES
    calls = iter(range(100))

    def wrap(m, x):
        if next(calls) % 2:
            return m(x.requires_grad_())
        return checkpoint(m, x.requires_grad_(), use_reentrant=how == "reentrant")

    steps = [[1, 1], [2]]
    run = recorded(model, str(tmp_path / "r.zarr"), steps, names, wrap=wrap)
    assert run.attrs["outside_steps"] == 0
    check(run, reference(steps, names, wrap=lambda m, x: m(x.requires_grad_()), shared=1))


class Fork(nn.Module):
    """One module on two parallel branches inside one checkpointed region."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp, self.branch, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.how = "none"

    def region(self, h):
        return self.branch(h) * self.branch(2 * h).sigmoid()

    def forward(self, x):
        h = self.inp(x)
        if self.how != "none":
            h = checkpoint(self.region, h, use_reentrant=self.how == "reentrant")
        else:
            h = self.region(h)
        return self.out(h)


@pytest.mark.parametrize("how", ("non-reentrant", "reentrant"))
def test_parallel_calls_in_one_region_keep_their_names(tmp_path, how):
    model, ref = Fork(), Fork()
    model.how = how
    names = ["inp", "branch", "out"]
    plain = Plain(ref, names)
    with Recorder(model, str(tmp_path / "r.zarr"), layers=names, capture=KINDS, tensors_every=1, stats_every=1) as rec:
        for i in range(2):
            plain.begin(i)
            with rec.step(i):
                for m in (model, ref):
                    m(batch(i, features=4)).square().mean().backward()
    check(open_run(str(tmp_path / "r.zarr")), plain)


class Block4(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu() + x


class Nested(nn.Module):
    """A checkpointed region holding two checkpointed calls of one block."""

    def __init__(self, outer="none", inner="none"):
        super().__init__()
        torch.manual_seed(4)
        self.inp, self.block, self.fc = nn.Linear(4, 4), Block4(), nn.Linear(4, 4)
        self.outer, self.inner = outer, inner

    def _ckpt(self, how, f, h):
        return f(h) if how == "none" else checkpoint(f, h, use_reentrant=how == "reentrant")

    def region(self, h):
        h = self._ckpt(self.inner, self.block, self.fc(h))
        return self._ckpt(self.inner, self.block, h.tanh())

    def forward(self, x):
        return self._ckpt(self.outer, self.region, self.inp(x)).sum(-1)


@pytest.mark.parametrize("outer", ("non-reentrant", "reentrant"))
@pytest.mark.parametrize("inner", ("non-reentrant", "reentrant"))
def test_nested_checkpoints(tmp_path, outer, inner):
    model, ref = Nested(outer, inner), Nested()
    names = ["", "inp", "fc", "block", "block.fc"]
    plain = Plain(ref, names, kinds=("activations", "gradients"))
    store = str(tmp_path / "r.zarr")
    with Recorder(model, store, layers=names, capture=("activations", "gradients"), tensors_every=1, stats_every=1) as rec, \
            warnings.catch_warnings():
        # a reentrant checkpoint inside another's forward (no grad): torch warns that its
        # inputs need no gradient; it has one in the outer one's recomputation
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
        for i, group in enumerate([[1, 1], [2]]):
            plain.begin(i)
            with rec.step(i):
                for n in group:
                    for m in (model, ref):
                        sum(m(batch(10 * i + k, features=4)).square().mean()
                            for k in range(n)).backward()
    check(open_run(store), plain)


@pytest.mark.parametrize("backend,how", [("eager", "non-reentrant"), ("aot_eager", "reentrant"),
                                         ("inductor", "non-reentrant")])
def test_compiled_checkpointing(tmp_path, backend, how):
    """Compiled, the checkpointed region (capture ops included) is recomputed inside
    the backward graph (Dynamo traces both kinds of checkpoint as the same
    non-reentrant one).  Inductor's fused kernels are not eager's to the bit."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = Net(how, shared=2)
    names = NAMES
    steps = [[1, 1], [2]]
    compiled = torch.compile(model, backend=backend)
    run = recorded(compiled, str(tmp_path / "r.zarr"), steps, names)
    assert not torch._dynamo.utils.counters["graph_break"]
    check(run, reference(steps, names, shared=2), exact=backend != "inductor")


@pytest.mark.parametrize("how", ("non-reentrant", "reentrant"))
def test_replay_keeps_each_call_once_with_its_gradient(tmp_path, how):
    """``on_nonfinite="replay"`` keeps every recorded call (inputs, outputs, output
    gradients) for the step; a recomputation is not kept again, and a reentrant
    checkpoint's call gets the gradient of its recomputed output."""
    model, names, steps = Net(how), NAMES, [[1, 1], [2]]
    calls = ["(root)", "blocks.1", "shared", "shared#1"] + [f"shared.twice{k}"
                                                            for k in ("", "#1", "#2", "#3")]
    store = str(tmp_path / "r.zarr")
    with Recorder(model, store, layers=names, capture=KINDS, on_nonfinite="replay", tensors_every=1, stats_every=1) as rec:
        keeper = rec._buffer.keeper

        @contextlib.contextmanager
        def begin(i):
            with rec.step(i):
                yield
                kept = sorted((c.micro, c.name, sorted(c.grads or {})) for c in keeper.calls)
                assert kept == sorted((m, n, [""]) for m in range(sum(steps[i])) for n in calls)

        train(model, steps, begin)
    check(open_run(store), reference(steps, names))


# --- random schedules ------------------------------------------------------------------------
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(how=st.sampled_from(CHECKPOINTS), shared=st.integers(1, 3),
       steps=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=3))
def test_random_schedules(tmp_path_factory, how, shared, steps):
    """Steps of micro-batches, each group of them with one summed backward."""
    model, names, kinds = Net(how, shared=shared), ["shared", "shared.twice"], KINDS[1:]
    with early_stop(how):
        run = recorded(model, str(tmp_path_factory.mktemp("r") / "r.zarr"), steps, names,
                       kinds=kinds)
    check(run, reference(steps, names, kinds=kinds, shared=shared))


# --- Hugging Face ----------------------------------------------------------------------------
LLAMA_LAYERS = ["model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj", "lm_head"]


def llama(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def hf_names(model, patterns):
    return [n for n, _ in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def tokens(seed, n=2, length=10):
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing(tmp_path, reentrant):
    model = llama()
    ref = copy.deepcopy(model)
    with pytest.warns(FutureWarning, match="activation_checkpointing_enable"):
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train(), ref.train()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    names = hf_names(model, LLAMA_LAYERS)
    plain = Plain(ref, names, kinds=("activations", "gradients"))
    store = str(tmp_path / "r.zarr")
    with Recorder(model, store, layers=LLAMA_LAYERS, capture=("activations", "gradients"), tensors_every=1, stats_every=1) as rec:
        for i, group in enumerate([[1, 1], [2]]):
            plain.begin(i)
            with rec.step(i):
                for n in group:
                    for m in (model, ref):
                        loss = sum(m(input_ids=tokens(10 * i + k), labels=tokens(10 * i + k)).loss
                                   for k in range(n))
                        loss.backward()
    check(open_run(store), plain)


def test_hugging_face_trainer_with_gradient_checkpointing(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tensortape.recorder.integrations import TrainerCallback
    model = llama()
    ref = copy.deepcopy(model)
    seen = []

    def keep(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            seen.append({k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v)})

    model.register_forward_pre_hook(keep, with_kwargs=True)
    accum, steps = 2, 2
    rows = [{"input_ids": tokens(i, n=1)[0], "labels": tokens(i, n=1)[0]}
            for i in range(2 * accum * steps)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
        gradient_accumulation_steps=accum, max_steps=steps, activation_checkpointing=True,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=0.0,
        max_grad_norm=0.0, logging_strategy="no")
    store = str(tmp_path / "hf.zarr")
    kw = dict(layers=LLAMA_LAYERS, capture=("activations", "gradients"), tensors_every=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[TrainerCallback(store, **kw)])
    trainer.train()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    run = open_run(store)
    assert run.status == "complete" and len(seen) == accum * steps
    # the same micro-batches through the un-checkpointed copy (the learning rate is 0),
    # each loss a sum over its tokens divided by the step's (num_items_in_batch)
    names = hf_names(ref, LLAMA_LAYERS)
    plain = Plain(ref, names, kinds=("activations", "gradients"))
    for i in range(steps):
        plain.begin(i)
        for b in seen[i * accum:(i + 1) * accum]:
            ref(**b).loss.backward()
    check(run, plain)
