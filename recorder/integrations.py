"""Callbacks for training frameworks: Hugging Face ``Trainer`` and Lightning.

::

    from tensortape.recorder.integrations import TrainerCallback      # transformers.Trainer
    Trainer(..., callbacks=[TrainerCallback("runs/exp.zarr", layers="*.mlp.*")])

    from tensortape.recorder.integrations import LightningCallback    # lightning.pytorch
    L.Trainer(callbacks=[LightningCallback("runs/exp.zarr", layers="*.mlp.*")])

Each takes the store and any ``Recorder`` keyword.  A step is one optimizer
step, numbered by the trainer's global step; gradient-accumulation
micro-batches are the step's micro-batches; the step ends just before the
optimizer steps, so ``weight_grads`` are taken before the trainer zeroes them.
Evaluation, prediction and sanity-check passes run outside any step: they are
not recorded and never fail (``outside_step`` defaults to ``"ignore"`` here).
The trainer's logged scalars are stored too (``rec.log``; ``run.scalars()``),
each where and when the trainer logs it, once: Hugging Face's ``on_log`` logs
(``loss``, ``learning_rate``, ``grad_norm``, eval metrics, ...) on the step just
ended; Lightning's, as it hands them to its loggers (what ``self.log`` logged:
training metrics every ``log_every_n_steps``, epoch and validation metrics when
they are computed), taken from the one method that hands them over (its logger
connector's ``log_metrics``, wrapped while the run records, whether or not a
logger is configured), 0-dim tensors read with no sync.  Scalars logged before
the first step (an evaluation at the start) are stored at the first step.
Under the Hugging Face Trainer's ``logging_nan_inf_filter`` (its default), a
training loss that is NaN or Inf is logged as the window's running average (0 at
its first step); the run stores ``loss`` and ``train_loss`` as the Trainer logs
them unfiltered instead (``_LossFilter``): NaN or Inf where a micro-batch's loss
was.

Neither framework is imported until its callback is first used (each is an
optional extra: ``tensortape[hf]``, ``tensortape[lightning]``).
"""

from __future__ import annotations

from .step import _scalars
from ._config import RecorderConfig
from .errors import RecorderError

__all__ = ["LightningCallback", "TrainerCallback"]


class _Session:
    """The Recorder of one training run, driven by a framework's events."""

    def __init__(self, store, kwargs: dict):
        self.store, self.kwargs = store, {"outside_step": "ignore", **kwargs}
        self.recorder = None
        self.scope = None
        self.open_step: int | None = None
        self.early: dict | None = {}          # logged before the recorder's first step
                                              # (None: it has begun one)

    def start(self, model) -> None:
        """Training starts: a new Recorder.  A run this session recorded before (a
        training that raised and is started again, or resumed) is closed as it
        stands, and the new one appends to it."""
        from ._recorder import Recorder
        kwargs = self.kwargs
        if self.recorder is not None:
            self.close(failed=True)          # a no-op if it was closed
            kwargs = {**kwargs, "mode": "a"}
        self.recorder = Recorder(model, self.store, **kwargs).attach()
        self.early = {}

    def begin_step(self, step: int) -> None:
        if self.recorder is not None and self.open_step != step:
            self.end_step()
            self.scope, self.open_step = self.recorder.step(int(step)), int(step)
            early, self.early = self.early, None
            if early:
                self.recorder.log(early)

    def end_step(self) -> None:
        if self.scope is not None:
            scope, self.scope, self.open_step = self.scope, None, None
            scope.__exit__(None, None, None)

    def micro_batch(self, enter: bool) -> None:
        """A training batch begins or ends: one micro-batch, however the module
        that the framework calls is nested in the recorded one."""
        if self.recorder is not None:
            self.recorder.micro_batch(enter)

    def log(self, values) -> None:
        """The trainer's logged scalars (numbers and 0-dim tensors; anything else is
        skipped) into the open step, or the last one (``Recorder.log``)."""
        rec = self.recorder
        if rec is None or rec.closed or not values:
            return
        kept = {}
        for k, v in dict(values).items():      # what rec.log takes; anything else skipped
            try:                               # (a trainer's logging never raises into it)
                kept.update(_scalars.check({str(k): v}))
            except RecorderError:
                pass
        if self.early is not None:
            self.early.update(kept)            # no step yet: the first step's
        elif kept:
            rec.log(kept)

    def close(self, failed: bool = False) -> None:
        if self.recorder is not None:
            self.scope = self.open_step = None
            self.recorder.close("interrupted" if failed else "complete")


