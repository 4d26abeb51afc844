"""``with quiet():`` the warnings of tensortape's dependencies (zarr, numcodecs,
numpy, torch) raised inside this block, on this thread and in the asyncio tasks
it starts, are ignored; tensortape's own warnings never are.

Public for the readers (``analysis``), which read stores through zarr as the
recorder writes them: zarr warns of what it meets in a store (a killed
writer's temporary files), and that is not the user's news, nor an error
under ``-W error``.  ``recorder._quiet`` says how it works without
``warnings.catch_warnings`` (which swaps the process-wide filters and races
with every other thread).
"""

from ._quiet import quiet

__all__ = ["quiet"]
