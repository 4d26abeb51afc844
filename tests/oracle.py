"""A deliberately plain reference recorder: what the SPEC says a store must hold.

It uses nothing of tensortape: forward hooks and pre-hooks, ``Tensor.register_hook``,
``fnmatch`` and numpy.  Attached to a copy of the model that tensortape records,
and driven through the same schedule (``begin``, ``end``, ``pause``), it keeps
every capture as the SPEC defines it, and computes from them:

- ``names()``: every recorded name in first-capture order;
- ``stats(step, kind, name)``: the statistics of a step, over all its
  micro-batches together, NaN/Inf counted apart and never poisoning the rest;
- ``histogram(step, kind, name)``: counts in the documented bins;
- ``events()``: one per capture holding NaN/Inf, ordered by step, forward before
  backward, then execution order;
- ``tensors()``: the full tensors a store must hold, by (kind, name, step, micro),
  after ``tensors_every``, the ring and ``on_nonfinite="dump"``; ``written()``:
  all of them in the order the store is handed them (a table's first row sets
  its dtype);
- ``dropped``: gradients that arrived after their step ended;
- ``scalars()``: what ``log`` was given, per step of its latest recording;
- ``due()``, ``dumped()``: the full tensors ``tensors_every`` asks for, and those
  a NaN/Inf dump stores whatever the budget (``max_bytes`` counts them apart);
- ``outside``: forward passes of the root outside a step, and evaluation
  passes (the root called under ``no_grad``/``inference_mode``) inside one:
  neither is recorded.  A step whose passes all ran without grad (inference)
  records them as micro-batches.

A leaf output (a module returning its own parameter) gets a gradient hook, for a
call with grad only, that takes the first gradient after its call, and is removed
when its step ends.

``resume()`` is a recorder closed and another opened on the same store
(``mode="a"``): gradients of the closed one's captures are nobody's (not stored,
not dropped), the ring starts empty, and a step begun again replaces its earlier
recording whole (every micro-batch, its events and full tensors), while what an
earlier recording dumped of other steps stays.
"""
from __future__ import annotations

import collections
import contextlib
import fnmatch
import math
from fractions import Fraction

import numpy as np
import torch

STATS = ("count", "mean", "std", "min", "max", "abs_max", "norm", "zero_frac", "nan", "posinf",
         "neginf")
COUNTS = ("count", "nan", "posinf", "neginf")
FORWARD, BACKWARD = ("inputs", "activations", "weights"), ("gradients", "weight_grads")


def bin_edges():
    """The documented bins: zero; per sign, [2^e (1 + m/4), 2^e (1 + (m+1)/4)) for
    e in [-64, 64) and m in 0..3; below 2^-64 an underflow bin, from 2^64 an
    overflow bin.  Negative bins mirror the positive ones."""
    lo_pos = [0.0] + [2.0 ** e * (1 + m / 4) for e in range(-64, 64) for m in range(4)] + [2.0 ** 64]
    hi_pos = [2.0 ** -64] + [2.0 ** e * (1 + (m + 1) / 4) for e in range(-64, 64) for m in range(4)] \
        + [np.inf]
    lo_pos, hi_pos = np.array(lo_pos), np.array(hi_pos)
    return (np.concatenate([-hi_pos[::-1], [0.0], lo_pos]),
            np.concatenate([-lo_pos[::-1], [0.0], hi_pos]))


def histogram(values: np.ndarray, edges=None) -> np.ndarray:
    """Counts of finite float64 values in the documented bins (or ``edges``, a
    ``(lo, hi)`` pair): [lo, hi) above zero, (lo, hi] below it, exact zeros (either
    sign) in the zero bin."""
    lo, _ = bin_edges() if edges is None else edges
    return np.bincount(bin_index(values[np.isfinite(values)], edges), minlength=len(lo))


def bin_index(v: np.ndarray, edges=None) -> np.ndarray:
    """The bin of each finite value (as ``histogram`` counts them)."""
    lo, hi = bin_edges() if edges is None else edges
    zero = len(lo) // 2
    idx = np.where(v > 0, np.searchsorted(lo, v, side="right") - 1,
                   np.searchsorted(hi, v, side="left"))
    return np.where(v == 0, zero, idx)


def values(t: torch.Tensor) -> np.ndarray | None:
    """A float tensor's values as float64 (exact for every float dtype), or None."""
    if not t.is_floating_point():
        return None
    return t.detach().to(torch.float64).reshape(-1).numpy()


