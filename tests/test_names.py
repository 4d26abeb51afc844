"""Layer names are user data: every reader gives any name back equal (a trailing NUL
too), and tensortape's own readers read the layer they name, never the layers that
name read as a glob pattern would select.  The public ``layers=`` argument: a pattern
that is a layer's name selects that layer alone, else it is a glob
(docs/REFERENCE.md).

The truth is plain torch hooks on the same model, numpy, and ``fnmatch``."""
import fnmatch
import json
import math
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from tensortape import Recorder, cli, open_run
from tensortape.recorder import LayerNotFoundError, select_layers


class Emit(nn.Module):
    """A layer whose output is the tensor the test sets (``value``), as it is."""

    def __init__(self):
        super().__init__()
        self.value = torch.zeros(1)

    def forward(self, x):
        return self.value.clone() + 0 * x.sum()


def record(path, names, values, poison=None):
    """A run of a model with a layer per name, in order, each emitting ``values[step][i]``
    (plain hooks record the same: the truth); ``poison``: the layer whose output is +Inf
    at the last step."""
    model = nn.Sequential()
    for n in names:
        model.add_module(n, Emit())
    truth = {n: [] for n in names}
    handles = [m.register_forward_hook(lambda m, a, out, n=n: truth[n].append(out.detach().clone()))
               for n, m in model.named_children()]
    with Recorder(model, path, layers=names, capture=("activations",), max_bytes=None, stats_every=1) as rec:
        for step, row in enumerate(values):
            for i, n in enumerate(names):
                v = torch.tensor(row[i], dtype=torch.float64)
                if poison == n and step == len(values) - 1:
                    v[0] = math.inf
                model[i].value = v
            with rec.step(step):
                model(torch.ones(1))
    for h in handles:
        h.remove()
    return {n: [t.numpy() for t in ts] for n, ts in truth.items()}


def finite_stats(x: np.ndarray) -> dict:
    """The statistics the store keeps, from numpy: over the finite values."""
    f = x[np.isfinite(x)]
    return {"count": x.size, "nan": int(np.isnan(x).sum()), "posinf": int((x == np.inf).sum()),
            "neginf": int((x == -np.inf).sum()), "min": f.min(), "max": f.max(),
            "mean": f.mean(), "abs_max": np.abs(f).max(), "finite": f.size, "sum": f.sum()}


def invoke(*args):
    r = CliRunner().invoke(cli.cli, [str(a) for a in args])
    return r.exit_code, r.stdout


# --- any name reads back equal ------------------------------------------------------------
NAMES = st.text(st.one_of(st.sampled_from("a\0*?[]"),
                          st.characters(exclude_characters=".", exclude_categories=("Cs",))),
                min_size=1, max_size=4).filter(lambda n: not hasattr(nn.Sequential(), n))


