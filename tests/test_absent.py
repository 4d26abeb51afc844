"""A layer that did not run at a step is absent there: counts of -1 and NaN float
statistics, in every API and output (SPEC: "A layer that did not run at a step").

Two models that skip layers the way large models do:

- a mixture of experts whose router gives an expert no tokens at some steps (its
  forward is then skipped, as in Mixtral's loop), one that drops every token of an
  expert (capacity) in a second run, and a NaN made by an expert late in the run;
- a two-stage pipeline, each rank running its own stage (the other stage's layers
  never run there), and a stage layer that runs at even steps only.

The expectation is computed here from plain forward hooks, ``Tensor.register_hook``
and numpy (``oracle.statistics``/``oracle.histogram``), never from tensortape, and
the store is read through the public API: ``open_run``, the HDF5 export, the old
format the reader still reads, and the CLI (table, CSV, JSON).  Every test runs
under a strict warnings filter: a NaN cast to an integer warns, and fails it.
"""
import copy
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tensortape import cli
from tensortape.analysis import compare_runs, first_divergence, open_run, plot_comparison
import ranks
from oracle import STATS, histogram, statistics
from tensortape.recorder import Recorder

pytestmark = pytest.mark.filterwarnings("error")

COUNTS = ("count", "nan", "posinf", "neginf")
KINDS = ("activations", "gradients")
D, TOKENS = 4, 8

# the expert of each token, per step (-1: dropped, as over an expert's capacity)
ROUTES = [
    [0, 0, 0, 2, 2, 2, 0, 2],    # step 0: expert 1 gets no tokens
    [0, 1, 1, 1, 0, 0, 1, 0],    # step 1: expert 2 none
    [1, 1, 2, 2, 2, 1, 1, 2],    # step 2: expert 0 none
    [0, 1, 2, 0, 1, 2, 0, 1],    # step 3: every expert
    [0, 0, 0, 0, 0, 0, 0, 0],    # step 4: expert 0 only
    [2, 1, 1, 2, 1, 1, 2, 1],    # step 5: experts 1 and 2; expert 1 makes a NaN
]
# run b: at step 3 expert 2's tokens are dropped (the runs part there, at experts.2)
ROUTES_B = [r if s != 3 else [e if e != 2 else -1 for e in r] for s, r in enumerate(ROUTES)]
NAN_STEP, NAN_EXPERT = 5, 1
MOE_LAYERS = ["router", "experts.*", "head"]


class MoE(nn.Module):
    """Top-1 routing: each expert runs on its tokens only, and not at all without any."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(D, 3)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, 2)
        self.route = None                  # this step's choice of expert per token

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (self.route == e).nonzero().squeeze(1)
            if idx.numel() == 0:           # no tokens: the expert does not run
                continue
            y = y.index_add(0, idx, expert(x[idx]) * gate[idx, e:e + 1])
        return self.head(y)


def _moe_train(model, routes, step_scope):
    """Six steps of SGD; ``step_scope(i)`` is the recorder's step (or a plain one)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for i, route in enumerate(routes):
        x = torch.randn(TOKENS, D, generator=gen)
        if i == NAN_STEP:
            with torch.no_grad():
                model.experts[NAN_EXPERT].bias[0] = float("nan")
        model.route = torch.tensor(route)
        with step_scope(i):
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


