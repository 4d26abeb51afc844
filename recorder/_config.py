"""The recorder's settings, validated once into a frozen value.

Any thread: built and checked once on the thread that constructs the Recorder,
then only read (frozen), by the training thread, the step buffer and the writer."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .errors import ConfigError, argument
from .format import CAPTURES

NONFINITE_POLICIES = ("record", "dump", "raise", "replay")
DUMPING = ("dump", "raise", "replay")      # the policies that store the ring at a NaN/Inf
# the defaults, chosen by measurement (docs/PERFORMANCE.md, "What the defaults cost"):
# statistics every step (``stats_every=10``: NaN/Inf alone counted between), no full tensors
# but the ring's, dumped at a NaN/Inf
STATS_EVERY = 1
TENSORS_EVERY = None
RING = 2                                   # steps before the current one (``ring=None``:
ON_NONFINITE = "dump"                      # this many where ``on_nonfinite`` dumps, else 0)
OUTSIDE_POLICIES = ("warn", "ignore", "raise")
ERROR_POLICIES = ("warn", "raise")
MODES = ("w-", "w", "a")
ZSTD_LEVELS = range(-(1 << 17), 23)    # zstd's fast modes (negative) up to its maximum, 22

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def _choice(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(map(repr, valid))}")


def _every(name: str, value, allow_none: bool, none: str = " or None") -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        extra = none if allow_none else ""
        raise ConfigError(f"{name}={value!r} is not valid; use a positive integer{extra}")


@dataclass(frozen=True)
class RecorderConfig:
    capture: tuple[str, ...] = ("activations", "gradients")
    tensors_every: int | None = TENSORS_EVERY
    stats_every: int = STATS_EVERY
    ring: int = RING
    on_nonfinite: str = ON_NONFINITE
    max_samples: int | None = None
    tensor_dtype: torch.dtype | None = None
    mode: str = "w-"
    flush_interval: float = 5.0
    max_pending_bytes: int = 1 << 30
    max_device_bytes: int = 1 << 30
    max_pinned_bytes: int = 2 << 30
    max_replay_bytes: int = 1 << 30
    compression: str | int | None = "auto"
    outside_step: str = "warn"
    max_bytes: int | str | None = "auto"         # "auto": resolved by ``_budget`` at the start
    on_error: str = "warn"
    close_timeout: float = 60.0

    @classmethod
    def build(cls, *, capture=("activations", "gradients"), tensors_every=TENSORS_EVERY,
              stats_every=STATS_EVERY, ring=None, on_nonfinite=ON_NONFINITE, max_samples=None,
              tensor_dtype=None, mode="w-",
              flush_interval=5.0, max_pending_bytes=1 << 30, max_device_bytes=1 << 30,
              max_pinned_bytes=2 << 30, max_replay_bytes=1 << 30, compression="auto",
              outside_step="warn", max_bytes="auto", on_error="warn",
              close_timeout=60.0) -> "RecorderConfig":
        if isinstance(capture, str):
            capture = (capture,)
        capture = tuple(capture)
        for c in capture:
            _choice("capture", c, CAPTURES)
        if not capture:
            raise ConfigError(f"capture=() records nothing; use some of {', '.join(map(repr, CAPTURES))}")
        if type(tensors_every) is int and tensors_every == 0:
            tensors_every = None                # 0 is None, as on the command line
        _every("tensors_every", tensors_every, allow_none=True,
               none=" or None (or 0) for statistics only")
        _every("stats_every", stats_every, allow_none=False)
        _choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
        if ring is None:                       # the default: a ring only where it is dumped
            ring = RING if on_nonfinite in DUMPING else 0
        if not isinstance(ring, int) or isinstance(ring, bool) or ring < 0:
            raise ConfigError(f"{argument('ring', ring)} is not valid; use an integer >= 0, or "
                              f"leave it out (the default: {RING} where "
                              f"{argument('on_nonfinite', 'dump')} or another dumping policy "
                              f"is given, else 0)")
        if ring and on_nonfinite not in DUMPING:     # a ring no dump would ever store
            dumps = ", ".join(argument("on_nonfinite", p) for p in DUMPING)
            raise ConfigError(f"{argument('ring', ring)} keeps full tensors for a non-finite "
                              f"dump, which {argument('on_nonfinite', on_nonfinite)} never makes; "
                              f"pass one of {dumps} to store them, or "
                              f"{argument('ring', 0)} to keep none")
        _every("max_samples", max_samples, allow_none=True)
        if isinstance(tensor_dtype, str):
            _choice("tensor_dtype", tensor_dtype, tuple(_DTYPES))
            tensor_dtype = _DTYPES[tensor_dtype]
        if tensor_dtype is not None and tensor_dtype not in _DTYPES.values():
            raise ConfigError(f"tensor_dtype={tensor_dtype!r} is not valid; use None or one of "
                              f"{', '.join(_DTYPES)}")
        _choice("mode", mode, MODES)
        if not flush_interval > 0:
            raise ConfigError(f"flush_interval={flush_interval!r} is not valid; use seconds > 0")
        for name, value in (("max_pending_bytes", max_pending_bytes),
                            ("max_device_bytes", max_device_bytes),
                            ("max_pinned_bytes", max_pinned_bytes),
                            ("max_replay_bytes", max_replay_bytes)):
            _every(name, value, allow_none=False)
        if compression not in ("auto", None) and (
                not isinstance(compression, int) or isinstance(compression, bool)
                or compression not in ZSTD_LEVELS):
            raise ConfigError(f"compression={compression!r} is not valid; use 'auto', None, or a "
                              f"zstd level from {ZSTD_LEVELS[0]} to {ZSTD_LEVELS[-1]}")
        _choice("outside_step", outside_step, OUTSIDE_POLICIES)
        if max_bytes != "auto":
            try:
                _every("max_bytes", max_bytes, allow_none=True)
            except ConfigError:
                raise ConfigError(f"max_bytes={max_bytes!r} is not valid; use 'auto' (a share of "
                                  f"the free space), a number of bytes, or None (no budget)") from None
        _choice("on_error", on_error, ERROR_POLICIES)
        if isinstance(close_timeout, bool) or not isinstance(close_timeout, (int, float)) \
                or not close_timeout > 0:
            raise ConfigError(f"close_timeout={close_timeout!r} is not valid; use seconds > 0")
        return cls(capture, tensors_every, stats_every, ring, on_nonfinite, max_samples,
                   tensor_dtype, mode, float(flush_interval), max_pending_bytes,
                   max_device_bytes, max_pinned_bytes, max_replay_bytes, compression,
                   outside_step, max_bytes, on_error, float(close_timeout))

    @classmethod
    def check(cls, recorder_kwargs: dict) -> None:
        """Validate the settings among a Recorder's keywords now (a callback's, the
        command line's), before anything runs: ``ConfigError`` as ``build`` says."""
        cls.build(**{k: v for k, v in recorder_kwargs.items() if k in cls.__dataclass_fields__})

    @property
    def dumps(self) -> bool:
        """Whether a NaN/Inf stores the ring and the step's full tensors."""
        return self.on_nonfinite in DUMPING

    def persists(self, step: int) -> bool:
        return self.tensors_every is not None and step % self.tensors_every == 0

    def stats_at(self, step: int) -> bool:
        return step % self.stats_every == 0

    def to_json(self) -> dict:
        d = asdict(self)
        d["capture"] = list(self.capture)
        d["tensor_dtype"] = None if self.tensor_dtype is None else str(self.tensor_dtype).removeprefix("torch.")
        return d
