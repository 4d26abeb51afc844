import copy

import pytest
import torch
from torch import nn


def transformer(seed=0, d=32, layers=2):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class InplaceMLP(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def reference_capture(model, names, run_steps):
    """Plain forward hooks and tensor hooks on a copy: the ground truth."""
    got = {}
    mods = dict(model.named_modules())
    step = {"i": None}
    handles = []
    for n in names:
        def fwd(m, a, out, n=n):
            got[("activations", n, step["i"])] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g: got.__setitem__(("gradients", n, step["i"]), g.detach().clone()))
        handles.append(mods[n].register_forward_hook(fwd))
    run_steps(model, step)
    for h in handles:
        h.remove()
    return got


def train(model, steps, batches, rec=None, step_box=None, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i in range(steps):
        x = batches(i)
        if step_box is not None:
            step_box["i"] = i
        ctx = rec.step(i) if rec is not None else _null()
        with ctx:
            out = model(x)
            loss = out.float().pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture
def tmp_store(tmp_path):
    return str(tmp_path / "run.zarr")


def has_hooks(model):
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


copy = copy