class Hooks:
    """What plain hooks see: captures by (kind, name, step), the tensors copied."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.caps: dict = {}
        self.step = None
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(module, args, out):
            step = self.step
            self.caps.setdefault(("activations", name, step), []).append(out.detach().clone())
            out.register_hook(lambda g: self.caps.setdefault(("gradients", name, step), [])
                              .append(g.detach().clone()))
        return hook

    def scope(self, i):
        hooks = self

        class Step:
            def __enter__(self):
                hooks.step = i

            def __exit__(self, *exc):
                hooks.step = None
        return Step()

    def close(self):
        for h in self.handles:
            h.remove()

    def stats(self, kind, name, step) -> dict:
        """The statistics, or what the SPEC says of a layer that did not run."""
        parts = self.caps.get((kind, name, step))
        if parts is None:
            return {s: (-1 if s in COUNTS else np.nan) for s in STATS}
        return statistics(parts)

    def histogram(self, kind, name, step) -> np.ndarray:
        parts = self.caps.get((kind, name, step))
        if parts is None:
            return None
        return histogram(np.concatenate([p.to(torch.float64).reshape(-1).numpy() for p in parts]))


def _moe_modules(model):
    return {"router": model.router, **{f"experts.{e}": m for e, m in enumerate(model.experts)},
            "head": model.head}


def _record_moe(path, routes):
    model = MoE()
    ref = copy.deepcopy(model)
    with Recorder(model, path, layers=MOE_LAYERS, capture=KINDS, tensors_every=1, stats_every=1) as rec:
        _moe_train(model, routes, rec.step)
    hooks = Hooks(_moe_modules(ref))
    _moe_train(ref, routes, hooks.scope)
    hooks.close()
    return path, hooks


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    a, hooks = _record_moe(str(d / "a.zarr"), ROUTES)
    again, _ = _record_moe(str(d / "again.zarr"), ROUTES)
    b, hooks_b = _record_moe(str(d / "b.zarr"), ROUTES_B)
    return {"a": a, "again": again, "b": b, "hooks": hooks, "hooks_b": hooks_b, "dir": d}


def _absent_cells(hooks, kind, layers, steps):
    return {(s, n) for s in steps for n in layers if (kind, n, s) not in hooks.caps}


def check_stats(run, hooks, kind, rank=None):
    """``run.stats`` against the hooks, cell by cell: counts int64, -1 where absent."""
    ds = run.stats(kind, rank=rank).compute()
    for s in COUNTS:
        assert ds[s].dtype == np.int64, (s, ds[s].dtype)
    steps, layers = ds.step.values.tolist(), ds.layer.values.tolist()
    for step in steps:
        for name in layers:
            want = hooks.stats(kind, name, step)
            got = {s: ds[s].sel(step=step, layer=name).item() for s in STATS}
            for s in COUNTS:
                assert got[s] == want[s], (kind, name, step, s, got[s], want[s])
            np.testing.assert_allclose([got[s] for s in STATS if s not in COUNTS],
                                       [want[s] for s in STATS if s not in COUNTS],
                                       rtol=1e-5, atol=1e-7, equal_nan=True,
                                       err_msg=f"{kind} {name} step {step}")
    return ds


def check_histogram(run, hooks, kind, name, rank=None):
    h = run.histogram(name, kind, rank=rank).compute()
    assert h.dtype == np.int64
    for k in ("nan", "posinf", "neginf"):
        assert h[k].dtype == np.int64
    for step in h.step.values.tolist():
        want = hooks.histogram(kind, name, step)
        row = h.sel(step=step)
        if want is None:                 # did not run: -1 in every bin and count
            assert (row.values == -1).all(), (kind, name, step)
            assert [int(row[k]) for k in ("nan", "posinf", "neginf")] == [-1, -1, -1]
        else:
            np.testing.assert_array_equal(row.values, want, err_msg=f"{kind} {name} step {step}")
            st = hooks.stats(kind, name, step)
            assert [int(row[k]) for k in ("nan", "posinf", "neginf")] == \
                [st["nan"], st["posinf"], st["neginf"]]
    return h


# --- mixture of experts -----------------------------------------------------------------

def test_moe_skipped_experts_are_absent_in_stats_and_histograms(moe):
    run, hooks = open_run(moe["a"]), moe["hooks"]
    assert set(run.layers) == {"router", "experts.0", "experts.1", "experts.2", "head"}
    for kind in KINDS:
        ds = check_stats(run, hooks, kind)
        absent = _absent_cells(hooks, kind, ds.layer.values.tolist(), range(len(ROUTES)))
        # the schedule's skips are what the hooks saw, and each one reads -1 / NaN
        assert {(s, n) for s, n in absent if n.startswith("experts.")} == {
            (s, f"experts.{e}") for s, r in enumerate(ROUTES) for e in range(3) if e not in r}
        for s, n in absent:
            cell = ds.sel(step=s, layer=n)
            assert [int(cell[c]) for c in COUNTS] == [-1, -1, -1, -1]
            assert all(math.isnan(float(cell[c])) for c in STATS if c not in COUNTS)
        for e in range(3):
            check_histogram(run, hooks, kind, f"experts.{e}")
    # one step alone, and a layer first seen after step 0 (its column added later)
    assert int(run.histogram("experts.1", step=0).max()) == -1
    assert run.stats(layers="experts.1")["count"].values[:, 0].tolist() == \
        [-1, 16, 16, 12, -1, 20]                               # elements: tokens x D


def test_moe_absent_in_every_format_the_reader_reads(moe, tmp_path):
    from test_format import old_format
    src = open_run(moe["a"])
    h5 = open_run(src.to_hdf5(str(tmp_path / "a.h5")))
    v2 = open_run(old_format(moe["a"], str(tmp_path / "v2.zarr"), 2))
    for other in (h5, v2):
        for kind in KINDS:
            assert check_stats(other, moe["hooks"], kind).identical(src.stats(kind).compute())
            for e in range(3):
                check_histogram(other, moe["hooks"], kind, f"experts.{e}")


def invoke(*args):
    return CliRunner().invoke(cli.cli, list(args), prog_name="tensortape")


def test_moe_cli_stats_table_csv_json(moe):
    hooks = moe["hooks"]
    out = invoke("stats", moe["a"], "--format", "json")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert len(rows) == len(ROUTES) * 5
    for row in rows:
        want = hooks.stats("activations", row["layer"], row["step"])
        for c in COUNTS:
            assert row[c] == want[c] and isinstance(row[c], int), (row, c)
        for c in STATS:
            if c not in COUNTS and math.isnan(want[c]):     # absent: null; NaN: "nan"
                assert row[c] == (None if want["count"] == -1 else "nan"), (row, c)
    out = invoke("stats", moe["a"], "--format", "csv", "--layer", "experts.2", "--kind", "gradients")
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    header = lines[0].split(",")
    for line in lines[1:]:
        cell = dict(zip(header, line.split(",")))
        want = hooks.stats("gradients", "experts.2", int(cell["step"]))
        assert [int(cell[c]) for c in COUNTS] == [want[c] for c in COUNTS], line
        if want["count"] == -1:
            assert cell["mean"] == "" and cell["std"] == "", line
    out = invoke("stats", moe["a"], "--layer", "experts.1", "--step", "2")
    assert out.exit_code == 0, out.output
    cells = out.output.splitlines()[1].split()
    header = [h for h in out.output.splitlines()[0].split() if not h.startswith("(")]  # (kind)
    row = dict(zip(header, cells))
    assert [row[c] for c in COUNTS] == ["16", "0", "0", "0"]        # step 2: ran on 4 tokens
    out = invoke("stats", moe["a"], "--layer", "experts.0", "--step", "2")
    row = dict(zip([h for h in out.output.splitlines()[0].split() if not h.startswith("(")],
                   out.output.splitlines()[1].split()))
    assert [row[c] for c in COUNTS] == ["-1", "-1", "-1", "-1"]     # no tokens at step 2
    assert row["mean"] == "NaN" and "9223372036854775808" not in out.output


def test_moe_info_watch_and_nan(moe):
    out = invoke("info", moe["a"])
    assert out.exit_code == 0, out.output
    assert "experts.1" in out.output
    out = invoke("info", moe["a"], "--format", "json")
    assert out.exit_code == 0 and json.loads(out.output)["layers"]["experts.2"]["activations"]["stats"]
    # the last step has an absent expert (experts.0): watch says so, never a crash
    out = invoke("watch", moe["a"])
    assert out.exit_code == 0, out.output
    line = next(ln for ln in out.output.splitlines() if ln.startswith("experts.0"))
    assert "did not run at this step" in line and "-1" not in line.split(), line
    # the NaN made by experts.1 at step 5; its history holds steps where it did not run
    run = open_run(moe["a"])
    first = run.first_nonfinite(history=5)
    assert (first.step, first.layer, first.kind) == (NAN_STEP, f"experts.{NAN_EXPERT}",
                                                     "activations")
    hist = first.to_json()["history"]
    assert [h["count"] for h in hist] == [moe["hooks"].stats("activations", "experts.1", s)["count"]
                                          for s in range(6)] == [-1, 16, 16, 12, -1, 20]
    assert hist[0]["mean"] is None and hist[0]["nan"] == -1
    out = invoke("nan", moe["a"], "--format", "json", "--around", "5")
    assert out.exit_code == 1 and json.loads(out.output)["history"][4]["count"] == -1
    out = invoke("nan", moe["a"], "--around", "5")
    assert out.exit_code == 1, out.output
    assert "9223372036854775808" not in out.output
    table = out.output.split("in the steps before")[1].splitlines()
    assert any(ln.split()[:1] == ["4"] and ln.split()[-3:] == ["-1", "-1", "-1"] for ln in table)


def test_moe_compare_absent_is_not_a_divergence(moe):
    # the same schedule twice: the skipped experts are not compared, nothing diverges
    assert first_divergence(moe["a"], moe["again"]) is None
    ds = compare_runs(moe["a"], moe["again"])
    gone = ds["absent_a"] & ds["absent_b"]
    skipped = sum(1 for r in ROUTES for e in range(3) if e not in r)
    assert bool((ds["absent_a"] == ds["absent_b"]).all()) and int(gone.sum()) == skipped == 6
    assert bool(ds["stat_rel"].where(gone).isnull().all())
    assert bool(ds["delta_mean"].where(gone).isnull().all())
    assert ds["delta_count"].dtype == np.int64 and int(abs(ds["delta_count"]).max()) == 0
    for fmt in ("table", "json"):
        out = invoke("compare", moe["a"], moe["again"], "--format", fmt)
        assert out.exit_code == 0, out.output
        assert "9223372036854775808" not in out.output


def test_moe_compare_an_expert_that_ran_in_one_run_only(moe, tmp_path):
    # run b dropped expert 2's tokens at step 3: the runs part there, at that expert
    assert first_divergence(moe["a"], moe["b"]) == (3, "experts.2")
    assert first_divergence(moe["a"], moe["b"], kinds=["gradients"])[0] == 3
    ds = compare_runs(moe["a"], moe["b"])
    cell = ds.sel(step=3, layer="experts.2")
    assert bool(cell["absent_b"]) and not bool(cell["absent_a"])
    assert math.isinf(float(cell["stat_rel"])) and int(cell["delta_count"]) == 0
    assert math.isnan(float(cell["delta_mean"]))
    # before step 3 the runs are one: no difference, and no garbage delta of counts
    assert float(ds["stat_rel"].sel(step=[0, 1, 2]).fillna(0).max()) == 0
    assert int(abs(ds["delta_count"].sel(step=[0, 1, 2])).max()) == 0
    out = invoke("compare", moe["a"], moe["b"], "--format", "json",
                 "-o", str(tmp_path / "c.png"))
    assert out.exit_code == 1, out.output
    assert json.loads(out.output)["first_divergence"]["step"] == 3
    assert json.loads(out.output)["layers"]["experts.2"]["delta_nan"] == 0


def test_moe_plots_skip_absent_steps(moe):
    run = open_run(moe["a"])
    figs = [run.plot_histogram("experts.0", steps=[1, 2]),          # 2: did not run
            run.plot_histogram("experts.1"),
            run.plot_distribution("experts.2", kind="gradients"),
            run.plot_evolution(stat="std"),
            plot_comparison(moe["a"], moe["b"], "experts.2")]
    for fig in figs:
        fig.canvas.draw()
    # the default histogram step is the last one that ran (experts.0 did not at step 5)
    assert "step 4" in run.plot_histogram("experts.0").axes[0].get_title()
    # evolution marks NaN/Inf steps (experts.1 made one, head took it), never the steps
    # where a layer did not run
    labels = [t.get_text() for t in figs[3].axes[0].get_legend().get_texts()]
    assert sorted(lb.split()[0] for lb in labels if "NaN/Inf" in lb) == ["experts.1", "head"]


# --- pipeline stages on two ranks ---------------------------------------------------------

class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Stage1(nn.Module):
    """The last stage; its ``aux`` layer runs at even steps only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.step = 0

    def forward(self, h):
        h = torch.tanh(self.fc(h))
        if self.step % 2 == 0:
            h = h + self.aux(h)
        return self.out(h)


