"""tensortape's recorder: hook any ``nn.Module`` and record it into a Zarr store.

The training side stays lean: this package never imports ``analysis``,
xarray or matplotlib.  Importing it (or its ``errors`` and ``format``
modules, which readers use) does not import torch: ``Recorder`` and
``select_layers`` load on first use (PEP 562).
"""

from .errors import (ConfigError, InspectionError, LayerNotFoundError, NonFiniteError,
                     RecorderError, StoreExistsError, StoreFormatError, StoreNotFoundError,
                     TensortapeWarning)

__all__ = [
    "ConfigError",
    "InspectionError",
    "LayerNotFoundError",
    "NonFiniteError",
    "Recorder",
    "RecorderError",
    "StoreExistsError",
    "StoreFormatError",
    "StoreNotFoundError",
    "TensortapeWarning",
    "select_layers",
]

_LAZY = {"Recorder": "._recorder", "select_layers": ".hooks._selection"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tensortape.recorder' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
