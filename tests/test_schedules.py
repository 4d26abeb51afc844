"""Random training schedules, recorded by tensortape and by a plain oracle.

A hypothesis state machine drives two copies of one model through the same
schedule: steps that begin and end (and skip numbers), forward passes inside
and outside steps and under ``pause()``, several forwards before one backward
(gradient accumulation, contrastive losses), backward after a step ended (late
gradients), optimizer steps, NaN/+-Inf/-0/subnormal inputs, an in-place op
after a capture, a module called twice, tuple and dict outputs, and outputs in
float32, float16, bfloat16, float8 (e4m3fn, e5m2), complex64, int32 and bool.
And what large models do (issue 30):

- **leaf outputs**: modules that return their own parameter (``pos``) or buffer
  (``mask``), used in the output (or not) at each forward; no hook is left on
  the parameter between steps, and none on the model after ``close()``;
- **skipped layers**: an MoE-style expert that each forward routes to or skips;
  where a layer did not run at a step its statistics read absent (counts -1,
  float statistics NaN, histograms -1), never stale values or 0;
- **evaluation passes**: forwards under ``no_grad`` or ``inference_mode``
  inside a step (not recorded, not a micro-batch, counted with the passes
  outside steps; no-grad passes before a step's first training pass dropped,
  a step of no-grad passes alone recorded, as docs/GUIDE.md says);
- **resume**: the recorder closed and another opened on the store with
  ``mode="a"``, going on at the next step or at an earlier one, whose new
  recording replaces the old one whole (micro-batches, layers, events, full
  tensors); a backward of forwards recorded before the close records nothing;
- **activation checkpointing** of a block (a module called twice and the
  expert) in the recorded copy only, reentrant or not, switched on and off
  between forwards: the oracle's copy is never checkpointed, so names and
  values must be the same (no ``#k`` made by a recomputation, gradients under
  the original names, steps and micro-batches).

Each example draws ``stats_every``, ``tensors_every``, ``ring``,
``on_nonfinite``, what to capture and which layers, and some compile the
recorded copy (``backend="eager"``).  One copy is recorded by tensortape, the
other by ``oracle.Oracle``; at the end every number of the store must equal the
oracle's: names, statistics (sums to 1e-9), absent cells, histograms, events,
full tensors of every micro-batch (bit-exact, none more), drops and passes
outside steps.

CI runs a fixed seed and a few examples; ``TENSORTAPE_ORACLE_EXAMPLES=N`` runs N random
ones by hand, e.g. ``TENSORTAPE_ORACLE_EXAMPLES=500 pytest tests/test_schedules.py``
(``TENSORTAPE_ORACLE_SHRINK=1`` shrinks a failing one).
"""
import contextlib
import os
import shutil
import tempfile
import warnings

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensortape.analysis import open_run
from conftest import examples
from oracle import STATS, Oracle, bin_edges
from tensortape.recorder import ConfigError, Recorder

HALF = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3e38, 3e4]   # 3e4: a float16
                                                            # that is finite, but whose sums overflow


