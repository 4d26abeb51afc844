"""Whether the job that records a store is still alive, for readers (``tensortape
info``): a public view of the store's claim (``_lock``), read only, no torch."""

from __future__ import annotations

import os

from .claim._lock import lock_for

__all__ = ["recording_job"]


def recording_job(location) -> dict | None:
    """The claim on the store at ``location``: ``alive`` (whether its owner may
    still be recording: its process on this machine, else a fresh heartbeat),
    ``heartbeat`` (seconds since the epoch of its newest sign of life) and
    ``owner`` (in words); None when no job holds a claim (a closed run, a store
    that cannot be read as a file system)."""
    try:
        holder = lock_for(os.fspath(location)).read()
    except Exception:                    # a reader never fails over what it only adds
        return None
    if holder is None:
        return None
    return {"alive": holder.alive(), "heartbeat": holder.beat, "owner": holder.describe()}
