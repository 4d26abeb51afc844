"""The gradients a ``HookSet`` expects: one *serial* per captured output whose
gradient will come, and what that gradient is (step, name, micro-batch).

A serial is a positive int, given at the output's capture (``expect``); the
output's gradient hook carries it, whenever and on whichever thread the
gradient arrives (``lookup``).  The serials of the step before the open one are
kept too: a gradient that comes late (its step ended) is then named, and
dropped as late.  An older one is of a step that is gone (``GONE``).

Serials are given on the training thread (the forward hooks) and looked up on
autograd's threads too: the ledger's dicts are only replaced at a new step,
never cleared in place, and a lookup reads each of them once.

**Compiled recomputation.**  Each capture traced by Dynamo has a *site*
(``_ops._site``); a compiled backward graph that recomputes a checkpointed
region runs the same capture again, and ``of_site`` finds the forward capture
it repeats (see ``_recompute``).

**Leaf outputs.**  A module whose output is a leaf (``return self.pe``: a
parameter, a buffer, an input that requires grad) hands the hook a tensor that
outlives the forward pass, so a gradient hook on it would stay for good.  Such
a hook (``hold_leaf``) is registered only for a recorded call, acts once (the
gradient of that call's backward: ``_Once``), and is removed when its step
ends (``end_step``), at the next step and at ``detach``.
"""

from __future__ import annotations

import torch

from . import _ops

__all__ = ["GONE", "BackwardProbe", "Expected", "GradientLedger"]


class _Gone:
    """The type of ``GONE``: the token of a step whose serials are forgotten, never
    the open step's (a sink drops its tensors as late)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "GONE"


GONE = _Gone()


# An expected gradient: the step (its token), name and micro-batch of the forward
# call whose output it is, and the capture's site (0: eager).  A plain tuple, not a
# NamedTuple: one is made per capture, and a NamedTuple costs 250 ns more.
Expected = tuple[object, str, int, int]
_SITE = 3
_UNKNOWN: Expected = (None, "?", 0, 0)                          # never given: not recorded
_EARLIER: Expected = (GONE, "an output of an earlier step", 0, 0)


class GradientLedger:
    """The serials given in the open step and in the step before, by serial and,
    for compiled captures, by site."""

    def __init__(self):
        self.serial = 0                                 # the last serial given
        self._serials: dict[int, Expected] = {}         # given in this step
        self._older: dict[int, Expected] = {}           # given in the step before
        self._by_site: dict[int, list[int]] = {}        # site -> serials not recomputed yet
        self._indexed = 0                               # the last serial in _by_site
        self._leaf_handles: list = []                   # gradient hooks on leaf outputs

    def expect(self, token: object, name: str, micro: int, site: int = 0) -> int:
        """A new serial, for the gradient of an output captured now."""
        self.serial += 1
        self._serials[self.serial] = (token, name, micro, site)
        return self.serial

    def lookup(self, serial: int) -> Expected:
        """What the gradient whose output's capture had ``serial`` is: ``token`` None
        if no serial was given (not recorded), ``GONE`` if its step is gone."""
        found = self._serials.get(serial) or self._older.get(serial)
        if found is not None:
            return found
        return _EARLIER if serial > 0 else _UNKNOWN

    def new_step(self) -> None:
        """A step begins: this step's serials become the step before's."""
        self.end_step()
        self._older, self._serials = self._serials, {}
        self._by_site, self._indexed = {}, self.serial

    def of_site(self, site: int) -> int | None:
        """The serial of the forward capture that a compiled recomputation with
        ``site`` repeats: the latest of this step not taken yet, else the step
        before's latest (a late gradient), else None (not recorded)."""
        for s in range(self._indexed + 1, self.serial + 1):     # index the new ones
            found = self._serials.get(s)
            if found is not None and found[_SITE]:
                self._by_site.setdefault(found[_SITE], []).append(s)
        self._indexed = self.serial
        latest = self._by_site.get(site)
        if latest:
            return latest.pop()
        for s, found in reversed(self._older.items()):
            if found[_SITE] == site:
                return s
        return None

    # --- leaf outputs ---------------------------------------------------------------
    def hold_leaf(self, t: torch.Tensor, serial: int, hookset: int) -> None:
        """A gradient hook on the leaf output ``t`` of a recorded call: it hands the
        first gradient after the call to HookSet ``hookset``, and goes at the step's end."""
        self._leaf_handles.append(t.register_hook(_Once(serial, hookset)))

    def end_step(self) -> None:
        """The step ended: the gradient hooks on leaf outputs go (a parameter keeps
        no hook of tensortape's between steps)."""
        handles, self._leaf_handles = self._leaf_handles, []
        for h in handles:
            h.remove()


class BackwardProbe:
    """Whether a gradient reached ``model``'s first parameter since ``reset``."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._state: tuple | None = None

    def reset(self) -> None:
        self._state = self._grad_state()

    def ran(self) -> bool:
        return self._state is not None and self._grad_state() != self._state

    def _grad_state(self) -> tuple:
        p = next(self._model.parameters(), None)
        g = None if p is None else p.grad
        return ("grad", None) if g is None else ("grad", id(g), g._version)


class _Once:
    """A leaf output's gradient hook: the first gradient after its call is that
    call's; later ones (another micro-batch's backward) are not."""

    __slots__ = ("serial", "hookset", "done")

    def __init__(self, serial: int, hookset: int):
        self.serial, self.hookset, self.done = serial, hookset, False

    def __call__(self, grad):
        if self.done:
            return None
        self.done = True
        hs = _ops.hookset(self.hookset)
        if hs is not None:
            hs.on_gradient(self.serial, grad)
        return None
