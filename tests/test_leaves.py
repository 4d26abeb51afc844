"""Leaf outputs (a module returning its own parameter) and evaluation passes
inside a step (issue 30): no hook outlives its step, and an evaluation forward
is never a micro-batch.  Checked against plain hooks, numpy and the oracle."""
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from oracle import Oracle


class PosEmb(nn.Module):
    """Returns its own parameter: the hook is handed a leaf."""

    def __init__(self):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(4, 8, generator=torch.Generator().manual_seed(7)))

    def forward(self):
        return self.pe


class WithPE(nn.Module):
    def __init__(self, twice=False):
        super().__init__()
        torch.manual_seed(0)
        self.pos = PosEmb()
        self.fc = nn.Linear(8, 8)
        self.twice = twice

    def forward(self, x):
        h = self.fc(x) + self.pos()
        if self.twice:
            h = h * self.pos()
        return h


def _x(i):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + i))


def _hooks(t):
    return len(t._backward_hooks or {})


def test_a_leaf_output_keeps_no_hook_beyond_its_step(tmp_store):
    """600 steps (and passes outside steps, paused, under no_grad): the
    parameter's hook count never grows; nothing is dropped or warned."""
    model = WithPE()
    pe = model.pos.pe
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Recorder(model, tmp_store, layers="pos", capture=("activations", "gradients"),
                      outside_step="ignore", tensors_every=None, stats_every=1) as rec:
            counts = []
            for i in range(600):
                with rec.step(i):
                    model(_x(i % 7)).pow(2).sum().backward()
                    assert _hooks(pe) <= 1                 # one for the step's one call
                counts.append(_hooks(pe))
                model.zero_grad()
                if i % 200 == 0:
                    model(_x(0)).sum().backward()          # outside a step: no hook
                    assert _hooks(pe) == 0
                    with torch.no_grad():
                        model(_x(0))
                    with rec.pause():
                        model(_x(0)).sum().backward()
                    assert _hooks(pe) == 0
            assert set(counts) == {0}
            with rec.step(600):
                out = model(_x(0))                         # its backward never comes
                assert _hooks(pe) == 1
            assert _hooks(pe) == 0
            with rec.step(601):
                model(_x(0))
            assert rec.dropped == 0
        assert _hooks(pe) == 0 and rec.dropped == 0
    del out
    run = open_run(tmp_store)
    assert run.attrs["dropped"] == 0
    st = run.stats("gradients", layers="pos").compute()
    assert st["count"].sel(layer="pos").values[:600].tolist() == [32] * 600


def test_a_hook_on_a_leaf_output_goes_at_close(tmp_store):
    model = WithPE()
    rec = Recorder(model, tmp_store, layers="pos", tensors_every=1, stats_every=1).attach()
    rec.step(0)                                      # no `with`: the step lasts until close
    model(_x(0))
    assert _hooks(model.pos.pe) == 1
    rec.close()
    assert _hooks(model.pos.pe) == 0


@pytest.mark.parametrize("twice", [False, True])
def test_leaf_output_gradients_match_plain_autograd(tmp_store, twice):
    """Three micro-batches a step, each with its backward: micro-batch k's gradient
    of ``pos`` is d loss_k / d pe, computed here by autograd alone; with two
    calls in one pass (``pos``, ``pos#1``) each is handed the leaf's gradient."""
    model = WithPE(twice=twice)
    pe = model.pos.pe
    want = {}
    with Recorder(model, tmp_store, layers="pos", capture=("activations", "gradients"), tensors_every=1, stats_every=1) as rec:
        for s in range(3):
            with rec.step(s):
                for k in range(3):
                    loss = model(_x(3 * s + k)).pow(2).sum()
                    (g,) = torch.autograd.grad(loss, pe, retain_graph=True)
                    want[s, k] = g.numpy().copy()
                    loss.backward()
            model.zero_grad()
        assert rec.dropped == 0
    run = open_run(tmp_store)
    names = ["pos", "pos#1"] if twice else ["pos"]
    assert [n for n in run.layers if n.startswith("pos")] == names
    for s in range(3):
        for k in range(3):
            for n in names:
                np.testing.assert_array_equal(run.tensor(n, "gradients", step=s, micro=k).values,
                                              want[s, k], err_msg=f"{n} step {s} micro {k}")
        st = run.stats("gradients", layers="pos").sel(step=s, layer="pos").compute()
        allg = np.concatenate([want[s, k].ravel() for k in range(3)]).astype(np.float64)
        assert int(st["count"]) == allg.size
        np.testing.assert_allclose(float(st["abs_max"]), np.abs(allg).max(), rtol=0)