@settings(max_examples=6, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(names=st.lists(NAMES, min_size=1, max_size=3, unique=True))
@example(names=["a\0", "a"])
@example(names=["\0", "a\0\0"])
def test_any_layer_name_reads_back_equal_in_every_reader(tmp_path_factory, names):
    """Before: numpy's fixed-width strings dropped a trailing NUL from the ``layer``
    coordinate, so ``a\\0`` read as ``a`` (two layers could read the same), and
    ``compare`` refused the run ("layer pattern 'a' matches no layer")."""
    path = str(tmp_path_factory.mktemp("names") / "run.zarr")
    record(path, names, [[[1.0, -2.0]] * len(names)] * 2, poison=names[-1])
    run = open_run(path)
    ds = run.stats().compute()
    assert ds.layer.values.tolist() == names == run.damaged().layer.values.tolist()
    for n in names:                       # selected by its name, exactly (docs/REFERENCE.md)
        assert run.stats(layers=n).layer.values.tolist() == [n]
        assert ds.sel(layer=np.array([n], object)).layer.values.tolist() == [n]
        assert run.histogram(n).attrs["layer"] == n
    first = run.first_nonfinite()
    assert first.layer == names[-1] and first.history.layer.item() == names[-1]
    code, out = invoke("nan", path, "--format", "json")
    assert code == 1 and json.loads(out)["layer"] == names[-1]
    code, out = invoke("stats", path, "--format", "json")
    assert code == 0 and {r["layer"] for r in json.loads(out)} == set(names)
    code, out = invoke("compare", path, path, "--format", "json")
    assert code == 0, out
    got = json.loads(out)
    assert got["first_divergence"] is None and got["coverage"]["statistics"]["layers"] == names
    assert list(got["layers"]) == names


# --- the layer named, never a pattern's layers ----------------------------------------------
GLOBBY = ["a", "*", "?", "[b]", "b"]           # each a glob that would select another layer


@pytest.fixture(scope="module")
def globby(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("globby") / "run.zarr")
    rng = np.random.default_rng(0)
    values = [[rng.standard_normal(3) * (i + 1) for i in range(len(GLOBBY))] for _ in range(3)]
    return path, record(path, GLOBBY, values, poison="*")


def test_a_post_mortem_reads_the_history_of_its_own_layer(globby):
    """Before: the history of the first NaN/Inf in layer ``*`` was the statistics of
    ``a`` (the first layer the glob ``*`` selects), in ``first_nonfinite`` and in
    ``tensortape nan``."""
    path, truth = globby
    first = open_run(path).first_nonfinite(history=2)
    assert first.layer == "*"
    code, out = invoke("nan", path, "--format", "json", "--around", 2)
    assert code == 1
    rows = json.loads(out)["history"]
    assert [r["step"] for r in rows] == first.history.step.values.tolist() == [0, 1, 2]
    for i, row in enumerate(rows):
        want = finite_stats(truth["*"][i])
        for k in ("count", "nan", "posinf", "min", "max", "abs_max"):
            assert row[k] == want[k] == first.history[k].values[i], (i, k)
        assert row["mean"] == pytest.approx(want["mean"], rel=1e-12)


def test_the_tensorboard_export_reads_each_layers_own_statistics(globby, tmp_path):
    """Before: the histograms of ``*``, ``?`` and ``[b]`` had the min, max and sum of
    other layers (those their names select as globs)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    path, truth = globby
    out = str(tmp_path / "tb")
    assert invoke("export", path, out, "--format", "tensorboard")[0] == 0
    ea = EventAccumulator(out, size_guidance={"histograms": 0})
    ea.Reload()
    for name in GLOBBY:
        for h in ea.Histograms(f"activations/{name}"):
            want = finite_stats(truth[name][h.step])
            got = h.histogram_value
            assert (got.min, got.max, got.num) == (want["min"], want["max"], want["finite"])
            assert got.sum == pytest.approx(want["sum"], rel=1e-12)


@pytest.mark.parametrize("pattern, selected", [
    ("*", ["*"]),             # a layer's name: that layer alone
    ("?", ["?"]),
    ("[b]", ["[b]"]),
    ("[*]", ["*"]),           # no layer's name: a glob
    ("[?]", ["?"]),
    ("[[]b]", ["[b]"]),
    ("?*", GLOBBY),
    (["a", "b"], ["a", "b"]),
    (["[*]", "[ab]"], ["a", "*", "b"]),
])
def test_a_pattern_that_is_a_layers_name_selects_that_layer_alone(globby, pattern, selected):
    path, _ = globby
    assert open_run(path).stats(layers=pattern).layer.values.tolist() == selected
    model = nn.Sequential(*(Emit() for _ in GLOBBY))
    model._modules = dict(zip(GLOBBY, model._modules.values()))
    assert select_layers(model, pattern) == selected
    names = [pattern] if isinstance(pattern, str) else pattern
    globs = {n for p in names for n in GLOBBY if p not in GLOBBY and fnmatch.fnmatchcase(n, p)}
    assert set(selected) == {p for p in names if p in GLOBBY} | globs       # the rule, stated


def test_a_pattern_that_selects_nothing_is_refused(globby):
    with pytest.raises(LayerNotFoundError, match=r"'c\*'"):
        open_run(globby[0]).stats(layers="c*")
