"""The compare picture (issue 32): white is 0 (identical) whatever the data's range,
so runs as different as can be (rel_l2 about 1) are dark; the statistic's panel
has a log axis where the values span decades.  Oracle: numpy on the stored
tensors, and matplotlib's own Reds colour map for what "white" is."""

import numpy as np
import pytest
import torch
from torch import nn

from tensortape.analysis import open_run, plot_comparison
from tensortape.recorder import Recorder


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))


def _record(path, seed, grow=1.0, steps=3):
    torch.manual_seed(seed)
    model = MLP()
    with Recorder(model, str(path), tensors_every=1, stats_every=1) as rec:
        for i in range(steps):
            with rec.step(i):
                model(torch.randn(32, 6) * grow ** i).sum().backward()
    return str(path)


def _cells(fig):
    """The heat map's cell colours (layer x step) and the layer names, as drawn."""
    heat = fig.axes[0]
    mesh = heat.collections[0]
    names = [t.get_text() for t in heat.get_yticklabels()]
    rgba = mesh.to_rgba(np.ma.masked_invalid(np.asarray(mesh.get_array(), float)))
    return rgba.reshape(len(names), -1, 4), names


def _rel_l2(a, b, layer, step):
    x = open_run(a).tensor(layer, step=step).values.astype(np.float64)
    y = open_run(b).tensor(layer, step=step).values.astype(np.float64)
    return np.linalg.norm(y - x) / np.linalg.norm(x)


def test_completely_different_runs_are_dark_and_identical_ones_white(tmp_path):
    a = _record(tmp_path / "a.zarr", 0)
    b = _record(tmp_path / "b.zarr", 1)                  # another seed: unrelated numbers
    c = _record(tmp_path / "c.zarr", 0)                  # the same seed: identical
    rgba, names = _cells(plot_comparison(a, b, "fc1"))
    steps = range(rgba.shape[1])
    rels = np.array([[_rel_l2(a, b, n, s) for s in steps] for n in names if n != "(root)"])
    assert (rels > 0.5).all() and rels.max() < 3            # as different as can be, 1 to 2
    for i, n in enumerate(x for x in names if x != "(root)"):
        for s in steps:
            assert rgba[names.index(n), s, :3].min() < 0.6, (n, s, rels[i, s])   # not near-white
    same, _ = _cells(plot_comparison(a, c, "fc1"))
    assert np.allclose(same[..., :3], 1.0)                            # white: identical


@pytest.mark.parametrize("grow,log", [(1.0, False), (1e3, True)])
def test_the_statistic_panel_is_log_where_it_spans_decades(tmp_path, grow, log):
    a = _record(tmp_path / "a.zarr", 0)
    b = _record(tmp_path / "b.zarr", 0, grow=grow, steps=4)
    stds = [open_run(r).tensor("fc1", step=s).values.astype(np.float64).std()
            for r in (a, b) for s in range(3)]
    assert (max(stds) / min(stds) > 1e3) == log                        # numpy's span
    fig = plot_comparison(a, b, "fc1")
    assert fig.axes[1].get_yscale() == ("log" if log else "linear")