class Pipe(nn.Module):
    """The whole model; a rank's copy holds its own stage only and runs that."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stage0, self.stage1 = Stage0(), Stage1()

    def forward(self, x):
        for stage in (self.stage0, self.stage1):
            if stage is not None:
                x = stage(x)
        return x


STEPS = 4
PIPE_LAYERS = "stage*.*"


# each rank holds and runs its own stage, and records it; the activation goes forward and its
# gradient back between the ranks (gloo send and receive), as pipeline parallelism sends them
PIPE_WORKER = ranks.PREAMBLE + """
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from test_absent import D, KINDS, PIPE_LAYERS, STEPS, Pipe
model = Pipe()
if rank == 0:
    model.stage1 = None
else:
    model.stage0 = None
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(2)
xs = [torch.randn(5, D, generator=gen) for _ in range(STEPS)]
with Recorder(model, store, layers=PIPE_LAYERS, capture=KINDS, tensors_every=1, stats_every=1) as rec:
    for i, x in enumerate(xs):
        with rec.step(i):
            if rank == 0:
                h = model(x)
                dist.send(h.detach().contiguous(), 1)
                g = torch.empty_like(h)
                dist.recv(g, 1)
                h.backward(g)
            else:
                sent = torch.empty(5, 8)
                dist.recv(sent, 0)
                sent.requires_grad_()
                model.stage1.step = i
                model(sent).pow(2).mean().backward()
                dist.send(sent.grad.contiguous(), 0)
        opt.step()
        opt.zero_grad()
