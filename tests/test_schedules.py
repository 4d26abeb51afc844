"""Random training schedules, recorded by tensortape and by a plain oracle.

A hypothesis state machine drives two copies of one model through the same
schedule: steps that begin and end (and skip numbers), forward passes inside
and outside steps and under ``pause()``, several forwards before one backward
(gradient accumulation, contrastive losses), backward after a step ended (late
gradients), optimizer steps, NaN/+-Inf/-0/subnormal inputs, an in-place op
after a capture, a module called twice, tuple and dict outputs, and outputs in
float32, float16, bfloat16, float8 (e4m3fn, e5m2), complex64, int32 and bool.
Each example draws ``stats_every``, ``tensors_every``, ``ring``,
``on_nonfinite``, what to capture and which layers, and some compile the
recorded copy (``backend="eager"``).  One copy is recorded by tensortape, the
other by ``oracle.Oracle``; at the end every number of the store must equal the
oracle's: names, statistics (sums to 1e-9), histograms, events, full tensors
(bit-exact), drops and passes outside steps.

CI runs a fixed seed (``derandomize``); ``TENSORTAPE_SCHEDULES=N`` runs N random
examples by hand, e.g. ``TENSORTAPE_SCHEDULES=500 pytest tests/test_schedules.py``.
"""
import os
import shutil
import tempfile
import warnings

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from torch import nn

from analysis import open_run
from oracle import STATS, Oracle, bin_edges
from recorder import Recorder

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


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(nn.Linear(4, 4))    # a container: called by iteration
        self.clip = nn.Linear(4, 4)
        self.twice = Scale()
        self.cast = Half()
        self.multi = Multi()
        self.odd = Odd()

    def forward(self, x):
        y = self.seq(x)
        c = self.clip(x)
        c.relu_()                      # in place after the capture: stored values must not change
        h = self.cast(self.twice(self.twice(y + c)))
        a, d = self.multi(h)
        self.odd(a)
        return a, d["a"]


A, G, I, W, WG = "activations", "gradients", "inputs", "weights", "weight_grads"
CONFIGS = [       # every setting is covered; hypothesis draws one an example, then a schedule
    dict(layers=["*"], capture=(A, G), stats_every=1, tensors_every=1, ring=0,
         on_nonfinite="record", compile=False, half=torch.float32),
    dict(layers=["0.seq.0", "0.clip", "0.multi"], capture=(A, G, I), stats_every=2,
         tensors_every=2, ring=1, on_nonfinite="dump", compile=False, half=torch.float16),
    dict(layers=["", "0.twice", "0.odd"], capture=(A, G, W, WG), stats_every=3,
         tensors_every=None, ring=2, on_nonfinite="dump", compile=False, half=torch.bfloat16),
    dict(layers=["*"], capture=(A, G, I, W, WG), stats_every=2, tensors_every=1, ring=0,
         on_nonfinite="record", compile=True, half=torch.float16),
    dict(layers=["0.cast", "0.seq", "0.clip"], capture=(G,), stats_every=1, tensors_every=3,
         ring=2, on_nonfinite="dump", compile=False, half=torch.float32),
    dict(layers=["0.*"], capture=(A, G), stats_every=3, tensors_every=2, ring=1,
         on_nonfinite="record", compile=True, half=torch.bfloat16),
    dict(layers=["*"], capture=(A, G, I), stats_every=2, tensors_every=None, ring=0,
         on_nonfinite="record", compile=False, half=torch.float16),
    dict(layers=["0.seq.0", "0.clip", "0.odd"], capture=(A, G), stats_every=1, tensors_every=1,
         ring=0, on_nonfinite="dump", compile=False, half=torch.bfloat16),
]


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
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in self.models]
        recorded = self.models[1]
        if cfg["compile"]:          # compiled and trained before the recorder attaches, on
            torch._dynamo.reset()   # every shape to come (so no later call must recompile)
            recorded = torch.compile(recorded, backend="eager")
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):   # as in a fresh process
                for rows in range(4):
                    for run, opt in zip((self.models[0], recorded), self.opts):
                        a, b = run(torch.ones(rows, 4))
                        (a.float().sum() + b.float().sum()).backward()
                        opt.step()
                        opt.zero_grad()
        kw = {k: cfg[k] for k in ("capture", "stats_every", "tensors_every", "ring", "on_nonfinite")}
        self.oracle = Oracle(self.models[0], cfg["layers"], **kw)
        self.run = [self.models[0], recorded]
        self.rec = Recorder(recorded, self.store, layers=cfg["layers"], outside_step="ignore",
                            flush_interval=60.0, **kw).attach()
        self.step, self.open, self.pending = -1, False, []

    def teardown(self):
        if not hasattr(self, "rec"):
            return
        try:
            if self.open:
                self.end_step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.rec.close()
            self.oracle.close()
            check(open_run(self.store), self.oracle, self.rec)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- the schedule ---------------------------------------------------------------------
    @rule(gap=st.integers(1, 3))
    def begin_step(self, gap):
        if self.open:
            self.end_step()
        self.step += gap
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

    @rule(data=st.data(), rows=st.integers(0, 3), grad=st.booleans())
    def forward(self, data, rows, grad):
        """A forward pass (a micro-batch inside a step, or a pass outside one)."""
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), "seed"))
        x = torch.randn(rows, 4, generator=g) * 4
        if rows:
            for v in data.draw(st.lists(st.sampled_from(SPECIALS), max_size=3), "specials"):
                x.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=g))] = v
        outs = []
        for run in self.run:
            with torch.set_grad_enabled(grad):
                outs.append(run(x.clone()))
        if grad:
            self.pending.append((outs, data.draw(st.floats(0.5, 100), "weight")))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), n=st.integers(2, 3))
    def accumulate(self, data, n):
        """Gradient accumulation, or a contrastive loss: several forwards of the step,
        then one backward of them all."""
        for _ in range(n):
            self.forward(data, data.draw(st.integers(1, 3), "rows"), True)
        self.backward(False)

    @precondition(lambda self: self.pending)
    @rule(optimize=st.booleans())
    def backward(self, optimize):
        """One backward of every forward since the last (a step's or an earlier one's),
        then maybe an optimizer step."""
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

    @rule(data=st.data())
    def paused(self, data):
        """A forward and backward under pause(): nothing of it is recorded."""
        x = torch.randn(2, 4)
        with self.rec.pause(), self.oracle.pause():
            for run in self.run:
                a, b = run(x.clone())
                (a.float().sum() + b.float().sum()).backward()

    @invariant()
    def same_outside_count(self):
        if hasattr(self, "rec"):
            assert self.rec.outside_steps == self.oracle.outside


