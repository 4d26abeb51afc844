"""The one place where hooks are registered on a model, and removed.

A ``HookSet`` turns module calls into named captures and hands each one to a
sink (``_step.StepBuffer``, or the Inspector): ``sink.add(kind, name, tensor,
token)``.  ``sink.current_token()`` identifies the step a capture belongs to;
gradients carry the token of the forward that produced them.  Hooks hold only weak references, act only on the modules
they were attached to (so a ``deepcopy`` of the model records nothing), and
run eagerly under ``torch.compile``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from .format import join, label
from ._naming import input_leaves, leaves
from ._selection import module_table

__all__ = ["HookSet"]

class Sink(Protocol):
    def add(self, kind: str, name: str, tensor: torch.Tensor, token: object) -> None: ...

    def current_token(self) -> object: ...


class HookSet:
    def __init__(self, model: nn.Module, names: list[str], kinds: tuple[str, ...], sink: Sink):
        table = module_table(model)
        self._modules = [(n, table[n]) for n in names]
        self._kinds = set(kinds)
        self._sink = sink
        self._handles: list = []
        self._calls: dict[tuple[str, str], int] = {}

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        me = weakref.ref(self)
        want_pre = self._kinds & {"inputs", "weights"}
        want_post = self._kinds & {"activations", "gradients"}
        for name, module in self._modules:
            target = weakref.ref(module)
            if want_pre:
                self._handles.append(module.register_forward_pre_hook(
                    _pre_hook(me, target, name), with_kwargs=True))
            if want_post:
                self._handles.append(module.register_forward_hook(_post_hook(me, target, name)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_step(self) -> None:
        self._calls.clear()

    def weight_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``module:param`` and ``.grad`` of every hooked module's own parameters."""
        for name, module in self._modules:
            for pname, p in module.named_parameters(recurse=False):
                if p.grad is not None:
                    yield f"{label(name)}:{pname}", p.grad

    # --- called from the hooks ------------------------------------------------
    def _call_index(self, what: str, name: str) -> int:
        k = self._calls.get((what, name), 0)
        self._calls[(what, name)] = k + 1
        return k

    def _base(self, what: str, name: str) -> tuple[str, int]:
        k = self._call_index(what, name)
        return (label(name) + (f"#{k}" if k else "")), k

    def _pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        token = self._sink.current_token()
        base, k = self._base("pre", name)
        if "inputs" in self._kinds:
            for path, t in input_leaves(args, kwargs):
                self._sink.add("inputs", join(base, path), t, token)
        if "weights" in self._kinds and k == 0:
            for pname, p in module.named_parameters(recurse=False):
                self._sink.add("weights", f"{label(name)}:{pname}", p, token)

    def _post(self, name: str, output) -> None:
        token = self._sink.current_token()
        base, _ = self._base("post", name)
        for path, t in leaves(output):
            full = join(base, path)
            if "activations" in self._kinds:
                self._sink.add("activations", full, t, token)
            if "gradients" in self._kinds and t.requires_grad:
                t.register_hook(_grad_hook(weakref.ref(self), full, token))


def _pre_hook(me: weakref.ref, target: weakref.ref, name: str):
    @torch.compiler.disable
    def hook(module, args, kwargs):
        hs = me()
        if hs is not None and module is target():
            hs._pre(name, module, args, kwargs)
    return hook


def _post_hook(me: weakref.ref, target: weakref.ref, name: str):
    @torch.compiler.disable
    def hook(module, args, output):
        hs = me()
        if hs is not None and module is target():
            hs._post(name, output)
    return hook


def _grad_hook(me: weakref.ref, name: str, token: object):
    def hook(grad):
        hs = me()
        if hs is not None:
            hs._sink.add("gradients", name, grad, token)
    return hook
