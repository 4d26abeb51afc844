"""The per-capture path: what a recorded eager step pays per captured tensor, counted
(never timed), and the gradients its cheaper hooks record, against plain torch hooks.

- a captured output's gradient hook is put where ``Tensor.register_hook`` puts it,
  without the ``RemovableHandle`` nobody removes;
- the hooks ask whether torch is compiling once per hook call, not once per layer of
  calls beneath it.
"""
import os
import sys

import numpy as np
import torch
import torch.utils.hooks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensortape
from tensortape import Recorder, open_run


def mlp(depth=6):
    torch.manual_seed(0)
    mods = []
    for _ in range(depth):
        mods += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*mods)


def step(m, x):
    m(x).square().mean().backward()


class Counting:
    """Calls of ``owner.attr``, counted while installed (the original still runs)."""

    def __init__(self, monkeypatch, owner, attr, only=lambda: True):
        self.n = 0
        real = getattr(owner, attr)

        def counted(*args, **kwargs):
            self.n += only()
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, attr, counted)


def test_a_recorded_step_makes_no_hook_handle_per_output(tmp_store, monkeypatch):
    """Each captured output gets a gradient hook; none of them needs a handle (they go
    with the output's graph).  A plain step makes none either."""
    m, x = mlp(), torch.randn(4, 8)
    with Recorder(m, tmp_store, tensors_every=None) as rec:
        with rec.step():
            step(m, x)                      # warm: the first step's one-time work
        handles = Counting(monkeypatch, torch.utils.hooks.RemovableHandle, "__init__")
        for _ in range(3):
            with rec.step():
                step(m, x)
    assert handles.n == 0
    run = open_run(tmp_store)               # every output and its gradient, recorded
    assert len(run.layers) == 2 * 6 + 1 and {"activations", "gradients"} <= set(run.kinds)


def test_the_hooks_ask_whether_torch_compiles_once_per_call(tmp_store, monkeypatch):
    m, x = mlp(), torch.randn(4, 8)
    package = os.path.dirname(tensortape.__file__)
    with Recorder(m, tmp_store, tensors_every=None) as rec:
        with rec.step():
            step(m, x)
        asked = Counting(monkeypatch, torch.compiler, "is_compiling",      # by tensortape
                         only=lambda: sys._getframe(2).f_code.co_filename.startswith(package))
        with rec.step():
            step(m, x)
    # a forward hook per module call (13 outputs captured), the root's two pass hooks, a
    # gradient hook per output (13 gradients captured); nothing beneath them asks again
    assert asked.n <= 2 * 13 + 2, asked.n


def hand_recorded(m, x):
    """Every module's output and its gradient, by plain torch hooks: copies at hook time."""
    acts, grads = {}, {}
    names = {mod: name for name, mod in m.named_modules() if name}

    def fwd(mod, args, out):
        name = names[mod]
        acts[name] = out.detach().clone()
        out.register_hook(lambda g, name=name: grads.__setitem__(name, g.detach().clone()))
    hs = [mod.register_forward_hook(fwd) for mod in names]
    try:
        run_model(m, x)
    finally:
        for h in hs:
            h.remove()
    return acts, grads


class Scaled(nn.Module):
    """A linear layer whose output a user's own tensor hook scales in backward, and
    which the next module may change in place."""

    def __init__(self, hook=None):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.hook = hook

    def forward(self, x):
        y = self.fc(x)
        if self.hook is not None:
            y.register_hook(self.hook)
        return y


def run_model(m, x):
    m(x).square().sum().backward()


def model(inplace: bool, hook):
    torch.manual_seed(1)
    return nn.Sequential(Scaled(hook), nn.ReLU(inplace=inplace), Scaled(), nn.Tanh())


@settings(max_examples=8, deadline=None)
@given(inplace=st.booleans(), scale=st.sampled_from([None, 0.5, -3.0]),
       seed=st.integers(0, 2 ** 16))
def test_recorded_gradients_are_plain_hooks(tmp_path_factory, inplace, scale, seed):
    """The gradients recorded through the cheaper hooks, bit for bit those that plain
    ``register_hook`` calls see: with a ReLU changing an output in place after its
    hook, with a user's own hook on an output that changes its gradient, and for the
    root's output, which is its last module's output too (two hooks on one tensor)."""
    hook = None if scale is None else (lambda g, s=scale: g * s)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    want_acts, want_grads = hand_recorded(model(inplace, hook), x)
    assert want_grads
    store = str(tmp_path_factory.mktemp("run") / "run.zarr")
    m = model(inplace, hook)
    with Recorder(m, store, tensors_every=1) as rec:
        with rec.step():
            run_model(m, x)
    run = open_run(store)
    for name, want in want_grads.items():
        got = run.tensor(name, "gradients", step=0).values
        assert np.array_equal(got, want.numpy()), name
    for name, want in want_acts.items():
        got = run.tensor(name, "activations", step=0).values
        assert np.array_equal(got, want.numpy()), name
    assert np.array_equal(run.tensor("(root)", "gradients", step=0).values,
                          want_grads["3"].numpy())      # the root's output is module 3's


def test_a_users_torch_function_mode_sees_the_gradient_hooks(tmp_store):
    """Under a user's ``TorchFunctionMode`` the outputs' gradient hooks go through
    ``Tensor.register_hook``, which the mode sees (as it sees any hook registered
    under it), and the gradients recorded are still plain torch's."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.hooks = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.hooks += func is torch.Tensor.register_hook
            return func(*args, **(kwargs or {}))
    m, x = mlp(2), torch.randn(4, 8, requires_grad=True)
    grads = {}
    for name, mod in m.named_children():
        mod.register_full_backward_hook(
            lambda mod, gi, go, name=name: grads.__setitem__(name, go[0].detach().clone()))
    with Recorder(m, tmp_store, tensors_every=1, stats_every=1) as rec:
        with rec.step(0), Seen() as mode:
            step(m, x)
    assert mode.hooks == len(m) + 1         # each module's output and the root's
    run = open_run(tmp_store)
    for name, g in grads.items():
        np.testing.assert_array_equal(run.tensor(name, kind="gradients", step=0).values, g.numpy())