class Scale(nn.Module):
    """Called twice a forward: recorded as ``twice`` and ``twice#1``."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.scale


class Half(nn.Module):
    """A differentiable cast: gradients arrive in float16 or bfloat16."""
    dtype = torch.float32

    def forward(self, x):
        return x.to(self.dtype)


class Multi(nn.Module):
    """Tuple and dict outputs, with leaves that are not tensors."""

    def forward(self, x):
        return x * 2, {"a": x + 1, "none": None, "text": "t"}


class Odd(nn.Module):
    """Outputs without gradients, in dtypes numpy lacks or that have no statistics."""

    def forward(self, x):
        x = x.detach().float()
        return (x.clamp(-400, 400).to(torch.float8_e4m3fn), x.to(torch.float8_e5m2),
                torch.complex(x, -x), torch.nan_to_num(x, 0.0, 0.0, 0.0).clamp(-1e6, 1e6).round()
                .to(torch.int32), x > 0)


class Leaf(nn.Module):
    """Returns its own parameter (``pos``) or buffer (``mask``): the hook is handed a
    leaf, which outlives the pass; no gradient hook may stay on it."""

    def __init__(self, param: bool):
        super().__init__()
        t = torch.linspace(-1.5, 2.0, 4)
        if param:
            self.t = nn.Parameter(t)
        else:
            self.register_buffer("t", t.abs() + 0.5)

    def forward(self):
        return self.t


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(nn.Linear(4, 4))    # a container: called by iteration
        self.clip = nn.Linear(4, 4)
        self.twice = Scale()
        self.expert = nn.Linear(4, 4)                # runs at the micro-batches routed to it
        self.cast = Half()
        self.multi = Multi()
        self.odd = Odd()
        self.pos, self.mask = Leaf(True), Leaf(False)
        self.route, self.leaf = True, True           # set by the schedule before each forward
        self.ckpt = None                             # None, "reentrant" or "plain" (the recorded
                                                     # copy only: the oracle's never checkpoints)

    def block(self, z, route):
        """The checkpointed block: a module called twice, and the expert."""
        h = self.twice(self.twice(z))
        if route:                                    # an MoE expert that got no tokens: skipped
            h = h + self.expert(h)
        return h

    def forward(self, x):
        y = self.seq(x)
        c = self.clip(x)
        c.relu_()                      # in place after the capture: stored values must not change
        if self.ckpt is None:
            h = self.block(y + c, self.route)
        else:
            h = checkpoint(self.block, y + c, self.route, use_reentrant=self.ckpt == "reentrant")
        a, d = self.multi(self.cast(h))
        self.odd(a)
        if self.leaf:
            a = a * self.mask().to(a.dtype) + self.pos().to(a.dtype)   # leaf outputs
        return a, d["a"]


A, G, I, W, WG = "activations", "gradients", "inputs", "weights", "weight_grads"
CONFIGS = [       # every setting is covered; hypothesis draws one an example, then a schedule
    dict(layers=["*"], capture=(A, G), stats_every=1, tensors_every=1, ring=0,
         on_nonfinite="record", compile=False, half=torch.float32, ckpt=None),
    dict(layers=["0.seq.0", "0.clip", "0.multi", "0.pos", "0.expert"], capture=(A, G, I),
         stats_every=2, tensors_every=2, ring=1, on_nonfinite="dump", compile=False,
         half=torch.float16, ckpt="reentrant"),
    dict(layers=["", "0.twice", "0.odd", "0.expert"], capture=(A, G, W, WG),
         stats_every=3, tensors_every=None, ring=2, on_nonfinite="dump", compile=False,
         half=torch.bfloat16, ckpt=None),
    dict(layers=["*"], capture=(A, G, I, W, WG), stats_every=2, tensors_every=1, ring=0,
         on_nonfinite="record", compile=True, half=torch.float16, ckpt="plain"),
    dict(layers=["0.cast", "0.seq", "0.clip", "0.pos"], capture=(G,), stats_every=1,
         tensors_every=3, ring=2, on_nonfinite="dump", compile=False, half=torch.float32,
         ckpt=None),
    dict(layers=["0.*"], capture=(A, G), stats_every=3, tensors_every=2, ring=0,
         on_nonfinite="record", compile=True, half=torch.bfloat16, ckpt="reentrant"),
    dict(layers=["*"], capture=(A, G, I), stats_every=2, tensors_every=None, ring=0,
         on_nonfinite="record", compile=False, half=torch.float16, ckpt="plain"),
    dict(layers=["0.seq.0", "0.clip", "0.odd", "0.expert", "0.pos", "0.mask"], capture=(A, G),
         stats_every=1, tensors_every=1, ring=0, on_nonfinite="dump", compile=False,
         half=torch.bfloat16, ckpt=None),
]


MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
         "inference": torch.inference_mode}


def hooks_on(model: nn.Module) -> int:
    """Every hook on a model: its modules' and its parameters' and buffers' tensor hooks."""
    n = 0
    for m in model.modules():
        n += sum(len(getattr(m, d)) for d in ("_forward_hooks", "_forward_pre_hooks",
                                              "_backward_hooks", "_backward_pre_hooks"))
    for t in [*model.parameters(), *model.buffers()]:
        n += len(t._backward_hooks or {}) + len(getattr(t, "_post_accumulate_grad_hooks", None)
                                                or {})
    return n


