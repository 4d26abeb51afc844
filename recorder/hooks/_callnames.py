"""The names of module calls: ``name`` for a module's first call in a forward
pass, ``name#k`` for its k-th after that, and the root module's label.

Runs on the training thread (the forward hooks), like the ``HookSet`` that owns
a ``CallNamer``.  A call is counted once per phase, since a module's pre-hook
(its inputs and weights), its forward hook (its outputs) and the keeper
(``on_nonfinite="replay"``) each see every call; each counts afresh at every
forward pass (``new_pass``).
"""

from __future__ import annotations

import enum
import re

from ..format import ROOT_LABEL

__all__ = ["CallNamer", "Phase", "split_call"]

_NUMBERED = re.compile(r"(.*)#([1-9][0-9]*)")


class Phase(enum.IntEnum):
    """Which hook sees a call (an ``IntEnum``: a dict key hashed in C)."""

    PRE = 0         # before the forward: inputs and weights
    POST = 1        # after it: outputs (activations, and the gradients' hooks)
    KEEP = 2        # the keeper's hooks (on_nonfinite="replay")


class CallNamer:
    """Counts each module's calls in the current forward pass, per phase, and
    names them; ``root`` is the root module's label (``format.label``)."""

    __slots__ = ("root", "_calls", "_names")

    def __init__(self, root: str):
        self.root = root
        self._calls: dict[tuple[Phase, str], int] = {}      # calls in this forward pass
        self._names: dict[tuple[Phase, str], str] = {}      # the latest call's name

    def label(self, module: str) -> str:
        """The recorded name of ``module`` (``""``: the root)."""
        return module or self.root

    def call(self, phase: Phase, module: str) -> str:
        """A new call of ``module`` begins (as ``phase`` sees it): its name."""
        key = (phase, module)
        k = self._calls.get(key, 0)
        self._calls[key] = k + 1
        name = self._names[key] = (module or self.root) + (f"#{k}" if k else "")
        return name

    def current(self, phase: Phase, module: str) -> str:
        """The name of ``module``'s current call (as ``phase`` sees it)."""
        return self._names[(phase, module)]

    def name(self, phase: Phase, module: str, path: str, first: bool) -> str:
        """The recorded name of the leaf at ``path`` in ``module``'s current call;
        ``first``: the first leaf of a new call (``call``).  The hot path: one
        call per capture, ``format.join`` inline."""
        base = self.call(phase, module) if first else self._names[(phase, module)]
        return f"{base}:{path}" if path else base

    def new_pass(self) -> None:
        """A new forward pass: its calls are counted from the first."""
        self._calls.clear()


def split_call(name: str, root: str = ROOT_LABEL) -> tuple[str, int]:
    """The module (``""``: the root, labelled ``root``) and call index ``k`` of a
    call name as ``CallNamer.call`` makes it: ``"blocks.0#2"`` -> ``("blocks.0", 2)``."""
    m = _NUMBERED.fullmatch(name)
    base, k = (m.group(1), int(m.group(2))) if m else (name, 0)
    return ("" if base == root else base), k
