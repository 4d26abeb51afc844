"""A replay never runs a collective.

A replay runs one call again on this rank alone: a collective there would wait
for ranks that are not running it.  So a producer that is, or holds, an
FSDP-sharded module, a DDP wrapper, DTensor parameters or a forward hook of
``torch.distributed``'s is not replayed (``collectives`` says why), and a
dispatch mode (``NoCollective``) refuses any collective op during a replay,
before it starts.  The replay's thread (the training thread, or the reader's).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collective", "NoCollective", "collectives", "not_replayed"]

_COLLECTIVE_NS = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def _distributed(fn) -> bool:
    """``fn`` (a hook: function, bound method, partial) is torch.distributed's."""
    for _ in range(4):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None)
        if inner is None:
            break
        fn = inner
    return (getattr(fn, "__module__", None) or "").startswith("torch.distributed")


def collectives(module: torch.nn.Module) -> str | None:
    """Why calling ``module`` would (or may) run a collective on this rank alone, or
    None: it or a descendant is sharded by FSDP (FSDP2's ``fully_shard``, whose
    pre-forward hooks all-gather, or FSDP1), wrapped in DDP, holds DTensor
    parameters or buffers (their ops redistribute), or carries a forward hook of
    ``torch.distributed``'s."""
    if not torch.distributed.is_available():
        return None
    kinds = []
    try:
        from torch.distributed.fsdp import FSDPModule
        kinds.append((FSDPModule, "it is sharded by FSDP (fully_shard): its pre-forward hooks "
                                  "all-gather the parameters"))
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        kinds.append((FullyShardedDataParallel, "it is wrapped in FSDP: its forward all-gathers"))
    except ImportError:
        pass
    kinds.append((torch.nn.parallel.DistributedDataParallel,
                  "it is wrapped in DDP: its forward may broadcast buffers"))
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        DTensor = ()
    glob = torch.nn.modules.module
    for hooks in (glob._global_forward_pre_hooks, glob._global_forward_hooks):
        if any(_distributed(h) for h in hooks.values()):
            return "a global forward hook of torch.distributed's is registered"
    for name, m in module.named_modules():
        who = f"{name!r} in it" if name else "the module"
        for cls, why in kinds:
            if isinstance(m, cls):
                return f"{who}: {why}"
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for h in hooks.values():
                if _distributed(h):
                    hook = f"{getattr(h, '__qualname__', h)!s:.80}"
                    return f"{who}: a forward hook of torch.distributed's ({hook}) may run a collective"
        if DTensor and any(isinstance(t, DTensor) for t in
                           (*m.parameters(recurse=False), *m.buffers(recurse=False))):
            return f"{who}: its DTensor parameters' ops redistribute across the ranks"
    return None


class Collective(Exception):
    pass


class NoCollective(TorchDispatchMode):
    """The guard: a collective op (c10d, functional collectives) during a replay is
    refused before it starts, so no rank waits on this one."""

    def __init__(self):
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COLLECTIVE_NS:
            self.op = func.name()
            raise Collective(self.op)
        return func(*args, **(kwargs or {}))


def not_replayed(why: str, refused: bool = False) -> dict:
    said = (f"stopped before {why}: a replay never runs a collective" if refused else
            f"its call would run a collective ({why})")
    return {"op": None, "collective": why,
            "note": f"not replayed: {said}; a replay on one rank alone would desynchronise "
                    f"the ranks"}