EXACT = ("count", "nan", "posinf", "neginf", "min", "max", "abs_max", "zero_frac")


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
    """The oracle's stored full tensors, less those a table refuses: its first row
    (in the order they are written) sets its dtype and rank."""
    stored, tables, kept, refused = oracle.tensors(), {}, {}, 0
    for key in sorted(stored, key=lambda k: (k[2], k[0] in ("gradients", "weight_grads"), k[3])):
        t = stored[key]
        if tables.setdefault(key[:2], (t.dtype, t.dim())) == (t.dtype, t.dim()):
            kept[key] = t
        else:
            refused += 1
    return kept, refused


def check(run, oracle, rec):
    """Every number of the store against the oracle's."""
    assert run.layers == oracle.names()
    keys = oracle.keys()
    kept, refused = stored_rows(oracle)
    assert run.kinds == [k for k in ("activations", "gradients", "inputs", "weights", "weight_grads")
                         if any(k == kk for _, kk, _ in keys) or any(k == t[0] for t in kept)]
    lo, hi = bin_edges()
    for kind in run.kinds:
        ds = run.stats(kind).compute()
        assert ds.step.values.tolist() == sorted({s for s, k, _ in keys if k == kind}), kind
        for step, k, name in keys:
            if k != kind:
                continue
            want = oracle.stats(step, kind, name)
            row = ds.sel(step=step, layer=name)
            for stat in STATS:
                same(row[stat], want[stat], (step, kind, name, stat))
            h = run.histogram(name, kind, step=step)
            np.testing.assert_array_equal(h.bin_lo.values, lo)
            np.testing.assert_array_equal(h.bin_hi.values, hi)
            expect = oracle.histogram(step, kind, name)
            np.testing.assert_array_equal(h.values, 0 if expect is None else expect,
                                          err_msg=f"{step} {kind} {name}")
    events = [(e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf) for e in run.events]
    assert events == oracle.events()
    for (kind, name, step, micro), t in kept.items():
        got = run.tensor(name, kind, step=step, micro=micro).values
        want = t.float().numpy() if t.dtype == torch.bfloat16 or "float8" in str(t.dtype) \
            else t.numpy()
        assert got.shape == want.shape and got.dtype == want.dtype, (kind, name, step, micro)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{kind} {name} {step} {micro}")
    for kind in run.kinds:
        assert set(run.tensor_layers(kind)) == {n for k, n, _, _ in kept if k == kind}
        for name in run.tensor_layers(kind):
            assert run.steps(kind, tensors=True, layer=name).tolist() == sorted(
                {s for k, n, s, _ in kept if (k, n) == (kind, name)})
    reasons = run.attrs["drop_reasons"]
    assert reasons.get("gradient arrived after its step", 0) == oracle.dropped
    assert reasons.get("full tensor changed dtype or rank", 0) == refused
    assert run.dropped == oracle.dropped + refused == sum(reasons.values()), reasons
    assert run.attrs["outside_steps"] == oracle.outside


def test_random_schedules_match_the_oracle():
    n = int(os.environ.get("TENSORTAPE_SCHEDULES", "0"))
    cfg = settings(max_examples=n or 60, stateful_step_count=20, deadline=None,
                   derandomize=not n, suppress_health_check=list(HealthCheck))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_state_machine_as_test(Schedules, settings=cfg)
