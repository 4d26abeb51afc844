"""Recording compiled models: never silently nothing, no graph breaks, values as eager."""
import os
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn

from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from tensortape.recorder.errors import ConfigError
from conftest import InplaceMLP, has_hooks, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_dynamo():
    """Dynamo as in a fresh process: nothing compiled, and its default of no
    guards on module hooks (a recorder still attached keeps it off).
    Dynamo's config is patched with its own ``patch`` (pytest's monkeypatch
    cannot set its entries, and its undo would hide them)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        yield


def _steps(model, rec, n, x=None, start=0):
    for i in range(start, start + n):
        with rec.step(i):
            model(torch.randn(4, 8) if x is None else x).sum().backward()


def _recorded(store):
    run = open_run(store)
    return run.layers, run.steps().tolist(), run.steps("gradients").tolist()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_attach_after_the_model_was_compiled_and_run(tmp_store, backend, fresh_dynamo):
    model = InplaceMLP()
    compiled = torch.compile(model, backend=backend)
    for _ in range(3):
        compiled(torch.randn(4, 8)).sum().backward()
    with Recorder(compiled, tmp_store, layers="fc*", tensors_every=1, stats_every=1) as rec:
        _steps(compiled, rec, 2)
    assert _recorded(tmp_store) == (["fc1", "fc2"], [0, 1], [0, 1])


def test_a_second_instance_of_a_class_compiled_earlier(tmp_path, fresh_dynamo):
    """The notebook re-run, and two models of one class: each records."""
    first = torch.compile(InplaceMLP(0), backend="inductor")
    first(torch.randn(4, 8)).sum().backward()
    for i, seed in enumerate((1, 2)):
        model = torch.compile(InplaceMLP(seed), backend="inductor")
        store = str(tmp_path / f"r{i}.zarr")
        with Recorder(model, store, layers="fc*", tensors_every=1, stats_every=1) as rec:
            _steps(model, rec, 2)
        assert _recorded(store) == (["fc1", "fc2"], [0, 1], [0, 1])


def test_two_models_of_one_class_each_record(tmp_path, fresh_dynamo):
    a, b = InplaceMLP(0), InplaceMLP(1)
    ca, cb = torch.compile(a, backend="inductor"), torch.compile(b, backend="inductor")
    with Recorder(ca, str(tmp_path / "a.zarr"), layers="fc*", tensors_every=1, stats_every=1) as ra, \
            Recorder(cb, str(tmp_path / "b.zarr"), layers="fc1", tensors_every=1, stats_every=1) as rb:
        for i in range(2):
            with ra.step(i), rb.step(i):
                ca(torch.randn(4, 8)).sum().backward()
                cb(torch.randn(4, 8)).sum().backward()
    assert _recorded(str(tmp_path / "a.zarr")) == (["fc1", "fc2"], [0, 1], [0, 1])
    assert _recorded(str(tmp_path / "b.zarr")) == (["fc1"], [0, 1], [0, 1])


def _graph_breaks(model, x, record_to=None):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="eager")
    if record_to is None:
        compiled(x).float().pow(2).mean().backward()
    else:
        with Recorder(compiled, record_to, layers=["layers.*.linear*", "layers.*.self_attn"], tensors_every=1, stats_every=1) as rec:
            with rec.step():
                compiled(x).float().pow(2).mean().backward()
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_recording_adds_no_graph_break(tmp_store):
    model, x = transformer(), torch.randn(2, 5, 32)
    bare = _graph_breaks(model, x)
    recorded = _graph_breaks(model, x, tmp_store)
    assert recorded == bare
    assert len(open_run(tmp_store).layers) == 6


def test_fullgraph_compile_records(tmp_store):
    model = InplaceMLP()
    with Recorder(model, tmp_store, layers="fc*", capture=("activations", "gradients", "inputs"), tensors_every=1, stats_every=1) as rec:
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        _steps(compiled, rec, 2)
    run = open_run(tmp_store)
    assert run.layers == ["fc1", "fc2"] and set(run.kinds) == {"activations", "gradients", "inputs"}


@pytest.mark.parametrize("backend,autocast", [("eager", False), ("inductor", False),
                                              ("inductor", True)])
def test_compiled_values_equal_eager(tmp_path, backend, autocast):
    names = ["layers.0.linear1", "layers.1.linear2", "layers.0.self_attn"]
    xs = [torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    stores = {}
    for mode in ("eager", "compiled"):
        model = transformer()
        run_model = torch.compile(model, backend=backend) if mode == "compiled" else model
        stores[mode] = store = str(tmp_path / f"{mode}.zarr")
        with Recorder(run_model, store, layers=names, tensors_every=1, stats_every=1) as rec:
            for i, x in enumerate(xs):
                with rec.step(i), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    run_model(x).float().pow(2).mean().backward()
    eager, comp = open_run(stores["eager"]), open_run(stores["compiled"])
    assert comp.layers == eager.layers
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    for kind in ("activations", "gradients"):
        assert comp.tensor_layers(kind) == eager.tensor_layers(kind)
        for layer in eager.tensor_layers(kind):
            for step in (0, 1):
                np.testing.assert_allclose(comp.tensor(layer, kind, step=step).values,
                                           eager.tensor(layer, kind, step=step).values,
                                           err_msg=f"{kind} {layer} {step}", **tol)
        a, b = comp.stats(kind).compute(), eager.stats(kind).compute()
        np.testing.assert_array_equal(a["count"].values, b["count"].values)
        np.testing.assert_allclose(a["std"].values, b["std"].values, **tol)


def test_after_close_the_compiled_model_runs_clean(tmp_store):
    model = InplaceMLP()
    compiled = torch.compile(model, backend="eager")
    with Recorder(compiled, tmp_store, layers="fc*", tensors_every=1, stats_every=1) as rec:
        _steps(compiled, rec, 2)
    assert not has_hooks(model)
    counters = torch._dynamo.utils.counters
    compiled(torch.randn(4, 8)).sum().backward()        # at most one recompile, here
    before = counters["stats"]["unique_graphs"]
    for _ in range(5):
        compiled(torch.randn(4, 8)).sum().backward()
    assert counters["stats"]["unique_graphs"] == before


def test_code_compiled_around_the_model_warns_once_when_nothing_is_captured(tmp_store, fresh_dynamo):
    model = InplaceMLP()

    @torch.compile(backend="eager")
    def forward(x):            # compiled before the Recorder, around the model: not seen
        return model(x)
    forward(torch.randn(4, 8)).sum().backward()
    with Recorder(model, tmp_store, layers="fc*", tensors_every=1, stats_every=1) as rec:
        with pytest.warns(RuntimeWarning, match="captured nothing.*torch.compiler.reset"):
            for i in range(3):
                with rec.step(i):
                    forward(torch.randn(4, 8)).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with rec.step(3):
                forward(torch.randn(4, 8)).sum().backward()     # warned once only


def test_fx_graph_module_records_with_its_own_names(tmp_store):
    gm = torch.fx.symbolic_trace(InplaceMLP())
    with Recorder(gm, tmp_store, layers="*", tensors_every=1, stats_every=1) as rec:
        _steps(gm, rec, 1)
    run = open_run(tmp_store)
    assert {"fc1", "fc2", "(root)"} <= set(run.layers)
    x = torch.randn(4, 8)
    with Recorder(gm, tmp_store, layers="fc1", mode="w", tensors_every=1, stats_every=1) as rec:
        _steps(gm, rec, 1, x=x)
    np.testing.assert_allclose(open_run(tmp_store).tensor("fc1", step=0).values,
                               gm.fc1(x).detach().numpy())


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_with_the_alternative(tmp_store):
    scripted = torch.jit.script(InplaceMLP())
    with pytest.raises(ConfigError, match="TorchScript.*record the eager module.*torch.compile"):
        Recorder(scripted, tmp_store, tensors_every=1, stats_every=1)


class _Broken(nn.Module):
    """Two layers with a graph break between them (as a logging call makes one)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        y = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(y)


