"""Record a training script that knows nothing of tensortape (``tensortape record``).

The script runs in this process (``runpy``), unchanged:

- **The model** is the outermost module of the first forward pass run with
  grad enabled (a global module pre-hook finds it, then is removed).
- **A step** is one optimizer step (torch.optim's global step hooks): a step
  ends just before an optimizer steps, so ``weight_grads`` are still there,
  and the next begins at the model's next forward with grad enabled.  Forward
  passes without grad (evaluation) between them run outside any step: not
  recorded, only counted.
- The script's exit status and output are its own; the run is ``complete``
  when the script ends normally (or exits 0), else ``interrupted``.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ._recorder import Recorder
from .errors import RecorderError

__all__ = ["run_script"]


class _Tracker:
    """Finds the model, then turns optimizer steps into recorder steps."""

    def __init__(self, store, kwargs: dict):
        self.store, self.kwargs = store, {"outside_step": "ignore", **kwargs}
        self.recorder: Recorder | None = None
        self.scope = None
        self.step = 0
        self.next_pending = False
        self.depth = 0
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
            register_optimizer_step_pre_hook(self._before_optimizer),
            register_optimizer_step_post_hook(self._after_optimizer),
        ]

    # --- finding the model ---------------------------------------------------------
    def _enter(self, module, args):
        self.depth += 1
        if self.recorder is None and self.depth == 1 and torch.is_grad_enabled():
            self.handles[0].remove()
            self.handles[1].remove()
            try:
                self.recorder = Recorder(module, self.store, **self.kwargs).attach()
            except RecorderError as e:       # the script trains on, unrecorded
                print(f"tensortape: not recording: {e}", file=sys.stderr)
                return
            module.register_forward_pre_hook(self._model_forward, prepend=True)
            self.scope = self.recorder.step(self.step)

    def _leave(self, module, args, output):
        self.depth -= 1

    # --- steps ---------------------------------------------------------------------------
    @torch.compiler.disable
    def _model_forward(self, module, args):
        if self.next_pending and torch.is_grad_enabled():
            self.next_pending = False
            self.scope = self.recorder.step(self.step)

    def _before_optimizer(self, optimizer, args, kwargs):
        if self.scope is not None:
            scope, self.scope = self.scope, None
            scope.__exit__(None, None, None)
            self.step += 1

    def _after_optimizer(self, optimizer, args, kwargs):
        if self.recorder is not None and self.scope is None:
            self.next_pending = True

    def close(self, ok: bool) -> None:
        for h in self.handles:
            h.remove()
        if self.recorder is not None:
            self.recorder.close("complete" if ok else "interrupted")


def run_script(command: list[str], store, **recorder_kwargs) -> int:
    """Run ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) here, recording its
    model into ``store``; returns the script's exit status."""
    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]
    if not command:
        raise ValueError("no script to run; give it after --, e.g. -- python train.py")
    as_module = command[0] == "-m"
    if as_module:
        command = command[1:]
    target, args = command[0], command[1:]
    tracker = _Tracker(store, recorder_kwargs)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target, *args]
    if not as_module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    status = 0
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        tracker.close(ok=status == 0)
    return status
