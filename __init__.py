"""tensortape: record what flows through a PyTorch model while it trains, and study it.

One installed package.  The repository's top-level folders are its parts:
``tensortape.recorder`` (``recorder/``, the training side), ``tensortape.analysis``
(``analysis/``, the reader), ``tensortape.cli`` (``cli.py``) and
``tensortape.sample_runs``.  The names below load on first use (PEP 562), so
``import tensortape.recorder`` imports neither the reader nor xarray, and
``import tensortape.analysis`` no torch.
"""

__all__ = [
    "Inspector",
    "Recorder",
    "RecorderError",
    "compare_runs",
    "first_divergence",
    "open_run",
    "plot_comparison",
    "select_layers",
]

_LAZY = {
    "Recorder": "recorder", "select_layers": "recorder", "RecorderError": "recorder",
    "open_run": "analysis", "compare_runs": "analysis", "first_divergence": "analysis",
    "plot_comparison": "analysis", "Inspector": "analysis",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tensortape' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