class Schedules(RuleBasedStateMachine):
    @initialize(cfg=st.sampled_from(CONFIGS))
    def start(self, cfg):
        self.dir = tempfile.mkdtemp(prefix="tt-sched-")
        self.store = os.path.join(self.dir, "run.zarr")
        self.cfg = cfg
        # 0: the oracle's copy, 1: tensortape's; the root a container, called by iteration
        self.models = [nn.Sequential(Net()), nn.Sequential(Net())]
        for m in self.models:
            m[0].cast.dtype = cfg["half"]
        self.models[1][0].ckpt = cfg["ckpt"]          # the recorded copy's block checkpointed
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in self.models]
        recorded = self.models[1]
        self.limit = contextlib.nullcontext()
        if cfg["compile"]:          # compiled and trained before the recorder attaches, on
            torch._dynamo.reset()   # every shape to come (so no later call must recompile)
            # the schedule's variants (grad modes, dtypes, skipped expert, leaves, checkpoint)
            # would recompile each frame up to 8 times, each resume again: past 2 it runs eager
            self.limit = torch._dynamo.config.patch(recompile_limit=2)
            self.limit.__enter__()
            recorded = torch.compile(recorded, backend="eager")
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):   # as in a fresh process
                for rows in range(4):
                    for run, opt in zip((self.models[0], recorded), self.opts):
                        a, b = run(torch.ones(rows, 4))
                        (a.float().sum() + b.float().sum()).backward()
                        opt.step()
                        opt.zero_grad()
        self.kw = {k: cfg[k] for k in ("capture", "stats_every", "tensors_every", "ring",
                                       "on_nonfinite")}
        self.oracle = Oracle(self.models[0], cfg["layers"], **self.kw)
        self.run = [self.models[0], recorded]
        self.rec = self.recorder("w-")
        self.step, self.open, self.pending, self.since = -1, False, [], 0

    def recorder(self, mode):
        return Recorder(self.run[1], self.store, layers=self.cfg["layers"], outside_step="ignore",
                        flush_interval=60.0, mode=mode, **{"stats_every": 1, **self.kw}).attach()

    def close(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.rec.close()
        assert hooks_on(self.models[1]) == 0            # the model as it was: no hook left

    def teardown(self):
        if not hasattr(self, "rec"):
            return
        try:
            if self.open:
                self.end_step()
            self.close()
            self.oracle.close()
            check(open_run(self.store), self.oracle, self.rec)
        finally:
            self.limit.__exit__(None, None, None)
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- the schedule ---------------------------------------------------------------------
    @rule(gap=st.integers(1, 3))
    def begin_step(self, gap):
        if self.open:
            self.end_step()
        self.step += gap
        self.since += 1
        self.oracle.begin(self.step)
        self.scope = self.rec.step(self.step)
        self.scope.__enter__()
        self.open = True

    @precondition(lambda self: self.open)
    @rule()
    def end_step(self):
        self.oracle.end()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # late-gradient and dtype-change notes
            self.scope.__exit__(None, None, None)
        self.open = False

    @rule(data=st.data(), rows=st.integers(0, 3), mode=st.sampled_from(list(MODES)))
    def forward(self, data, rows, mode):
        """A forward pass: a micro-batch inside a step (with grad), an evaluation pass
        (under no_grad or inference_mode) inside one, or a pass outside one.  The
        expert is routed to, or skipped, and the leaf outputs used, or not."""
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), "seed"))
        x = torch.randn(rows, 4, generator=g) * 4
        if rows:
            for v in data.draw(st.lists(st.sampled_from(SPECIALS), max_size=3), "specials"):
                x.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=g))] = v
        route, leaf = data.draw(st.booleans(), "route"), data.draw(st.booleans(), "leaf")
        outs = []
        for run, model in zip(self.run, self.models):
            model[0].route, model[0].leaf = route, leaf
            with MODES[mode]():
                outs.append(run(x.clone()))
        if mode == "grad":
            self.pending.append((outs, data.draw(st.floats(0.5, 100), "weight")))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), n=st.integers(2, 3))
    def accumulate(self, data, n):
        """Gradient accumulation, or a contrastive loss: several forwards of the step,
        then one backward of them all."""
        for _ in range(n):
            self.forward(data, data.draw(st.integers(1, 3), "rows"), "grad")
        self.backward(False)

    @precondition(lambda self: self.pending)
    @rule(optimize=st.booleans())
    def backward(self, optimize):
        """One backward of every forward since the last (a step's, an earlier one's, or
        one recorded by a recorder since closed), then maybe an optimizer step."""
        for i in range(2):
            loss = sum(w * (outs[i][0].float().sum() + outs[i][1].float().sum())
                       for outs, w in self.pending)
            loss.backward()
        self.pending = []
        if optimize:
            for opt in self.opts:
                opt.step()
                opt.zero_grad()

    @rule(dtype=st.sampled_from(HALF))
    def switch_half(self, dtype):
        """The cast's dtype changes: later full tensors of its tables change dtype."""
        for m in self.models:
            m[0].cast.dtype = dtype

    @rule(how=st.sampled_from([None, "reentrant", "plain"]))
    def checkpointing(self, how):
        """The block (``twice`` twice, the expert) of the recorded copy is checkpointed,
        reentrant or not, from its next forward: recorded as if it were not."""
        self.models[1][0].ckpt = how

    @rule(data=st.data())
    def paused(self, data):
        """A forward and backward under pause(): nothing of it is recorded."""
        x = torch.randn(2, 4)
        with self.rec.pause(), self.oracle.pause():
            for run in self.run:
                a, b = run(x.clone())
                (a.float().sum() + b.float().sum()).backward()

    @precondition(lambda self: self.since >= 2)
    @rule(back=st.integers(0, 4))
    def resume(self, back):
        """The job resumes: the recorder closes and another opens the store with
        ``mode="a"``, going on from the next step, or (``back``) from an earlier one,
        whose new recording replaces the old, whole."""
        if self.open:
            self.end_step()
        self.close()
        self.oracle.resume()
        self.rec = self.recorder("a")
        self.since = 0
        self.step = max(self.step - back, -1)

    @invariant()
    def same_outside_count(self):
        if hasattr(self, "rec"):
            assert self.rec.outside_steps == self.oracle.outside

    @invariant()
    def no_leaf_hook_between_steps(self):
        """A leaf output's gradient hook goes when its step ends."""
        if hasattr(self, "rec") and not self.open:
            for m in self.models:
                assert len(m[0].pos.t._backward_hooks or {}) == 0


