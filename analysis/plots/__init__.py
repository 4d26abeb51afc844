"""``run.plot`` and the plot functions: xarray objects in, matplotlib figures out.

Private: every module here starts with ``_``."""
