"""tensortape's analysis: open recorded runs lazily and study them."""

from .run import FirstNonFinite, NonFiniteEvent, Run, open_run

__all__ = ["open_run", "Run", "NonFiniteEvent", "FirstNonFinite"]
