"""The internals of ``tensortape record`` (``script.run_script``, which says what
it does): the ``Tracker`` that finds the model and turns optimizer steps into
recorder steps, and the probe of the store before the script starts.

Training thread (the script's own).
"""

from __future__ import annotations

import os
import sys
import uuid

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from . import format as fmt
from ._recorder import Recorder
from .errors import ConfigError, RecorderError

__all__ = ["Stop", "Tracker", "find_module", "probe"]


class Stop(BaseException):
    """Raised through the script when it cannot be recorded (not an Exception:
    the script's own ``except Exception`` does not swallow it)."""

    def __init__(self, error: RecorderError):
        super().__init__(str(error))
        self.error = error


class Tracker:
    """Finds the model, then turns optimizer steps into recorder steps."""

    def __init__(self, store, kwargs: dict, keep_going: bool, start_step: int | None = None):
        self.store, self.kwargs = store, {"outside_step": "ignore", **kwargs}
        self.keep_going = keep_going
        self.recorder: Recorder | None = None
        self.scope = None
        self.first = start_step     # the first step's number; None: the recorder's next
        self.loss = None            # the open step's: the sum of what backward() was called on
        self.next_pending = False
        self.depth = 0
        self.torch_call = torch.nn.Module.__call__
        self.call = self._wrap(self.torch_call)
        torch.nn.Module.__call__ = self.call
        self.handles = [register_optimizer_step_pre_hook(self._before_optimizer),
                        register_optimizer_step_post_hook(self._after_optimizer)]
        self.torch_backward = torch.Tensor.backward
        self.backward = self._wrap_backward(self.torch_backward)
        torch.Tensor.backward = self.backward

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
                raise Stop(e) from None
            print(f"tensortape: not recording: {e}", file=sys.stderr)  # trains on
            return
        module.register_forward_pre_hook(self._model_forward, prepend=True)
        self._begin()

    # --- steps ---------------------------------------------------------------------------
    def _begin(self) -> None:
        """A step begins: ``start_step`` first, then each the one after the last (the
        first is 0, or under ``mode="a"`` the one after the store's last)."""
        self.scope, self.first, self.loss = self.recorder.step(self.first), None, None

    @torch.compiler.disable
    def _model_forward(self, module, args):
        if self.next_pending and torch.is_grad_enabled():
            self.next_pending = False
            self._begin()

    def _before_optimizer(self, optimizer, args, kwargs):
        if self.scope is not None:
            scope, self.scope = self.scope, None
            scope.__exit__(None, None, None)

    def _after_optimizer(self, optimizer, args, kwargs):
        if self.recorder is not None and self.scope is None:
            self.next_pending = True

    def _wrap_backward(self, torch_backward):
        """``Tensor.backward`` that adds a 0-dim tensor to the step's ``loss`` first
        (in float64 on its device, no sync: the sum over micro-batches)."""
        import functools

        @functools.wraps(torch_backward)
        def backward(tensor, *args, **kwargs):
            if (self.scope is not None and tensor.dim() == 0 and tensor.is_floating_point()
                    and not torch.compiler.is_compiling()):
                try:
                    loss = tensor.detach().to(torch.float64, copy=True)
                    self.loss = loss if self.loss is None else self.loss + loss
                    self.recorder.log({"loss": self.loss})
                except Exception:                 # never into training
                    pass
            return torch_backward(tensor, *args, **kwargs)
        return backward

    def close(self, ok: bool) -> None:
        self._stop_looking()
        if torch.Tensor.backward is self.backward:   # else someone patched it after us
            torch.Tensor.backward = self.torch_backward
        for h in self.handles:
            h.remove()
        if self.recorder is not None:
            self.recorder.close("complete" if ok else "interrupted")


def probe(location) -> None:
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


def find_module(target: str) -> None:
    import importlib.util
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(f"no module {target!r} to run with -m; check its name and run "
                          f"tensortape from the folder python -m would run it from")