def _plain_hooks(model, names):
    """Plain forward and tensor hooks on ``names``: the latest output and gradient of
    each, by (kind, name)."""
    truth = {}
    for n in names:
        def keep(mod, args, out, n=n):
            truth[("activations", n)] = out.detach().clone()
            out.register_hook(lambda g: truth.__setitem__(("gradients", n), g.clone()))
        model.get_submodule(n).register_forward_hook(keep)
    return truth


@pytest.mark.parametrize("broken", [False, True])
def test_compiled_gradients_with_and_without_a_graph_break(tmp_store, broken, fresh_dynamo):
    """Gradient hooks traced by Dynamo, in a frame that compiles whole or restarts at a
    graph break (on torch 2.11 both raised into training), record what plain hooks see."""
    torch.manual_seed(0)
    model = _Broken() if broken else nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    names = ["a", "b"] if broken else ["0", "2"]
    truth = _plain_hooks(model, names)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    with Recorder(compiled, tmp_store, layers=names, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            compiled(x).pow(2).sum().backward()
    run = open_run(tmp_store)
    for (kind, n), want in truth.items():
        np.testing.assert_array_equal(run.tensor(n, kind, step=0).values, want.numpy(),
                                      err_msg=f"{kind} {n}")
    assert len(truth) == 4


def test_cuda_graphs_leave_the_recorders_ops_out(tmp_store, fresh_dynamo):
    """mode="reduce-overhead" (CUDA graphs): the recorder keeps the tensors its ops see
    past a graph's replay, which a graph's memory pool refuses, so inductor's own test of
    what a CUDA graph may hold must find the recorder's ops unsafe (it then runs them
    between the graph's partitions, or skips CUDA graphs), in the forward and the
    backward graph.  (Checked on the CPU with inductor's own rule; a GPU run is the
    proof.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node
    found = []

    def keep(gm, _):
        node = get_first_incompatible_cudagraph_node(gm)
        found.append(None if node is None else str(node.target))
        return make_boxed_func(gm.forward)

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    with Recorder(compiled, tmp_store, tensors_every=None, stats_every=1) as rec:
        _steps(compiled, rec, 1)
    assert len(found) >= 2 and all(f is not None and f.startswith("tensortape.")
                                   for f in found), found
    assert open_run(tmp_store).steps("gradients").tolist() == [0]


def _tensortape_codes():
    """The code object of every function and method in the recorder's modules."""
    import inspect
    import sys
    codes = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("tensortape.recorder"):
            continue
        for obj in vars(mod).values():
            members = vars(obj).values() if inspect.isclass(obj) else (obj,)
            for f in members:
                code = getattr(inspect.unwrap(f) if callable(f) else f, "__code__", None)
                if code is not None and code.co_filename.startswith(ROOT):
                    codes.add(code)
    return codes


def test_hooks_run_by_eager_code_between_graphs_are_never_compiled_alone(tmp_store, fresh_dynamo,
                                                                          monkeypatch):
    """Where this torch's Dynamo breaks the graph at a gradient hook (torch 2.11:
    ``_ops.EAGER_GRAD_HOOKS``), the calls after the break run eagerly, and Dynamo would
    compile each hook they call as a frame of its own, guarded on its module: a
    recompile for every module, then the recompile limit's warning and eager code.
    The recorder's hooks run eagerly there instead (and record what plain hooks see)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from tensortape.recorder.hooks import _ops
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    names = [f"{i}.0" for i in range(6)]
    truth = _plain_hooks(model, names)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    rec = Recorder(compiled, tmp_store, layers=names, tensors_every=1, stats_every=1).attach()
    monkeypatch.setattr(_ops, "EAGER_GRAD_HOOKS", True)     # as attach sets it on torch 2.11
    with rec:
        for i in range(3):
            with rec.step(i):
                compiled(x).pow(2).sum().backward()
    compiled_alone = sorted(c.co_name for c in _tensortape_codes() if _debug_get_cache_entry_list(c))
    assert compiled_alone == []
    run = open_run(tmp_store)
    for (kind, n), want in truth.items():
        np.testing.assert_array_equal(run.tensor(n, kind, step=2).values, want.numpy(),
                                      err_msg=f"{kind} {n}")
    assert len(truth) == 12


def test_a_torch_without_exec_strategies_still_records_a_compiled_model(tmp_store, fresh_dynamo,
                                                                        monkeypatch):
    """Where Dynamo cannot be told to leave the hooks to eager code (an older torch, an
    API that changed: here a code object it refuses), the model compiled before
    attaching still recompiles with its hooks and records."""
    from tensortape.recorder.hooks import _ops
    monkeypatch.setattr(_ops, "EAGER_ROOTS", [*_ops.EAGER_ROOTS, "not a code object"])
    compiled = torch.compile(InplaceMLP(), backend="eager")
    compiled(torch.randn(4, 8)).sum().backward()
    with Recorder(compiled, tmp_store, layers="fc*", tensors_every=1, stats_every=1) as rec:
        _steps(compiled, rec, 2)
    assert _recorded(tmp_store) == (["fc1", "fc2"], [0, 1], [0, 1])
