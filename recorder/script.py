"""Record a training script that knows nothing of tensortape (``tensortape record``):
``run_script`` (its internals are ``_tracker``'s).

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
  recorded, only counted.  Steps are numbered from ``start_step``, else from 0,
  or under ``mode="a"`` from the step after the store's last (a resumed job
  continues the run).
- **The loss**: the 0-dim tensors ``backward()`` is called on inside a step
  (``torch.Tensor.backward``, wrapped while recording) are summed (float64, on
  their device) and logged as ``loss`` (``rec.log``: read at the step's end, no
  sync): with gradient accumulation, the sum over the step's micro-batches.
- The script's exit status and output are its own; the run is ``complete``
  when the script ends normally (or exits 0), else ``interrupted``.  Ctrl-C
  ends it as ``interrupted`` with status 130 and no traceback; SIGTERM closes
  the run as ``interrupted`` and ends the process by SIGTERM, as it would
  python's (``_exit``: a SIGTERM handler of the script's own decides instead).
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

from ._tracker import Stop, Tracker, find_module, probe
from ._config import RecorderConfig
from .claim._root import check_mode
from .errors import ConfigError, RecorderError, argument

__all__ = ["run_script"]


def run_script(command: list[str], store, keep_going: bool = False,
               start_step: int | None = None, **recorder_kwargs) -> int:
    """Run ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) here, recording its
    model into ``store``; returns the script's exit status (130 after Ctrl-C).
    ``start_step``: the first step's number (None: 0, or the step after the store's
    last under ``mode="a"``).

    Raises ``RecorderError`` (one line, in the CLI's words) when the script is
    missing, or when it cannot be recorded and ``keep_going`` is false."""
    if start_step is not None and (type(start_step) is not int or start_step < 0):
        raise ConfigError(f"{argument('start_step', start_step)} is not valid; use an "
                          f"integer >= 0")
    RecorderConfig.check(recorder_kwargs)              # settings that conflict: one line first
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
        probe(store)
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
            find_module(target)
        tracker = Tracker(store, recorder_kwargs, keep_going, start_step) if recording else None
        try:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except Stop as e:
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
