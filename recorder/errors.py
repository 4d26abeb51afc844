"""The one error hierarchy of tensortape.

Every class also subclasses the builtin a caller would naturally catch, so
``except ValueError`` or ``except FileExistsError`` keeps working.  tensortape's
own warnings have one category, ``TensortapeWarning``, so they can be filtered
apart from everyone else's.

A message that names an argument names it as the user wrote it: ``argument("mode",
"w")`` is ``mode='w'`` in Python and ``--mode w`` inside ``command_line()``, which
the command line enters around the library calls its flags become.
"""

import contextlib

__all__ = ["RecorderError", "ConfigError", "LayerNotFoundError", "InspectionError",
           "NonFiniteError", "StoreExistsError", "StoreNotFoundError", "StoreFormatError",
           "TensortapeWarning", "argument", "command_line"]

_SPELLING = {"flags": False}


_NAME = object()


def argument(name: str, value=_NAME) -> str:
    """``name=value`` as the user writes it: ``mode='w'`` in Python, ``--mode w``
    under the command line (``command_line()``); without a value, the name alone
    (``max_bytes=``, ``--max-bytes``); None is ``none`` on the command line."""
    if _SPELLING["flags"]:
        flag = f"--{name.replace('_', '-')}"
        return flag if value is _NAME else f"{flag} {'none' if value is None else value}"
    return f"{name}=" if value is _NAME else f"{name}={value!r}"


@contextlib.contextmanager
def command_line():
    """Within the block, ``argument`` spells arguments as command-line flags."""
    before, _SPELLING["flags"] = _SPELLING["flags"], True
    try:
        yield
    finally:
        _SPELLING["flags"] = before


class RecorderError(Exception):
    """Base class of every tensortape error."""


class ConfigError(RecorderError, ValueError):
    """An argument has a value tensortape does not accept."""


class LayerNotFoundError(RecorderError, LookupError):
    """A layer pattern or name matches nothing in the model or the run."""


class InspectionError(RecorderError, RuntimeError):
    """The recorder was used in a way its lifecycle does not allow."""


class NonFiniteError(RecorderError, FloatingPointError):
    """A captured tensor held NaN or Inf and ``on_nonfinite="raise"`` was set."""


class StoreExistsError(RecorderError, FileExistsError):
    """The store already exists and ``mode="w-"`` forbids overwriting it."""


class StoreNotFoundError(RecorderError, FileNotFoundError):
    """There is no store at the given location."""


class StoreFormatError(RecorderError, ValueError):
    """The location holds something that is not a readable tensortape store."""


class TensortapeWarning(RuntimeWarning):
    """A warning of tensortape's own (a dropped capture, a demoted engine, a
    forward outside a step, ...).  Filter it by class, e.g.
    ``warnings.filterwarnings("ignore", category=TensortapeWarning)``; every
    message also starts with ``tensortape:``."""