class _Plain:
    """Plain hooks on the model itself: what a training pass (with grad) hands
    ``fc1``, its gradients included; no-grad passes skipped."""

    def __init__(self, model):
        self.acts, self.grads = [], []
        self.h = model.fc1.register_forward_hook(self._hook)

    def _hook(self, m, a, out):
        if torch.is_grad_enabled():
            self.acts.append(out.detach().clone())
            out.register_hook(lambda g: self.grads.append(g.detach().clone()))


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_an_evaluation_pass_inside_a_step_is_not_a_micro_batch(tmp_store, policy):
    from conftest import InplaceMLP
    model = InplaceMLP()
    plain = _Plain(model)
    train = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    evals = [1e3 * torch.randn(50, 8, generator=torch.Generator().manual_seed(9 + i))
             for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no warning at all
        with Recorder(model, tmp_store, layers="fc*", outside_step=policy, tensors_every=1, stats_every=1) as rec:
            with rec.step(0):
                model(train[0]).sum().backward()
                with torch.no_grad():
                    model(evals[0])                    # an evaluation pass
                with torch.inference_mode():
                    model(evals[1])                    # another
                model(train[1]).sum().backward()
            assert rec.outside_steps == 2
            assert rec.dropped == 0
    plain.h.remove()
    run = open_run(tmp_store)
    assert run.attrs["outside_steps"] == 2
    assert run.layers == ["fc1", "fc2"]                # no fc1#1: nothing of the evaluation
    for kind in ("activations", "gradients"):
        count = run.stats(kind)["count"].sel(step=0)
        assert [int(count.sel(layer=n)) for n in ("fc1", "fc2")] == [2 * 4 * 16, 2 * 4 * 4]
    for k in range(2):                                 # the training passes are micro 0 and 1
        np.testing.assert_array_equal(run.tensor("fc1", step=0, micro=k).values,
                                      plain.acts[k].numpy())
        np.testing.assert_array_equal(run.tensor("fc1", "gradients", step=0, micro=k).values,
                                      plain.grads[k].numpy())
    with pytest.raises(ValueError, match="micro-batch 2"):
        run.tensor("fc1", step=0, micro=2)
    st = run.stats("activations", layers="fc1").sel(step=0, layer="fc1").compute()
    v = np.concatenate([a.numpy().ravel() for a in plain.acts]).astype(np.float64)
    assert int(st["count"]) == v.size == 2 * 4 * 16
    assert float(st["abs_max"]) == np.abs(v).max()


def test_the_oracle_skips_evaluation_passes_and_agrees(tmp_store):
    """The oracle (plain hooks on a copy) and the store agree on a step that holds
    training passes around an evaluation pass."""
    import copy
    from conftest import InplaceMLP
    model = InplaceMLP()
    twin = copy.deepcopy(model)
    oracle = Oracle(twin, "fc*", ("activations", "gradients"))
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with Recorder(model, tmp_store, layers="fc*", tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            oracle.begin(0)
            for m in (model, twin):
                with torch.no_grad():
                    m(50 * xs[2])                      # before the first training pass
                m(xs[0]).sum().backward()
                with torch.no_grad():
                    m(100 * xs[1])
                m(xs[2]).sum().backward()
            oracle.end()
    oracle.close()
    assert oracle.outside == 2 == rec.outside_steps
    run = open_run(tmp_store)
    for kind in ("activations", "gradients"):
        st = run.stats(kind).compute()
        for name in ("fc1", "fc2"):
            want = oracle.stats(0, kind, name)
            got = st.sel(step=0, layer=name)
            assert int(got["count"]) == want["count"]
            assert float(got["abs_max"]) == want["abs_max"]
    assert sorted(k[3] for k in oracle.tensors()) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_compiled_leaf_outputs_and_evaluation_passes(tmp_store):
    """Under torch.compile: leaf hooks still go at each step's end, gradients are
    autograd's, and an evaluation pass adds no graph break and no micro-batch."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = WithPE()
    pe = model.pos.pe
    compiled = torch.compile(model, backend="eager")
    want = {}
    with Recorder(model, tmp_store, layers="*", capture=("activations", "gradients"), tensors_every=1, stats_every=1) as rec:
        for s in range(2):
            with rec.step(s):
                for k in range(2):
                    loss = compiled(_x(2 * s + k)).pow(2).sum()
                    (g,) = torch.autograd.grad(loss, pe, retain_graph=True)
                    want[s, k] = g.numpy().copy()
                    loss.backward()
                    if k == 0:
                        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
                        with torch.no_grad():
                            compiled(1e3 * _x(9))
                        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
            assert _hooks(pe) == 0
            model.zero_grad()
        assert rec.outside_steps == 2 and rec.dropped == 0
    run = open_run(tmp_store)
    for s in range(2):
        for k in range(2):
            np.testing.assert_array_equal(run.tensor("pos", "gradients", step=s, micro=k).values,
                                          want[s, k])
        with pytest.raises(ValueError, match="micro-batch 2"):
            run.tensor("fc", step=s, micro=2)
    assert run.layers == ["fc", "pos", "(root)"]


def test_the_inspector_leaves_no_hook_on_a_leaf_output():
    """The Inspector's sink says nothing of steps: detach removes the leaf's hook."""
    from tensortape.analysis import Inspector
    model = WithPE()
    ins = Inspector(model)
    ins.watch("pos")
    ins.run_inspection(_x(0))
    assert _hooks(model.pos.pe) == 0
    want = torch.autograd.grad(model(_x(0)).sum(), model.pos.pe)[0]
    np.testing.assert_array_equal(ins.captured_data[("pos", "gradients")].numpy(), want.numpy())


def test_the_oracle_agrees_on_leaf_outputs(tmp_store):
    """A leaf output under accumulation (a backward per micro-batch, then two
    forwards and one backward), several steps: store and oracle agree, exactly."""
    import copy
    model = WithPE(twice=True)
    twin = copy.deepcopy(model)
    oracle = Oracle(twin, "*", ("activations", "gradients"))
    with Recorder(model, tmp_store, layers="*", capture=("activations", "gradients"), tensors_every=1, stats_every=1) as rec:
        for s in range(3):
            with rec.step(s):
                oracle.begin(s)
                for m in (model, twin):
                    m(_x(s)).pow(2).sum().backward()
                    (m(_x(s + 1)).sum() + m(_x(s + 2)).pow(3).sum()).backward()
                oracle.end()
            for m in (model, twin):
                m.zero_grad()
        assert rec.dropped == 0 == oracle.dropped
    oracle.close()
    assert _hooks(twin.pos.pe) == 0 == _hooks(model.pos.pe)
    run = open_run(tmp_store)
    assert run.layers == oracle.names()
    for kind in ("activations", "gradients"):
        st = run.stats(kind).compute()
        for s, k, name in oracle.keys():
            if k != kind:
                continue
            want, got = oracle.stats(s, kind, name), st.sel(step=s, layer=name)
            assert int(got["count"]) == want["count"], (s, kind, name)
            for stat in ("min", "max", "abs_max"):
                assert float(got[stat]) == want[stat], (s, kind, name, stat)
    for (kind, name, s, micro), t in oracle.tensors().items():
        np.testing.assert_array_equal(run.tensor(name, kind, step=s, micro=micro).values,
                                      t.numpy(), err_msg=f"{kind} {name} {s} {micro}")


def test_evaluation_before_training_in_a_step_and_inference_steps(tmp_store):
    """An evaluation pass before the step's first training pass goes too (the
    training passes are micro-batches 0, 1); a step of no-grad passes alone
    (recording inference) is recorded, pass by pass."""
    from conftest import InplaceMLP
    model = InplaceMLP()
    plain = _Plain(model)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Recorder(model, tmp_store, layers="fc*",
                      capture=("activations", "gradients", "weights"), tensors_every=1, stats_every=1) as rec:
            with rec.step(0):
                with torch.no_grad():
                    model(1e3 * xs[3])                 # evaluation, before any training
                model(xs[0]).sum().backward()
                with torch.inference_mode():
                    model(1e3 * xs[3])                 # evaluation, after
                model(xs[1]).sum().backward()
            with rec.step(1), torch.no_grad():         # inference alone: recorded
                model(xs[2])
                model(xs[3])
            assert rec.outside_steps == 2 and rec.dropped == 0
    plain.h.remove()
    run = open_run(tmp_store)
    # the weights, taken at the step's first pass, are its first recorded captures; the
    # evaluation pass's activations are not recorded: the training pass's come after them
    assert run.layers == ["fc1:weight", "fc1:bias", "fc2:weight", "fc2:bias", "fc1", "fc2"]
    for k in range(2):
        np.testing.assert_array_equal(run.tensor("fc1", step=0, micro=k).values,
                                      plain.acts[k].numpy())
        np.testing.assert_array_equal(run.tensor("fc1", "gradients", step=0, micro=k).values,
                                      plain.grads[k].numpy())
        np.testing.assert_array_equal(run.tensor("fc1", step=1, micro=k).values,
                                      model.fc1(xs[2 + k]).detach().numpy())
    with pytest.raises(ValueError, match="micro-batch 2"):
        run.tensor("fc1", step=0, micro=2)
    st = run.stats("activations").compute()
    assert int(st["count"].sel(step=0, layer="fc1")) == 2 * 4 * 16
    v = np.concatenate([a.numpy().ravel() for a in plain.acts]).astype(np.float64)
    assert float(st["abs_max"].sel(step=0, layer="fc1")) == np.abs(v).max()
    np.testing.assert_array_equal(run.tensor("fc1:weight", "weights", step=0).values,
                                  model.fc1.weight.detach().numpy())


class Routed(nn.Module):
    """``a``, then ``b`` where ``route`` says, then ``c``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.route = True

    def forward(self, x):
        h = self.a(x)
        if self.route:
            h = self.b(h)
        return self.c(h)


def test_layers_are_in_first_recorded_order_without_evaluation_passes(tmp_store):
    """``run.layers`` lists the names in the order of their first recorded capture
    (plain forward hooks of training passes are the truth): an evaluation pass
    before a step's first training pass records nothing, so a layer that ran
    there (``b``) is listed where a training pass first ran it."""
    model = Routed()
    order = []                                   # the truth: plain hooks, training passes

    def seen(name):
        def hook(module, args, out):
            if torch.is_grad_enabled() and name not in order:
                order.append(name)
        return hook
    handles = [getattr(model, n).register_forward_hook(seen(n)) for n in "abc"]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with Recorder(model, tmp_store, layers=["a", "b", "c"], capture=("activations",),
                  stats_every=1) as rec:
        with rec.step(0):
            with torch.no_grad():
                model(x)                         # evaluation: a, b, c ran, none recorded
            model.route = False
            model(x).sum().backward()            # a, c
        with rec.step(1):
            model.route = True
            model(x).sum().backward()            # a, b, c
        assert rec.outside_steps == 1
    for h in handles:
        h.remove()
    assert order == ["a", "c", "b"]
    assert open_run(tmp_store).layers == order