open(f"{out}/result{rank}", "w").write("ok")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Rank 0 holds and runs stage 0, rank 1 stage 1 (the other stage deleted, names
    kept, as pipeline splitting does), two gloo ranks; each rank records its model with
    the same arguments.  The truth: plain hooks on the whole model in this process."""
    out = tmp_path_factory.mktemp("pipe")
    path = str(out / "run.zarr")
    assert ranks.run_ranks(PIPE_WORKER, path, str(out)) == [0, 0]
    assert [(out / f"result{r}").read_text() for r in (0, 1)] == ["ok", "ok"]
    ref = Pipe()
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(5, D, generator=gen) for _ in range(STEPS)]
    modules = {f"stage0.{n}": m for n, m in ref.stage0.named_children()}
    modules.update({f"stage1.{n}": m for n, m in ref.stage1.named_children()})
    hooks = Hooks(modules)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, x in enumerate(xs):
        with hooks.scope(i):
            ref.stage1.step = i
            ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    hooks.close()
    return path, hooks


STAGE = {0: ["stage0.fc", "stage0.act"], 1: ["stage1.fc", "stage1.aux", "stage1.out"]}


def test_pipeline_each_rank_holds_its_stage(pipeline):
    path, hooks = pipeline
    run = open_run(path)
    assert run.ranks == [0, 1]
    for rank in (0, 1):
        assert set(run.layers_of(rank)) == set(STAGE[rank])
        for kind in KINDS:
            check_stats(run, hooks, kind, rank=rank)
    # stage1.aux ran at even steps only, on its own rank too
    aux = run.stats(rank=1, layers="stage1.aux").isel(layer=0)["count"].values.tolist()
    assert aux == [hooks.stats("activations", "stage1.aux", s)["count"] for s in range(STEPS)] \
        == [40, -1, 40, -1]


def test_pipeline_every_rank_together(pipeline, tmp_path):
    path, hooks = pipeline
    for run in (open_run(path), open_run(open_run(path).to_hdf5(str(tmp_path / "p.h5")))):
        for kind in KINDS:
            ds = run.stats(kind).compute()
            assert ds.sizes["rank"] == 2
            for s in COUNTS:
                assert ds[s].dtype == np.int64
            for rank in (0, 1):
                for name in ds.layer.values.tolist():
                    cell = ds.sel(rank=rank)
                    ran = name in STAGE[rank]
                    for step in range(STEPS):
                        want = hooks.stats(kind, name, step) if ran else \
                            {s: (-1 if s in COUNTS else np.nan) for s in STATS}
                        got = cell.sel(step=step, layer=name)
                        assert [int(got[c]) for c in COUNTS] == [want[c] for c in COUNTS], \
                            (kind, rank, name, step)
                        np.testing.assert_allclose(float(got["mean"]), want["mean"],
                                                   rtol=1e-5, atol=1e-7, equal_nan=True)
            h = run.histogram("stage1.aux", kind).compute()
            assert h.dtype == np.int64 and h.sizes["rank"] == 2
            assert (h.sel(rank=0).values == -1).all()          # never on rank 0
            assert (h.sel(rank=1, step=[1, 3]).values == -1).all()
            np.testing.assert_array_equal(h.sel(rank=1, step=2).values,
                                          hooks.histogram(kind, "stage1.aux", 2))
            for k in ("nan", "posinf", "neginf"):
                assert h[k].dtype == np.int64


def test_pipeline_cli(pipeline):
    path, hooks = pipeline
    out = invoke("stats", path, "--format", "json", "--layer", "stage1.*")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert {(r["rank"], r["layer"]) for r in rows if r["count"] == -1} == {
        (0, "stage1.fc"), (0, "stage1.aux"), (0, "stage1.out"), (1, "stage1.aux")}
    for r in rows:
        if r["count"] == -1:
            assert r["mean"] is None and r["nan"] == -1
        else:
            assert r["count"] == hooks.stats("activations", r["layer"], r["step"])["count"]
    for fmt in ("table", "csv"):
        out = invoke("stats", path, "--format", fmt)
        assert out.exit_code == 0 and "9223372036854775808" not in out.output, out.output
    for fmt in ("table", "json"):
        out = invoke("info", path, "--format", fmt)
        assert out.exit_code == 0, out.output
    out = invoke("nan", path)
    assert out.exit_code == 0, out.output
