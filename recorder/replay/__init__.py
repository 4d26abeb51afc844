"""Replay a stored bundle offline: the torch side of ``Run.replay`` and
``tensortape replay``.

Under ``on_nonfinite="replay"`` the recorder stores the producer call of a
step's first NaN/Inf as a *bundle* (``format.replay_group``): its inputs,
parameters, buffers and output gradients as arrays, its structure, RNG and
autocast state as JSON.  ``replay_bundle`` builds that call again in a model
the user builds (the same architecture) and runs it under the recorder's own
op check (``_replayer``; the bundle is ``_bundle``'s), so the answer is the one the
recording gave.

The reader hands the bundle over as plain JSON and numpy (``read``), so the
torch-free reader (``analysis``) never imports the recorder's private modules,
and this module never reads a store.

Runs on the caller's thread (``Run.replay``, ``tensortape replay``); it starts none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from .. import format as fmt

__all__ = ["replay_bundle"]


def replay_bundle(attrs: dict, read: Callable[[str], tuple[np.ndarray, str | None]],
                  model) -> dict:
    """Repeat a stored replay in ``model`` (an ``nn.Module`` of the recorded
    architecture): its submodule at the bundle's path gets the recorded
    parameters and buffers, and the call runs again on the recorded inputs (and
    output gradients, for a NaN made in backward) under the same op check.

    attrs: the bundle group's attributes.  read(name): the bundle's array
    ``name`` (``input_0``, ``param_weight``, ...) as numpy, with its logical
    dtype (``format.LOGICAL_ATTR``: bfloat16 and float8 stored as their bits),
    or None.  Returns what the replay found, as the event's ``replay`` dict."""
    import torch

    from . import _bundle, _replayer

    def tensor(name: str) -> torch.Tensor:
        data, logical = read(name)
        t = torch.from_numpy(np.array(data, copy=True))
        return t.view(getattr(torch, logical)) if logical in fmt.BITS_DTYPES else t
    call = _bundle.from_bundle(attrs, tensor, model)
    return _replayer.replay(call, contextlib.nullcontext, backward=attrs.get("phase") == "backward")
