"""``with quiet():`` the warnings of tensortape's dependencies (zarr, numcodecs,
numpy, torch) raised inside this block, on this thread and in the asyncio tasks
it starts, are ignored; tensortape's own warnings never are.

Public for the readers (``analysis``), which read stores through zarr as the
recorder writes them: zarr warns of what it meets in a store (a killed
writer's temporary files), and that is not the user's news, nor an error
under ``-W error``.  ``warn`` and ``holding`` are the recorder's own.

Warnings of tensortape's dependencies, raised inside its own machinery, are
not the user's news, and never change what it records.

Compiling the statistics kernels imports inductor, which warns
(``DeprecationWarning: torch.jit.script_method is deprecated``); Triton, zarr,
numcodecs and numpy warn too.  Under a user's ``-W error`` such a warning
becomes an exception inside tensortape, which would demote an engine or drop
a capture.  Code that runs them goes inside ``with quiet():``.

``warnings.catch_warnings`` is no tool for this before Python 3.14: it swaps
the process-wide filter list, so it races with every other thread that warns
or filters, and while it is open it silences every thread.  Filters keyed on
a module (``module=r"torch\\..*"``) would hide those warnings from the user's
own code for the whole process, and still miss a warning whose ``stacklevel``
names tensortape's frame or the user's.

So ``quiet()`` keeps one entry at the head of ``warnings.filters``: it ignores
a warning only when it is raised inside ``quiet()`` (a context variable: the
thread that entered it, and the asyncio tasks it starts meanwhile, such as
zarr's reads and writes on zarr's own event-loop thread), and only when it is
not a ``TensortapeWarning`` (tensortape's own are always issued, and always
follow the user's filters).  Anywhere else the entry matches nothing, so the
user's filters decide exactly as before.  The entry is inserted once, and
again only when the filter list was replaced (``catch_warnings``,
``resetwarnings``) or a later filter went before it.

One more entry follows it, for a warning that torch itself means to hide
but hides from display only (``torch._logging.hide_warnings``), so an
``error`` filter still raises it: Dynamo's own look at ``.grad`` of a
non-leaf tensor while it traces a frame.  A recorded compiled model meets it
where a hook's graph break (``on_nonfinite="replay"``) resumes tracing with
the module's output as an input; it then failed the user's compiled call.
That entry matches the message and torch's private modules only, so the same
warning from the user's own code is untouched.

tensortape's own warnings go through ``warn``.  Under a filter that makes them
errors they raise where the user's code called tensortape, on the training
thread; never from inside a piece of work whose result would then be lost.
Such a piece (the end of a step, whose record must reach the writer) runs
``with holding(pending):`` and issues what it held once it is done.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import sys
import threading
import warnings

from .errors import TensortapeWarning

__all__ = ["quiet"]

_inside = contextvars.ContextVar("tensortape_quiet", default=0)
_holder: contextvars.ContextVar = contextvars.ContextVar("tensortape_holder", default=None)
_lock = threading.Lock()


class _Inside:
    """The entry's module matcher (the filter calls its ``match``): true inside
    ``quiet()``, whatever the module."""

    pattern = "<inside tensortape's machinery>"

    def match(self, module: str) -> bool:
        return _inside.get() > 0

    def __repr__(self) -> str:
        return self.pattern


class _NotOursMeta(type):
    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, Warning) and not issubclass(sub, TensortapeWarning)

    def __instancecheck__(cls, obj) -> bool:
        return cls.__subclasscheck__(type(obj))


class _NotOurs(metaclass=_NotOursMeta):
    """The entry's category: every warning but tensortape's own."""


ENTRY = ("ignore", None, _NotOurs, _Inside(), 0)
_DYNAMO_GRAD = ("ignore", re.compile(r"The \.grad attribute of a Tensor that is not a leaf"),
                UserWarning, re.compile(r"torch\._"), 0)
ENTRIES = (ENTRY, _DYNAMO_GRAD)


def _install() -> None:
    with _lock:
        filters = warnings.filters
        if filters and filters[0] is ENTRY:
            return
        for entry in ENTRIES:
            try:
                filters.remove(entry)
            except ValueError:
                pass
        filters[0:0] = ENTRIES
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()


class quiet:
    """``with quiet():`` the dependencies' warnings raised in this block (on this
    thread, and in asyncio tasks it starts) are ignored; tensortape's own are
    not.  Re-entrant and cheap (a context variable); no other thread sees it."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _inside.set(_inside.get() + 1)
        filters = warnings.filters
        if not filters or filters[0] is not ENTRY:
            _install()

    def __exit__(self, *exc) -> bool:
        _inside.reset(self._token)
        return False


_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_level() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` made in ``warn``) of the first
    frame outside tensortape, torch and contextlib: the user's line that called
    tensortape, so a warning names it (and ``module`` filters match the user's)."""
    torch = sys.modules.get("torch")
    ours = (_HERE, os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py") + (
        (os.path.dirname(torch.__file__) + os.sep,) if torch is not None else ())
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def warn(message: str, stacklevel: int | None = None) -> None:
    """A ``TensortapeWarning`` of ``message``, issued now at the user's line that
    called tensortape (or ``stacklevel`` from the caller, as ``warnings.warn``
    counts), or held inside ``holding``."""
    held = _holder.get()
    if held is not None:
        held.append(message)
    else:
        level = _user_level() if stacklevel is None else stacklevel + 1
        warnings.warn(message, TensortapeWarning, stacklevel=level)


class holding:
    """``with holding(pending):`` tensortape's warnings (``warn``) are appended to
    ``pending`` instead of issued; the caller issues them when its work is done."""

    __slots__ = ("_into", "_token")

    def __init__(self, into: list):
        self._into = into

    def __enter__(self) -> list:
        self._token = _holder.set(self._into)
        return self._into

    def __exit__(self, *exc) -> bool:
        _holder.reset(self._token)
        return False
