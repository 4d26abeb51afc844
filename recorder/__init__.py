"""tensortape's recorder: hook any ``nn.Module`` and record it into a Zarr store.

The training side stays lean: this package never imports ``analysis``,
xarray or matplotlib.
"""

from .errors import (InspectionError, LayerNotFoundError, NonFiniteError, RecorderError,
                     StoreExistsError, StoreFormatError, StoreNotFoundError)
from .recorder import Recorder
from .selection import select_layers

__all__ = [
    "Recorder",
    "select_layers",
    "RecorderError",
    "LayerNotFoundError",
    "InspectionError",
    "NonFiniteError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreFormatError",
]