def statistics(parts: list[torch.Tensor]) -> dict:
    """The statistics of tensors taken together: ``count`` counts every element, the
    others cover the float ones (integer, bool and complex tensors have none)."""
    count = sum(p.numel() for p in parts)
    out = dict.fromkeys(STATS, np.nan)
    out.update(count=count, nan=0, posinf=0, neginf=0)
    floats = [values(p) for p in parts if p.is_floating_point()]
    if not floats:
        return out
    v = np.concatenate(floats)
    out.update(nan=int(np.isnan(v).sum()), posinf=int((v == np.inf).sum()),
               neginf=int((v == -np.inf).sum()))
    f = v[np.isfinite(v)]
    out["norm"] = float(np.sqrt(np.sum(f * f)))
    if f.size:
        out.update(mean=f.mean(), std=f.std(), min=f.min(), max=f.max(), abs_max=np.abs(f).max(),
                   zero_frac=(f == 0).sum() / f.size)
    return out


EPS = Fraction(1, 1 << 52)                  # float64's unit roundoff, times 2
BIG = Fraction(np.finfo(np.float64).max)
TINY = Fraction(1, 1 << 1074)               # float64's smallest subnormal
SLACK = 8                                   # float64 sums of n terms: within SLACK * n * EPS


def exact(parts: list[torch.Tensor]) -> dict:
    """``statistics(parts)``, with the sums as exact ``Fraction``s: ``n`` finite
    values, their ``sum``, ``sumsq`` and the ``spread`` (max - min) and ``size``
    (largest magnitude) that bound the rounding of float64 sums of them."""
    with np.errstate(over="ignore", invalid="ignore"):     # numpy's sums: replaced below
        out = statistics(parts)
    floats = [values(p) for p in parts if p.is_floating_point()]
    v = np.concatenate(floats) if floats else np.zeros(0)
    f = [Fraction(float(x)) for x in v[np.isfinite(v)]]
    out.update(n=len(f), sum=sum(f, Fraction(0)), sumsq=sum((x * x for x in f), Fraction(0)),
               spread=max(f) - min(f) if f else Fraction(0),
               size=max(abs(x) for x in f) if f else Fraction(0))
    return out


def _fraction(x: float) -> Fraction | None:
    return Fraction(float(x)) if math.isfinite(float(x)) else None


def truth(stat: str, ex: dict):
    """A statistic of ``exact``: a float where float64 holds it exactly, a Fraction
    for a sum (``mean``; ``std``, ``norm`` and ``rms`` squared), NaN without a
    finite value; ``rms`` (norm over the root of the finite count) and
    ``nonfinite`` (NaN + Inf elements) are the browser map's."""
    if stat == "nonfinite":
        return ex["nan"] + ex["posinf"] + ex["neginf"]
    n = ex["n"]
    if stat not in ("mean", "std", "norm", "rms") or (n == 0 and stat != "norm"):
        return ex[stat] if stat in ex else np.nan
    mean = ex["sum"] / n if n else Fraction(0)
    return {"mean": mean, "std": ex["sumsq"] / n - mean * mean if n else None,
            "norm": ex["sumsq"], "rms": ex["sumsq"] / n if n else None}[stat]


def agrees(stat: str, got: float, ex: dict, rel: float = 0.0, floor: float = 0.0) -> bool:
    """Whether ``got``, a stored statistic, is the exact one (``exact``): counts, min,
    max, abs_max and zero_frac equal (``-0 == 0``: engines may differ in a zero's
    sign), NaN where there is no finite value; mean, std, norm and rms within the
    rounding of float64 sums of ``n`` terms, bounded by the terms' size (a mean
    that cancels is held to its terms, a variance to the squared spread) and, near
    zero, by ``n`` of the smallest subnormals; finite wherever the truth is (inf only
    where it passes float64).  ``rel``, ``floor``: a further relative and absolute
    slack for the sums (a reader that rounds them to float32)."""
    want, got = truth(stat, ex), float(got)
    if not isinstance(want, Fraction):
        return (math.isnan(got) and math.isnan(want)) or got == want
    g, n = _fraction(got), ex["n"]
    tol, tiny = SLACK * n * EPS + Fraction(rel) * 2, SLACK * n * TINY + Fraction(floor)
    if stat == "mean":
        return g is not None and abs(g - want) <= tol * ex["size"] + tiny
    if want > BIG * BIG:                                    # the root passes float64
        return got == math.inf
    if g is None or g < 0:
        return False
    tol *= ex["spread"] * ex["spread"] + want if stat == "std" else want
    return abs(g * g - want) <= tol or max(g - tiny, 0) ** 2 <= want <= (g + tiny) ** 2


