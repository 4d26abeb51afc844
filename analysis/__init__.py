"""tensortape's analysis: open recorded runs lazily and study them."""

from .compare import compare_runs, first_divergence
from .inspector import Inspector
from .plots import plot_comparison
from .run import FirstNonFinite, NonFiniteEvent, Run, open_run

__all__ = [
    "open_run",
    "Run",
    "NonFiniteEvent",
    "FirstNonFinite",
    "compare_runs",
    "first_divergence",
    "plot_comparison",
    "Inspector",
]
