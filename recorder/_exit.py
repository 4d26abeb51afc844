"""How a recording ends when the user does not end it: at interpreter exit, or
when its Recorder is collected without ``close()``.

- ``opened``/``closed``: the Recorders open now (a weak set), each closed
  ``interrupted`` at exit (``close_at_exit``) within its ``close_timeout``.
- ``forgotten``: a Recorder's finaliser (it was collected unclosed): its hooks
  go, its open step and its close are posted to the writer without waiting,
  and the exit waits for that writer too.

The exit call must run before the thread pools refuse new work: zarr writes
through a ``concurrent.futures`` pool (asyncio's default executor), and
``concurrent.futures`` stops taking work in its own exit call, which threading
runs at shutdown, before ``atexit``'s.  The writer thread is a daemon, so
``atexit.register`` would run late enough to be safe from the join of
non-daemon threads, but too late for zarr: a run closed there could not
write its last step and status.  No public API runs a call earlier, so
``_at_thread_exit`` uses threading's private ``_register_atexit`` (the one
place that does), falling back to ``atexit.register`` where it is missing.

Main thread, at exit; ``forgotten`` on whatever thread the collector runs.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  its exit call registered first: ours runs before
import sys
import threading
import warnings
import weakref

from . import format as fmt

__all__ = ["closed", "forgotten", "opened"]

_open_recorders: weakref.WeakSet = weakref.WeakSet()
_ending: set = set()                    # writers a finaliser asked to end the run


def opened(rec) -> None:
    """``rec`` is recording: close it at exit if the user does not."""
    _open_recorders.add(rec)


def closed(rec) -> None:
    """``rec`` closed itself."""
    _open_recorders.discard(rec)


def close_at_exit() -> None:
    """At interpreter exit, close every Recorder still open as ``interrupted``: a
    script that raised or was interrupted keeps every step it captured.  It runs
    among threading's exit calls, before thread pools (zarr's among them) refuse
    new work, and waits at most each Recorder's ``close_timeout``."""
    for rec in list(_open_recorders):
        try:
            rec.close(fmt.STATUS_INTERRUPTED)
        except BaseException as e:   # never raise at exit; say it in one line
            print(f"tensortape: closing {rec.store_location!r} at exit failed: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
    for writer in list(_ending):
        writer.worker.thread.join(writer.config.close_timeout)


def forgotten(writer, hooks, buffer, location: str) -> None:
    """A Recorder collected without ``close()``: remove its hooks, end its open step
    (unless a thread is inside the step buffer now), and ask its writer to end the
    run ``interrupted``.  A finaliser may run in the middle of any code, even code
    holding one of tensortape's locks, so this takes no lock it could wait for and
    waits for nothing."""
    hooks.detach(wait=False)
    if buffer.state.step is not None and buffer.idle():
        writer.post_nowait(buffer.end())
    writer.close_nowait()
    _ending.add(writer)
    try:
        warnings.warn(f"tensortape: a Recorder of {location!r} was never closed; it is closed "
                      f"now with status 'interrupted' (use `with Recorder(...)` or call close())",
                      ResourceWarning, stacklevel=2)
    except Exception:            # a filter that makes it an error: not from a finaliser
        pass


def _at_thread_exit(fn) -> None:
    """Run ``fn`` at exit among threading's exit calls, before ``concurrent.futures``'
    (they run in reverse order of registration; see the module for why)."""
    try:
        threading._register_atexit(fn)
    except (AttributeError, RuntimeError):       # another Python, or already shutting down
        atexit.register(fn)


_at_thread_exit(close_at_exit)
