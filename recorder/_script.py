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
  when the script ends normally (or exits 0), else ``interrupted``.  Ctrl-C
  ends it as ``interrupted`` with status 130 and no traceback.
- When it cannot record (the store exists, a pattern matches nothing), it
  stops the script with one line (``RecorderError``), unless ``keep_going``
  lets the script train unrecorded.
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
from ._store import check_mode
from .errors import ConfigError, RecorderError

__all__ = ["run_script"]


class _Stop(BaseException):
    """Raised through the script when it cannot be recorded (not an Exception:
    the script's own ``except Exception`` does not swallow it)."""

    def __init__(self, error: RecorderError):
        super().__init__(str(error))
        self.error = error


class _Tracker:
    """Finds the model, then turns optimizer steps into recorder steps."""

    def __init__(self, store, kwargs: dict, keep_going: bool):
        self.store, self.kwargs = store, {"outside_step": "ignore", **kwargs}
        self.keep_going = keep_going
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
            except RecorderError as e:
                if not self.keep_going:
                    raise _Stop(e) from None
                print(f"tensortape: not recording: {e}", file=sys.stderr)   # trains on
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


def run_script(command: list[str], store, keep_going: bool = False, **recorder_kwargs) -> int:
    """Run ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) here, recording its
    model into ``store``; returns the script's exit status (130 after Ctrl-C).

    Raises ``RecorderError`` (one line) when the script is missing, or when it
    cannot be recorded and ``keep_going`` is false."""
    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]
    if not command:
        raise ConfigError("no script to run; give it after --, e.g. -- python train.py")
    as_module = command[0] == "-m"
    if as_module:
        command = command[1:]
        if not command:
            raise ConfigError("no module after -m; e.g. -- python -m mypackage.train")
    target, args = command[0], command[1:]
    if not as_module and not os.path.isfile(target):
        raise ConfigError(f"no script {target!r}; check the path after --")
    if as_module:
        import importlib.util
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"no module {target!r} to run with -m; check its name")
    recording = True
    try:
        check_mode(store, recorder_kwargs.get("mode", "w-"))
    except RecorderError as e:
        if not keep_going:
            raise
        print(f"tensortape: not recording: {e}", file=sys.stderr)
        recording = False
    tracker = _Tracker(store, recorder_kwargs, keep_going) if recording else None
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target, *args]
    if not as_module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    status, stopped = 0, None
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except _Stop as e:
        stopped = e.error
    except KeyboardInterrupt:
        print("tensortape: interrupted (Ctrl-C); the run is closed as 'interrupted'",
              file=sys.stderr)
        status = 130
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if tracker is not None:
            tracker.close(ok=status == 0 and stopped is None)
    if stopped is not None:
        raise type(stopped)(f"{stopped}; the script was stopped (pass --keep-going to let it "
                            f"train unrecorded)") from None
    return status