def at_least(stat: str, got: float, ex: dict) -> bool:
    """Whether ``got`` is no smaller than the exact statistic (for a column of the map,
    the largest of its steps)."""
    want, got = truth(stat, ex), float(got)
    if math.isnan(got):
        return False
    if not isinstance(want, Fraction):
        return math.isnan(want) or got >= want
    if got == math.inf:
        return True
    g = Fraction(got)
    return g >= want if stat == "mean" else g >= 0 and g * g >= want


def largest(stat: str, got: float, cells: list) -> bool:
    """Whether ``got`` is the largest of ``cells`` (``exact`` dicts; None where the
    layer did not run: counts -1, else NaN), as a column of several steps holds it:
    it agrees with one of them and is no smaller than any other (each to its
    rounding), NaN when none has a value."""
    got = float(got)
    if stat in COUNTS:
        return got == max(-1 if c is None else truth(stat, c) for c in cells)
    held = [c for c in cells if c is not None and not (
        isinstance(truth(stat, c), float) and math.isnan(truth(stat, c)))]
    if not held:
        return math.isnan(got)
    return (any(agrees(stat, got, c) for c in held)
            and all(at_least(stat, got, c) or agrees(stat, got, c) for c in held))


def leaves(obj, path=""):
    """Tensors of an output or inputs, with their documented paths."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}.{i}" if path else str(i))


class Oracle:
    def __init__(self, model, layers, capture, stats_every=1, tensors_every=1, ring=0,
                 on_nonfinite="record"):
        self.capture, self.stats_every, self.tensors_every = set(capture), stats_every, tensors_every
        self.ring, self.on_nonfinite = ring, on_nonfinite
        patterns = [layers] if isinstance(layers, str) else layers
        self.modules = [(n, m) for n, m in model.named_modules()
                        if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        self.step = None
        self.paused = 0
        self.micro = 0
        self.calls = collections.Counter()
        self.weighed = set()
        self.caps = []             # dicts: step, micro, kind, name, tensor (a copy), seq, session
        self.steps = []            # (session, step) of every step begun, in order; None: resumed
        self.session = 0           # recorders closed and re-opened (resume)
        self.latest = {}           # step -> the session of its latest recording
        self.dropped = 0
        self.outside = 0
        self.logged = {}           # (session, step) -> {name: value}: rec.log's scalars
        self.last = None           # the last step ended
        self.evaluating = False             # the root's call under no_grad, inside a step
        self.leaf_handles = []              # gradient hooks on leaf outputs, this step
        self.handles = [model.register_forward_pre_hook(self._root_pre)]
        for name, m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post(name)))
        self.handles.append(model.register_forward_hook(self._root_post, always_call=True))

    # --- the schedule ------------------------------------------------------------------
    def begin(self, step):
        self.step, self.micro, self.calls = step, -1, collections.Counter()
        self.trained, self.untrained = False, 0
        self.weighed = set()
        self.steps.append((self.session, step))
        self.latest[step] = self.session

    def end(self):
        n = self.untrained
        if n and self.trained:                 # no-grad passes before a training pass: evaluation
            self.outside += n
            kept = []
            for c in self.caps:
                mine = (c["session"], c["step"]) == (self.session, self.step)
                if mine and c["kind"] != "weights":
                    if c["micro"] < n:
                        continue
                    c["micro"] -= n
                elif mine:
                    c["micro"] = max(c["micro"] - n, 0)
                kept.append(c)
            self.caps = kept
        if "weight_grads" in self.capture and not self.paused:
            for name, m in self.modules:
                for pname, p in m.named_parameters(recurse=False):
                    if p.grad is not None:
                        self._add("weight_grads", f"{self.label(name)}:{pname}", p.grad, self.step, 0)
        self.last = self.step
        self.step = None
        self._drop_leaf_hooks()

    def log(self, scalars: dict):
        """``rec.log``: for the open step, or after it ended the last one; a name
        logged twice keeps its last value, read as float64."""
        step = self.step if self.step is not None else self.last
        self.logged.setdefault((self.session, step), {}).update(
            {k: float(v) for k, v in scalars.items()})

    def resume(self):
        """The recorder was closed, and a new one opened on the store (``mode="a"``)."""
        assert self.step is None
        self.session += 1
        self.steps.append(None)

    def _drop_leaf_hooks(self):
        for h in self.leaf_handles:
            h.remove()
        self.leaf_handles = []

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # --- hooks ---------------------------------------------------------------------------
    @staticmethod
    def label(name):
        return name or "(root)"

    def _live(self):
        return self.step is not None and not self.paused and not self.evaluating

    def _root_pre(self, module, args):
        if self.paused or self.evaluating:
            return
        if self.step is None:
            self.outside += 1
            return
        if not torch.is_grad_enabled():
            if self.trained:                   # an evaluation pass inside the step
                self.evaluating = True
                self.outside += 1
                return
            self.untrained += 1                # a micro-batch unless a training pass follows
        else:
            self.trained = True
        self.micro += 1
        self.calls = collections.Counter()

    def _root_post(self, module, args, out):
        self.evaluating = False

    def _call_name(self, name, phase):
        k = self.calls[(phase, name)]
        self.calls[(phase, name)] += 1
        return self.label(name) + (f"#{k}" if k else "")

    def _pre(self, name):
        def hook(module, args, kwargs):
            if not self._live():
                return
            call = self._call_name(name, "pre")
            if "inputs" in self.capture:
                if len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs:
                    found = [("", args[0])]
                else:
                    found = list(leaves(list(args))) + list(leaves(dict(kwargs)))
                for path, t in found:
                    self._add("inputs", f"{call}:{path}" if path else call, t, self.step, self.micro)
            if "weights" in self.capture:
                for pname, p in module.named_parameters(recurse=False):
                    key = f"{self.label(name)}:{pname}"
                    if key not in self.weighed:
                        self.weighed.add(key)
                        self._add("weights", key, p, self.step, self.micro)
        return hook

    def _post(self, name):
        def hook(module, args, out):
            if not self._live():
                return
            call = self._call_name(name, "post")
            for path, t in leaves(out):
                full = f"{call}:{path}" if path else call
                if "activations" in self.capture:
                    self._add("activations", full, t, self.step, self.micro)
                step, micro, session = self.step, self.micro, self.session
                if "gradients" in self.capture and t.requires_grad and t.grad_fn is None:
                    if not torch.is_grad_enabled():     # a call without grad has no gradient
                        continue
                    seen = []                           # a leaf: once, this step

                    def once(g, full=full, step=step, micro=micro, session=session, seen=seen):
                        if not seen:
                            seen.append(1)
                            self._gradient(full, g, step, micro, session)
                    self.leaf_handles.append(t.register_hook(once))
                elif "gradients" in self.capture and t.requires_grad:
                    t.register_hook(lambda g, full=full, step=step, micro=micro, session=session:
                                    self._gradient(full, g, step, micro, session))
        return hook

    def _gradient(self, name, g, step, micro, session):
        if session != self.session:            # its recorder is closed: nobody's
            return
        if self.step != step:                  # after its step ended (or in another)
            self.dropped += 1
            return
        if self.paused:
            return
        self._add("gradients", name, g, step, micro)

    def _add(self, kind, name, t, step, micro):
        self.caps.append(dict(step=step, micro=micro, kind=kind, name=name,
                              tensor=t.detach().clone(), session=self.session,
                              seq=self.caps[-1]["seq"] + 1 if self.caps else 0))

    def close(self):
        for h in self.handles:
            h.remove()
        self._drop_leaf_hooks()

    # --- what the store must hold -----------------------------------------------------------
    def names(self):
        return list(dict.fromkeys(c["name"] for c in self.caps))

    def live(self):
        """The captures of each step's latest recording."""
        return [c for c in self.caps if self.latest[c["step"]] == c["session"]]

    def _of(self, step, kind, name):
        return [c for c in self.live() if (c["step"], c["kind"], c["name"]) == (step, kind, name)]

    def stat_names(self, kind):
        """The names with statistics of ``kind`` at some step, in any recording (a step
        recorded again keeps the layers of the older one, absent there)."""
        return {c["name"] for c in self.caps if c["kind"] == kind and c["step"] % self.stats_every == 0}

    def keys(self):
        """(step, kind, name) of every step's statistics (steps with statistics)."""
        return list(dict.fromkeys((c["step"], c["kind"], c["name"]) for c in self.live()
                                  if c["step"] % self.stats_every == 0))

    def parts(self, step, kind, name):
        """The tensors of a step's statistics (its micro-batches')."""
        return [c["tensor"] for c in self._of(step, kind, name)]

    def stats(self, step, kind, name):
        return statistics(self.parts(step, kind, name))

    def histogram(self, step, kind, name):
        parts = [c["tensor"] for c in self._of(step, kind, name) if c["tensor"].is_floating_point()]
        return histogram(np.concatenate([values(p) for p in parts])) if parts else None

    @staticmethod
    def _nonfinite(c):
        v = values(c["tensor"])
        if v is None:
            return (0, 0, 0)
        return (int(np.isnan(v).sum()), int((v == np.inf).sum()), int((v == -np.inf).sum()))

    def events(self):
        return [e[-1] for e in self.ordered_events()]

    def ordered_events(self):
        """The events, each as ``(step, backward, order, event)``: ``order`` is the
        capture's place among its step's captures (execution order, every kind),
        which orders the events of several ranks."""
        out, order = [], collections.Counter()
        for c in self.live():
            at = order[c["step"]]
            order[c["step"]] += 1
            bad = self._nonfinite(c)
            if any(bad):
                out.append((c["step"], c["kind"] in BACKWARD, at,
                            (c["step"], c["name"], c["kind"], c["micro"], *bad)))
        return sorted(out)

    def scalars(self):
        """step -> {name: value} of each step's latest recording (none: absent)."""
        return {step: values for (session, step), values in sorted(self.logged.items(),
                                                                   key=lambda kv: kv[0][1])
                if self.latest[step] == session}

    def due(self):
        """(kind, name, step, micro) of the full tensors ``tensors_every`` asks for, of
        each step's latest recording."""
        every = self.tensors_every
        return {(c["kind"], c["name"], c["step"], c["micro"]) for c in self.live()
                if every is not None and c["step"] % every == 0}

    def dumped(self):
        """(kind, name, step, micro) that a NaN/Inf dump stores, whatever the budget:
        the step's own full tensors and those of the ``ring`` steps before it in its
        recording (each step's latest recording)."""
        if self.on_nonfinite not in ("dump", "raise"):
            return set()
        bad = {(c["session"], c["step"]) for c in self.caps if any(self._nonfinite(c))}
        keep, before = set(), []
        for s in self.steps:
            if s is None:
                before = []
                continue
            if s in bad:
                keep.update([s, *(before[-self.ring:] if self.ring else [])])
            before.append(s)
        return {(c["kind"], c["name"], c["step"], c["micro"]) for c in self.live()
                if (c["session"], c["step"]) in keep}

    def tensors(self):
        """(kind, name, step, micro) -> tensor, of the steps whose full tensors are stored
        (each step's latest recording)."""
        return {key: t for key, t, live in self.written() if live}

    def written(self):
        """The full-tensor rows a store is handed, in the order it gets them, as
        ``(kind, name, step, micro), tensor, live`` (``live``: of its step's latest
        recording): a step's rows when it ends if persisted, or, when a step with a
        NaN/Inf dumps, the ring's steps first, then its own; within a step forward
        kinds before gradients, each in capture order."""
        bad_steps = {(c["session"], c["step"]) for c in self.caps if any(self._nonfinite(c))}
        order, ring = [], collections.deque(maxlen=self.ring or None)
        for s in self.steps:
            if s is None:                      # resumed: a new recorder's ring is empty
                ring = collections.deque(maxlen=self.ring or None)
                continue
            persist = self.tensors_every is not None and s[1] % self.tensors_every == 0
            dump = s in bad_steps and self.on_nonfinite in ("dump", "raise")
            if dump:
                order.extend(r for r in ring if r is not None)
                ring = collections.deque((None for _ in ring), maxlen=ring.maxlen)
            if persist or dump:
                order.append(s)
            if self.ring:
                ring.append(None if (persist or dump) else s)
        rank = {s: i for i, s in enumerate(order)}
        rows = sorted((c for c in self.caps if (c["session"], c["step"]) in rank),
                      key=lambda c: (rank[c["session"], c["step"]], c["kind"] in BACKWARD, c["seq"]))
        return [((c["kind"], c["name"], c["step"], c["micro"]), c["tensor"],
                 self.latest[c["step"]] == c["session"]) for c in rows]
