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

import numpy as np
import torch

STATS = ("count", "mean", "std", "min", "max", "abs_max", "norm", "zero_frac", "nan", "posinf",
         "neginf")
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


def histogram(values: np.ndarray) -> np.ndarray:
    """Counts of finite float64 values in the documented bins: [lo, hi) above zero,
    (lo, hi] below it, exact zeros (either sign) in the zero bin."""
    lo, hi = bin_edges()
    v = values[np.isfinite(values)]
    zero = len(lo) // 2
    idx = np.where(v > 0, np.searchsorted(lo, v, side="right") - 1,
                   np.searchsorted(hi, v, side="left"))
    idx = np.where(v == 0, zero, idx)
    return np.bincount(idx, minlength=len(lo))


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
        self.step = None
        self._drop_leaf_hooks()

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

    def stats(self, step, kind, name):
        return statistics([c["tensor"] for c in self._of(step, kind, name)])

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
        out = []
        for c in self.live():
            bad = self._nonfinite(c)
            if any(bad):
                out.append((c["step"], c["kind"] in BACKWARD, c["seq"],
                            (c["step"], c["name"], c["kind"], c["micro"], *bad)))
        return [e[-1] for e in sorted(out)]

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