class _LossFilter:
    """What the Hugging Face Trainer's ``logging_nan_inf_filter`` hides: the
    non-finite part of the losses its ``training_step`` returned, summed on their
    device (no sync) since the last logged ``loss`` (``window``) and over the
    training (``total``).  ``logged`` gives the Trainer's logs with ``loss`` and
    ``train_loss`` as it logs them unfiltered: the logged number where every
    loss was finite, else the non-finite sum (NaN, or an Inf), read where the
    logged scalars are read (a step's end)."""

    def __init__(self):
        self.window = self.total = None

    def saw(self, loss) -> None:
        """A micro-batch's training loss, as ``training_step`` returned it."""
        import torch
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.is_complex():
            return
        x = loss.detach().reshape(()).to(torch.float64)
        part = torch.where(torch.isfinite(x), torch.zeros_like(x), x)
        self.window = part if self.window is None else self.window + part
        self.total = part if self.total is None else self.total + part

    def logged(self, logs: dict, filtering: bool) -> dict:
        """``logs`` (not changed) with the losses the filter replaced put back."""
        import torch
        out = dict(logs)
        for name, part in (("loss", self.window), ("train_loss", self.total)):
            if name not in logs:
                continue
            if name == "loss":
                self.window = None          # the Trainer's window ends where it logs it
            value = logs[name]
            if filtering and part is not None and isinstance(value, (int, float)):
                out[name] = torch.where(torch.isfinite(part),
                                        torch.full_like(part, float(value)), part)
        return out


class _Holder:
    """What both callbacks share: the store, the Recorder keywords, the session."""

    def __init__(self, store, **recorder_kwargs):
        """store: the run's path or URL.  recorder_kwargs: any ``Recorder`` keyword
        (``layers``, ``capture``, ``tensors_every``, ``stats_every``, ``ring``,
        ``on_nonfinite``, ``mode``, ...; ``outside_step`` defaults to ``"ignore"``,
        since trainers run evaluation outside the steps).  The Recorder attaches
        when training starts and closes when it ends (``interrupted`` after an
        exception).  Settings that conflict raise ``ConfigError`` here, not when
        training starts."""
        RecorderConfig.check(recorder_kwargs)
        self.session = _Session(store, recorder_kwargs)
        self.losses = _LossFilter()          # the Hugging Face Trainer's

    @property
    def recorder(self):
        """The run's ``Recorder`` (None before training starts)."""
        return self.session.recorder


def _initialising_trainer(trainer_class, callback):
    """The ``trainer_class`` instance whose ``__init__`` is calling ``callback``'s
    ``on_init_end``, or None.

    Hugging Face's callback events hand a callback the model, the optimizer, the
    scheduler, the data loaders and the trainer's args, state and control, but
    never the Trainer, and no event tells of an exception: closing the run when
    ``train`` raises takes the Trainer's ``train``.  The base ``__init__`` (which a
    subclass reaches through ``super()``) calls ``on_init_end``; its frame is the
    one running that function's code."""
    import inspect
    init = inspect.unwrap(trainer_class.__init__).__code__
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_code is not init:
            frame = frame.f_back
        trainer = None if frame is None else frame.f_locals.get("self")
    finally:
        del frame
    handler = getattr(trainer, "callback_handler", None)
    return trainer if callback in getattr(handler, "callbacks", ()) else None


