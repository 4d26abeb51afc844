"""Dynamo glue: compiled code sees the hooks a ``HookSet`` attaches.

Runs on the thread that attaches and detaches (the user's).

Dynamo does not guard on module hooks by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``), so code compiled before
the hooks were attached (for this model, or for another instance of its
class) would run on without them.  While any ``HookSet`` is attached in this
process, that setting is False: the first attach sets it (remembering the
value it had) and the last detach puts the value back (a process-wide count,
under a reentrant lock: a recorder's finaliser may detach at any point).
Code compiled meanwhile guards on the hooks (a length check per hooks dict),
so it recompiles once they are removed.
"""

from __future__ import annotations

import threading

from torch import nn

from . import _ops
from ..quiet import quiet, warn

__all__ = ["HookGuards"]

_lock = threading.RLock()    # a finaliser may detach while this thread attaches
_holders = 0                 # HookGuards held in this process
_saved: object = None        # the setting before the first of them
_deferred: list = []         # released by a finaliser while another thread held _lock


def _settle() -> None:
    """Under ``_lock``: the releases a finaliser deferred, done now."""
    while _deferred:
        _deferred.pop()._release()


def _compiled_frames(model: nn.Module) -> set:
    """The code objects whose compiled code may run ``model``: the ``forward`` of
    every module class in it (the root included), the frames a ``torch.compile``
    wrapper compiles (Dynamo's wrapper of the module's call, shared by every
    compiled module), and ``Module._call_impl`` when a module was compiled in
    place (``module.compile()``)."""
    codes = set()
    for m in model.modules():
        codes.add(getattr(type(m).forward, "__code__", None))
        f = m.__dict__.get("forward")              # a torch.compile wrapper's own forward
        while f is not None:
            codes.add(getattr(f, "__code__", None))
            f = getattr(f, "__wrapped__", None)
        if getattr(m, "_compiled_call_impl", None) is not None:
            codes.add(nn.Module._call_impl.__code__)
    codes.discard(None)
    return codes


def _eager_roots() -> None:
    """Dynamo never compiles ``_ops.EAGER_ROOTS`` as frames of their own, nor what they
    call (a torch without exec strategies compiles them as before: slower, never wrong)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
        skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        for code in _ops.EAGER_ROOTS:
            set_code_exec_strategy(code, skip)
    except Exception:       # (ImportError, or an API that changed): not needed to record
        return


class HookGuards:
    """Compiled code guards on module hooks while this is held: ``see_hooks`` the
    model just hooked, ``release`` (once; again is a no-op) when its hooks are gone."""

    def __init__(self):
        self._held = False

    def see_hooks(self, model: nn.Module) -> None:
        """Make compiled code see the hooks just attached to ``model`` (and later
        removed): hook guards on, and the compiled code of every frame that can
        run this model (``_compiled_frames``) dropped, so the model recompiles
        once, with its hooks.  A frame shared with other compiled models
        (Dynamo's wrapper) makes them recompile once too."""
        global _holders, _saved
        try:
            with quiet():          # importing Dynamo may warn: torch's news, not the user's
                import torch._dynamo
                import torch._dynamo.external_utils
                from torch._C._dynamo.eval_frame import reset_code
            _ops.EAGER_GRAD_HOOKS = hasattr(torch._dynamo.external_utils, "_ApplyBackwardHook")
            _eager_roots()
            config = torch._dynamo.config
            with _lock:
                _settle()
                if not self._held:
                    if _holders == 0:
                        _saved = config.skip_nnmodule_hook_guards
                    _holders += 1
                    self._held = True
                config.skip_nnmodule_hook_guards = False
        except Exception as e:  # no Dynamo here: nothing can be compiled
            warn(f"tensortape: cannot make compiled code see the hooks ({e})")
            return
        for code in _compiled_frames(model):
            reset_code(code)

    def release(self, wait: bool = True) -> None:
        """The hooks are gone: the last holder in the process puts the setting back.
        ``wait=False`` (a finaliser, which must never wait for a lock): when another
        thread holds the lock, the release is deferred to its next holder."""
        if not _lock.acquire(blocking=wait):
            _deferred.append(self)              # list.append: atomic, takes no lock
            return
        try:
            self._release()
            _settle()
        finally:
            _lock.release()

    def _release(self) -> None:
        global _holders
        if not self._held:
            return
        self._held = False
        _holders -= 1
        if _holders == 0:
            import torch._dynamo
            torch._dynamo.config.skip_nnmodule_hook_guards = _saved
