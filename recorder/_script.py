"""Record a training script that knows nothing of tensortape (``tensortape record``).

The script runs in this process (``runpy``), unchanged:

- **The model** is the outermost module of the first forward pass run with
  grad enabled.  ``torch.nn.Module.__call__`` is wrapped until then, so the
  recorder attaches before that call begins and records it like any later
  one (a global forward pre-hook runs after torch has read the module's own
  hooks: the root's would miss that call); torch's own ``__call__`` is put
  back as soon as the model is found.
- **A step** is one optimizer step (torch.optim's global step hooks): a step
  ends just before an optimizer steps, so ``weight_grads`` are still there,
  and the next begins at the model's next forward with grad enabled.  Forward
  passes without grad (evaluation) between them run outside any step: not
  recorded, only counted.
- The script's exit status and output are its own; the run is ``complete``
  when the script ends normally (or exits 0), else ``interrupted``.  Ctrl-C
  ends it as ``interrupted`` with status 130 and no traceback.
- ``python -m pkg.mod`` is found as python finds it: ``sys.path[0]`` is the
  current folder (the script's folder for ``python script.py``) while it runs.
- Before the script starts, the store is checked (its mode, and a probe write
  that leaves nothing behind); when it cannot record there, or later when a
  pattern matches nothing, it stops the script with one line
  (``RecorderError``; under ``errors.command_line()`` it names flags), unless ``keep_going`` lets
  the script train unrecorded after one warning line.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
import uuid

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from . import format as fmt
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
        self.torch_call = torch.nn.Module.__call__
        self.call = self._wrap(self.torch_call)
        torch.nn.Module.__call__ = self.call
        self.handles = [register_optimizer_step_pre_hook(self._before_optimizer),
                        register_optimizer_step_post_hook(self._after_optimizer)]

    # --- finding the model ---------------------------------------------------------
    def _wrap(self, torch_call):
        """``Module.__call__`` until the model is found: the outermost call with grad
        enabled attaches the recorder, then runs with every hook in place."""
        def __call__(module, *args, **kwargs):
            if torch.compiler.is_compiling():        # a compiled region: torch's own call
                return torch_call(module, *args, **kwargs)
            if self.depth == 0 and torch.is_grad_enabled() and self.looking:
                self._found(module)
            self.depth += 1
            try:
                return torch_call(module, *args, **kwargs)
            finally:
                self.depth -= 1
        return __call__

    @property
    def looking(self) -> bool:
        return torch.nn.Module.__call__ is self.call

    def _stop_looking(self) -> None:
        if self.looking:                              # else someone patched it after us
            torch.nn.Module.__call__ = self.torch_call

    def _found(self, module) -> None:
        self._stop_looking()
        try:
            self.recorder = Recorder(module, self.store, **self.kwargs).attach()
        except RecorderError as e:
            if not self.keep_going:
                raise _Stop(e) from None
            print(f"tensortape: not recording: {e}", file=sys.stderr)  # trains on
            return
        module.register_forward_pre_hook(self._model_forward, prepend=True)
        self.scope = self.recorder.step(self.step)

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
        self._stop_looking()
        for h in self.handles:
            h.remove()
        if self.recorder is not None:
            self.recorder.close("complete" if ok else "interrupted")


def _probe(location) -> None:
    """Raise ``ConfigError`` now if the run cannot be written at ``location``: create
    its folder as the recorder would and write a file there the way zarr does (a
    ``.partial`` a killed start leaves is cleared by the recorder), then remove
    what was created, and nothing else."""
    location = os.fspath(location)
    name = f"zarr.{uuid.uuid4().hex}.partial"
    try:
        if fmt.is_url(location):
            import fsspec
            fs, root = fsspec.core.url_to_fs(location)
            probe = f"{root.rstrip('/')}/{name}"
            fs.pipe_file(probe, b"")
            fs.rm_file(probe)
            return
        made, folder = [], os.path.abspath(location)
        while not os.path.lexists(folder):
            made.append(folder)
            folder = os.path.dirname(folder)
        try:
            os.makedirs(location, exist_ok=True)
            probe = os.path.join(location, name)
            with open(probe, "xb"):
                pass
            os.remove(probe)
        finally:
            for folder in made:                       # the deepest first; only if empty
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
    except OSError as e:
        raise ConfigError(f"cannot write the run at {location!r} "
                          f"({e.strerror or type(e).__name__}); choose a path you can write, "
                          f"e.g. a new folder under your home") from None


def _find_module(target: str) -> None:
    import importlib.util
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(f"no module {target!r} to run with -m; check its name and run "
                          f"tensortape from the folder python -m would run it from")


def run_script(command: list[str], store, keep_going: bool = False, **recorder_kwargs) -> int:
    """Run ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) here, recording its
    model into ``store``; returns the script's exit status (130 after Ctrl-C).

    Raises ``RecorderError`` (one line, in the CLI's words) when the script is
    missing, or when it cannot be recorded and ``keep_going`` is false."""
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
    recording = True
    try:
        check_mode(store, recorder_kwargs.get("mode", "w-"))
        _probe(store)
    except RecorderError as e:
        if not keep_going:
            raise type(e)(f"{e}; the script was not started (pass --keep-going "
                          f"to let it train unrecorded)") from None
        print(f"tensortape: not recording: {e}", file=sys.stderr)
        recording = False
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    # sys.path[0] as python sets it: the current folder for -m, else the script's folder
    sys.path.insert(0, os.getcwd() if as_module else os.path.dirname(os.path.abspath(target)))
    sys.argv = [target, *args]
    status, stopped, tracker = 0, None, None
    try:
        if as_module:
            _find_module(target)
        tracker = _Tracker(store, recorder_kwargs, keep_going) if recording else None
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
        raise type(stopped)(f"{stopped}; the script was stopped (pass --keep-going "
                            f"to let it train unrecorded)") from None
    return status