def _closing_on_error(train, session):
    """``train`` that closes the session's run as ``interrupted`` when it raises."""
    import functools

    @functools.wraps(train)
    def wrapped(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except BaseException:
            session.close(failed=True)
            raise
    wrapped._tensortape = True
    return wrapped


def _watching_losses(training_step, losses: _LossFilter):
    """``training_step`` that hands each loss it returns to ``losses`` (never raising)."""
    import functools

    @functools.wraps(training_step)
    def wrapped(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        try:
            losses.saw(loss)
        except Exception:                   # never into the training
            pass
        return loss
    wrapped._tensortape = True
    return wrapped


def _trainer_callback():
    import transformers

    class TrainerCallback(_Holder, transformers.TrainerCallback):
        """Records a ``transformers.Trainer`` run (see ``recorder.integrations``)."""

        def on_init_end(self, args, state, control, **kwargs):
            """The Trainer tells its callbacks of no exception: its ``train`` is wrapped
            so that one (or a KeyboardInterrupt) closes the run as ``interrupted``.
            Nor of the loss a step returned: its ``training_step`` is wrapped too
            (``_LossFilter``)."""
            trainer = _initialising_trainer(transformers.Trainer, self)
            if trainer is not None and not hasattr(trainer.train, "_tensortape"):
                trainer.train = _closing_on_error(trainer.train, self.session)
            if trainer is not None and not hasattr(trainer.training_step, "_tensortape"):
                trainer.training_step = _watching_losses(trainer.training_step, self.losses)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.losses.window = self.losses.total = None
            self.session.start(model)

        def on_step_begin(self, args, state, control, **kwargs):
            self.session.begin_step(state.global_step)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.session.end_step()

        def on_step_end(self, args, state, control, **kwargs):
            self.session.end_step()          # transformers without on_pre_optimizer_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            try:
                if logs:
                    logs = self.losses.logged(logs, bool(getattr(args, "logging_nan_inf_filter",
                                                                 False)))
            except Exception:               # never into the training: the logs as logged
                pass
            self.session.log(logs)

        def on_train_end(self, args, state, control, **kwargs):
            self.session.close()

    return TrainerCallback


def _tap_logged(trainer, session) -> None:
    """Lightning hands every scalar it logs to its loggers through one method, its
    logger connector's ``log_metrics(metrics, step)`` (called whether or not a logger
    is configured): wrapped on that instance, it hands them to ``session`` too, once
    each, when they are logged.  ``step`` is Lightning's, and is the recorder's step
    just ended (or open); a metric named ``step`` is Lightning's step, not a scalar."""
    connector = getattr(trainer, "_logger_connector", None)
    handed = getattr(connector, "log_metrics", None)
    if handed is None or getattr(handed, "_tensortape", False):
        return

    def log_metrics(metrics, *args, **kwargs):
        try:
            session.log({k: v for k, v in dict(metrics).items() if k != "step"})
        except Exception:                      # never into the training
            pass
        return handed(metrics, *args, **kwargs)
    log_metrics._tensortape = True
    connector.log_metrics = log_metrics


def _untap_logged(trainer) -> None:
    connector = getattr(trainer, "_logger_connector", None)
    if getattr(getattr(connector, "log_metrics", None), "_tensortape", False):
        del connector.log_metrics              # the class's method again


def _lightning_callback():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class LightningCallback(_Holder, pl.Callback):
        """Records a Lightning ``Trainer.fit`` (see ``recorder.integrations``)."""

        def on_train_start(self, trainer, pl_module):
            self.session.start(pl_module)
            _tap_logged(trainer, self.session)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.session.begin_step(trainer.global_step)
            self.session.micro_batch(True)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.session.micro_batch(False)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.session.end_step()

        def on_train_end(self, trainer, pl_module):
            _untap_logged(trainer)
            self.session.close()

        def on_exception(self, trainer, pl_module, exception):
            _untap_logged(trainer)
            self.session.close(failed=True)

    return LightningCallback


_MAKERS = {"TrainerCallback": _trainer_callback, "LightningCallback": _lightning_callback}


def __getattr__(name: str):
    if name in _MAKERS:
        cls = _MAKERS[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module 'tensortape.recorder.integrations' has no attribute {name!r}")
