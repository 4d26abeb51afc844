"""The statistics engines on torch, and the demotion order over every engine.

- ``CpuEngine`` and ``DeviceEngine`` (any accelerator) run the torch kernels
  (``_engine.Engine``), compiled by ``torch.compile`` or eagerly: the family
  ``"torch"``.
- ``TritonEngine`` (``_triton``): CUDA, when Triton is there (it ships with
  CUDA builds of torch): one fused pass per tensor; the family ``"triton"``.
- ``NumbaEngine`` (``_numba``): the CPU, when numba is installed: one read per
  tensor, split across threads, compiled once per machine off the training
  thread; the family ``"numba"``.

Each engine registers itself in its family (``_engine.registered``); this
module declares, once, the order in which they are tried (``ORDER``: Triton
on CUDA, numba on the CPU, the compiled torch kernels, the eager ones), and imports a family's module
only when a chain reaches it.

``Engines`` holds a recording's choice: for each (device type, dtype) a chain
of engines, best first, as ``ORDER`` says.  When one fails, the capture is
dropped (counted) and that (device type, dtype) is demoted to the next engine
in its chain (``demote``).

``TENSORTAPE_COMPILE=0`` leaves the compiled kernels (numba's too) out of
every chain.  ``TENSORTAPE_ENGINE`` picks where the chain begins: ``auto`` (the
default, as above), ``numba`` (numba, then the torch kernels), ``torch``
(neither Triton nor numba) or ``triton`` (Triton for every device: on CPU
tensors it needs ``TRITON_INTERPRET=1``, which is how the tests check it
against the CPU engine).

Training thread (and autograd's threads, for gradients); ``summarize`` runs
on its caller's.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import threading
from dataclasses import dataclass

import torch

from ._engine import Engine, registered
from ..quiet import quiet, warn
from ._summary import Form, Summaries, empty_summary, finalize, form, prepared
from ..errors import ConfigError

__all__ = ["ORDER", "CpuEngine", "DeviceEngine", "Engines", "engine_choice", "summarize"]

_PARALLEL_MIN = 1 << 18        # elements from which CPU work is split across threads


class CpuEngine(Engine):
    """The CPU: large tensors get kernels that OpenMP splits across threads, small
    ones serial kernels; ``bincount`` is split across threads."""

    family = "torch"
    _pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def serves(cls, device_type: str) -> bool:
        return device_type == "cpu"

    def _parallel(self, x: torch.Tensor) -> bool:
        # the size is unknown at compile time, so inductor would run a large tensor
        # on one thread; a parallel region costs more than it saves on small ones
        return x.numel() >= _PARALLEL_MIN

    def _bincount(self, code: torch.Tensor, n: int) -> torch.Tensor:
        """``bincount`` runs on one thread: large inputs are split and the parts
        run concurrently (torch releases the GIL); their counts add up exactly."""
        parts = min(torch.get_num_threads(), 4, code.numel() // _PARALLEL_MIN)
        if parts < 2:
            return torch.bincount(code, minlength=n)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    3, thread_name_prefix="tensortape-bincount")
        chunks = code.chunk(parts)
        futures = [self._pool.submit(torch.bincount, c, minlength=n) for c in chunks[1:]]
        counts = torch.bincount(chunks[0], minlength=n)
        for f in futures:
            counts += f.result()
        return counts


class DeviceEngine(Engine):
    """Any accelerator (CUDA, MPS, XPU): the torch kernels, counted by ``index_add_``
    (``bincount`` there reads its maximum back to the host, a sync per tensor)."""

    family = "torch"

    @classmethod
    def serves(cls, device_type: str) -> bool:
        return device_type != "cpu"


@dataclass(frozen=True)
class Place:
    """A place in the demotion order: a family of engines, the module where it
    registers itself, the device types it serves unless ``TENSORTAPE_ENGINE``
    names it (None: every one), and whether its torch kernels are compiled
    (None: as ``TENSORTAPE_COMPILE`` says)."""
    family: str
    module: str
    devices: frozenset[str] | None
    compiled: bool | None


# the demotion order, best first: a (device type, dtype) whose engine fails moves one
# place down; a place whose family is not usable here is left out
ORDER = (
    Place("triton", "._triton", frozenset({"cuda"}), None),
    Place("numba", "._numba", frozenset({"cpu"}), True),
    Place("torch", __name__, None, True),
    Place("torch", __name__, None, False),
)
ENGINES = ("auto", *sorted({p.family for p in ORDER}))
_instances: dict[tuple, Engine] = {}
_instances_lock = threading.Lock()


def engine_choice() -> str:
    """``TENSORTAPE_ENGINE``, checked: ``ConfigError`` (one line naming the valid
    values) for anything else.  The Recorder calls it at construction, before
    anything is written."""
    choice = os.environ.get("TENSORTAPE_ENGINE", "auto")
    if choice not in ENGINES:
        raise ConfigError(f"TENSORTAPE_ENGINE={choice!r} is not valid; use one of "
                          f"{', '.join(ENGINES)} (or leave it unset)")
    return choice


def _compile_enabled() -> bool:
    return os.environ.get("TENSORTAPE_COMPILE", "1") not in ("0", "false", "no")


def _instance(cls: type, device_type: str, compile: bool) -> Engine:
    """One engine per (class, device type, kernels) in the process: compiled
    kernels are cached there."""
    key = (cls, device_type, compile)
    engine = _instances.get(key)
    if engine is None:
        with _instances_lock:
            engine = _instances.setdefault(key, cls(device_type, compile))
    return engine


def _family(place: Place, required: bool) -> list[type[Engine]]:
    """The engines of ``place``'s family, its module imported (none when it cannot
    be: no Triton here, and the torch kernels give the same numbers)."""
    try:
        with quiet():                   # importing Triton may warn: not the user's news
            importlib.import_module(place.module, __package__)
    except Exception as e:
        if required:
            warn(f"tensortape: TENSORTAPE_ENGINE={place.family}, but {place.family} is not "
                 f"usable ({type(e).__name__}: {e}); using the torch kernels")
        return []
    return registered(place.family)


class Engines:
    """A recording's statistics engines: per (device type, dtype) a chain, best
    first, and how far each has been demoted.  The settings are read once, here."""

    def __init__(self, compile: bool | None = None, choice: str | None = None):
        self.compile = _compile_enabled() if compile is None else compile and _compile_enabled()
        self.choice = engine_choice() if choice is None else choice
        if self.choice not in ENGINES:
            raise ConfigError(f"engine {self.choice!r} is not valid; use one of "
                              f"{', '.join(ENGINES)}")
        self._chains: dict[str, list[Engine]] = {}
        self._level: dict[tuple, int] = {}

    def chain(self, device_type: str) -> list[Engine]:
        """The engines for ``device_type``, best first: ``ORDER`` from the chosen
        family's first place."""
        chain = self._chains.get(device_type)
        if chain is None:
            places = ORDER
            if self.choice != "auto":
                places = places[next(i for i, p in enumerate(ORDER) if p.family == self.choice):]
            chain = []
            for place in places:
                named = place.family == self.choice
                if place.compiled and not self.compile:
                    continue
                if place.devices is not None and device_type not in place.devices and not named:
                    continue
                classes = _family(place, named)
                cls = next((c for c in classes if c.serves(device_type)),
                           classes[0] if named and classes else None)
                if cls is not None:
                    compiled = self.compile if place.compiled is None else place.compiled
                    chain.append(_instance(cls, device_type, compiled))
            self._chains[device_type] = chain
        return chain

    def warm(self, dtype: torch.dtype, device: torch.device) -> None:
        """Prepare every engine a tensor of ``dtype`` on ``device`` may take
        (``Engine.warm``)."""
        for engine in self.chain(device.type):
            engine.warm(dtype, device)

    def for_tensor(self, x: torch.Tensor) -> Engine:
        """The engine for ``x``'s device type and dtype."""
        chain = self.chain(x.device.type)
        return chain[min(self._level.get((x.device.type, x.dtype), 0), len(chain) - 1)]

    def demote(self, x: torch.Tensor) -> Engine | None:
        """After a failure on ``x``: the next engine for its device type and dtype
        (None when there is none left: it stays with the last)."""
        key = (x.device.type, x.dtype)
        chain = self.chain(x.device.type)
        level = self._level.get(key, 0) + 1
        if level >= len(chain):
            return None
        self._level[key] = level
        return chain[level]


def summarize(x: torch.Tensor, compile: bool | None = None) -> Summaries:
    """Statistics and histogram of one tensor, on the host (one sync)."""
    x = x.detach()
    f = form(x, stats=True, batched=False)[0]
    if f is Form.COUNT:
        return finalize([], [float(x.numel())])
    vec = empty_summary() if f is Form.EMPTY else \
        Engines(compile).for_tensor(x).reduce(prepared(x))
    return finalize([vec.cpu().numpy()])
