"""tensortape's analysis: open recorded runs lazily and study them.

Importing it does not import torch; ``Inspector`` (which runs a model) loads on
first use (PEP 562).
"""

from ._compare import compare_runs, first_divergence, plot_comparison
from ._run import FirstNonFinite, NonFiniteEvent, Run, open_run

__all__ = [
    "FirstNonFinite",
    "Inspector",
    "NonFiniteEvent",
    "Run",
    "compare_runs",
    "first_divergence",
    "open_run",
    "plot_comparison",
]


def __getattr__(name: str):
    if name == "Inspector":
        from ._inspector import Inspector
        globals()["Inspector"] = Inspector
        return Inspector
    raise AttributeError(f"module 'tensortape.analysis' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