EXACT = ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac")
COUNTS = ("count", "nan", "posinf", "neginf")


def same(got, want, what):
    """Equal, NaN included; the float64 sums (mean, std, norm) to 1e-9."""
    got, want = float(got), float(want)
    if np.isnan(want):
        assert np.isnan(got), (what, got, want)
    elif what[-1] in EXACT:
        assert got == want, (what, got, want)
    else:
        assert abs(got - want) <= 1e-9 * max(abs(got), abs(want)), (what, got, want)


def bits(a: np.ndarray) -> np.ndarray:
    """Floats (complex: both parts) as their bits, so -0 and NaN payloads count."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "c":
        a = a.view(f"f{a.itemsize // 2}")
    return a.view(f"u{a.itemsize}") if a.dtype.kind == "f" else a


def stored_rows(oracle):
    """The oracle's stored full tensors (of each step's latest recording), less those a
    table refuses (its first row written sets its dtype and rank); the count refused,
    and the (kind, name) of every table written (by any recording)."""
    tables, kept, refused = {}, {}, 0
    for key, t, live in oracle.written():
        if tables.setdefault(key[:2], (t.dtype, t.dim())) == (t.dtype, t.dim()):
            if live:
                kept[key] = t
        else:
            refused += 1
    return kept, refused, set(tables)


def check(run, oracle, rec):
    """Every number of the store against the oracle's."""
    assert run.layers == oracle.names()
    keys = oracle.keys()
    kept, refused, tables = stored_rows(oracle)
    assert run.kinds == [k for k in ("activations", "gradients", "inputs", "weights", "weight_grads")
                         if oracle.stat_names(k) or any(k == t[0] for t in tables)]
    lo, hi = bin_edges()
    for kind in run.kinds:
        ds = run.stats(kind).compute()
        assert ds.step.values.tolist() == sorted({s for s, k, _ in keys if k == kind}), kind
        ran = {(s, n) for s, k, n in keys if k == kind}
        assert set(ds.layer.values.tolist()) == oracle.stat_names(kind), kind
        for stat in COUNTS:
            assert ds[stat].dtype == np.int64, (kind, stat, ds[stat].dtype)
        table = {stat: ds[stat].values for stat in STATS}      # (step, layer)
        for j, name in enumerate(ds.layer.values.tolist()):
            h = run.histogram(name, kind).compute()
            np.testing.assert_array_equal(h.bin_lo.values, lo)
            np.testing.assert_array_equal(h.bin_hi.values, hi)
            assert h.step.values.tolist() == ds.step.values.tolist()
            counts, apart = h.values, [h[c].values for c in COUNTS[1:]]
            for i, step in enumerate(ds.step.values.tolist()):
                what = (step, kind, name)
                if (step, name) not in ran:      # did not run there (a skipped expert, a
                    for stat in STATS:           # leaf not used): absent, never stale
                        if stat in COUNTS:
                            assert table[stat][i, j] == -1, (what, stat, table[stat][i, j])
                        else:
                            assert np.isnan(table[stat][i, j]), (what, stat, table[stat][i, j])
                    assert (counts[i] == -1).all(), what
                    assert [int(c[i]) for c in apart] == [-1] * 3, what
                    continue
                want = oracle.stats(step, kind, name)
                for stat in STATS:
                    same(table[stat][i, j], want[stat], (*what, stat))
                expect = oracle.histogram(step, kind, name)
                np.testing.assert_array_equal(counts[i], 0 if expect is None else expect,
                                              err_msg=str(what))
                assert [int(c[i]) for c in apart] == [want[c] for c in COUNTS[1:]], what
    events = [(e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf) for e in run.events]
    assert events == oracle.events()
    for kind in run.kinds:
        assert set(run.tensor_layers(kind)) == {n for k, n, _, _ in kept if k == kind}
        assert run.steps(kind, tensors=True).tolist() == sorted({s for k, _, s, _ in kept
                                                                  if k == kind})
        for name in run.tensor_layers(kind):
            micros = {}                          # micro -> step -> tensor
            for (k, n, s, m), t in kept.items():
                if (k, n) == (kind, name):
                    micros.setdefault(m, {})[s] = t
            for m in range(max(micros) + 1):     # each micro-batch's steps: no phantom
                try:                             # micro-batch, no stale row
                    arr = run.tensor(name, kind, micro=m)
                except ConfigError:
                    assert m not in micros, (kind, name, m)
                    continue
                want = micros.get(m, {})
                assert arr.step.values.tolist() == sorted(want), (kind, name, m)
                data = arr.values                # one read; each step cut to its extent
                for i, step in enumerate(arr.step.values.tolist()):
                    got = data[(i, *(slice(0, int(arr[f"extent_{d}"].values[i]))
                                     for d in arr.dims[1:]))]
                    t = want[step]
                    exp = t.float().numpy() if t.dtype == torch.bfloat16 or "float8" in str(t.dtype) \
                        else t.numpy()
                    what = (kind, name, step, m)
                    assert got.shape == exp.shape and got.dtype == exp.dtype, (what, got.dtype)
                    np.testing.assert_array_equal(bits(got), bits(exp), err_msg=str(what))
    reasons = run.attrs["drop_reasons"]
    assert reasons.get("gradient arrived after its step", 0) == oracle.dropped
    assert reasons.get("full tensor changed dtype or rank", 0) == refused
    assert run.dropped == oracle.dropped + refused == sum(reasons.values()), reasons
    assert run.attrs["outside_steps"] == oracle.outside


def test_random_schedules_match_the_oracle():
    cfg = settings(examples(40), stateful_step_count=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_state_machine_as_test(Schedules, settings=cfg)


class _Drawn:
    """``st.data()`` for a schedule written out by hand: each label's value."""

    def __init__(self, **values):
        self.values = {"seed": 1, "specials": [], "route": True, "leaf": True, "weight": 1.0,
                       "rows": 2, **values}

    def draw(self, strategy, label):
        return self.values[label]


def test_a_compiled_checkpointed_resumed_schedule_keeps_its_weight_gradients():
    """A random schedule that once failed, written out: compiled, checkpointed
    (reentrant), every kind captured, resumed one step back, NaN at steps 3 and 4,
    each of which begins with an evaluation pass (its weight gradients were lost)."""
    m = Schedules()
    m.start(cfg=CONFIGS[3])
    m.checkpointing("reentrant")
    for step in range(7):
        if step == 5:
            m.resume(1)
        m.begin_step(1)
        m.forward(_Drawn(), 2, "inference" if step in (2, 3, 4) else "grad")
        m.accumulate(_Drawn(specials=[float("nan")] * (m.step in (3, 4))), 2)
    m.teardown()
