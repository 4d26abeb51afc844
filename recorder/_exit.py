"""How a recording ends when the user does not end it: at interpreter exit, at
SIGTERM, or when its Recorder is collected without ``close()``.

- ``opened``/``closed``: the Recorders open now (weak keys), each closed
  ``interrupted`` at exit (``close_at_exit``) within its ``close_timeout``.
- ``_forgotten``: a Recorder's finaliser, made by ``opened`` (it was collected
  unclosed): its hooks go, its open step and its close are posted to the writer
  without waiting (``_abandon``), and the exit waits for that writer too.
- SIGTERM (a scheduler's preemption): while a Recorder is open, a handler is
  installed (from the main thread only, and only over the default action or a
  Python handler, which it chains to; put back when the last Recorder closes,
  if it is still ours).  A handler of the user's, installed before, runs
  instead and decides: what it raises unwinds training as any exception does
  (the run then closes ``interrupted``), and if it returns, training and the
  recording go on (a "stop after this step" flag).  Without one, every open
  Recorder is closed ``interrupted``, and the default action is delivered
  again: the process ends by SIGTERM, as it would have.  The handler runs on
  the main thread between two bytecodes; if that thread was inside tensortape's
  own code (it may hold one of its locks), the Recorders are ended as a
  finaliser ends one, without a lock, and the handler waits for their writers.

The exit call must run before the thread pools refuse new work: zarr writes
through a ``concurrent.futures`` pool (asyncio's default executor), and
``concurrent.futures`` stops taking work in its own exit call, which threading
runs at shutdown, before ``atexit``'s.  The writer thread is a daemon, so
``atexit.register`` would run late enough to be safe from the join of
non-daemon threads, but too late for zarr: a run closed there could not
write its last step and status.  No public API runs a call earlier, so
``_at_thread_exit`` uses threading's private ``_register_atexit`` (the one
place that does), falling back to ``atexit.register`` where it is missing.

Main thread, at exit and SIGTERM; ``_forgotten`` on whatever thread the collector runs.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  its exit call registered first: ours runs before
import os
import signal
import sys
import threading
import warnings
import weakref

from . import format as fmt

__all__ = ["closed", "opened"]

_open: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Recorder -> its finaliser
_ending: set = set()                    # the writers a finaliser asked to end the run: one
                                        # whose thread ended is dropped
_previous = signal.SIG_DFL              # SIGTERM's handler before ours
_terminating = False                    # our handler is closing the Recorders
# tensortape's modules that run the user's training and hold no lock while it runs
_RUNNERS = {f"{__package__}.{m}" for m in ("script", "_tracker", "integrations")}


def opened(rec, writer, hooks, buffer) -> None:
    """``rec`` is recording into ``writer`` through ``hooks`` and ``buffer``: end it
    at exit, at SIGTERM or when it is collected, if the user does not."""
    end = weakref.finalize(rec, _forgotten, writer, hooks, buffer, rec.store_location)
    end.atexit = False                           # close_at_exit closes it, bounded
    _open[rec] = end
    _install()


def closed(rec) -> None:
    """``rec`` closed itself."""
    end = _open.pop(rec, None)
    if end is not None:
        end.detach()
    if not _open and not _terminating:
        _uninstall()


def close_at_exit() -> None:
    """At interpreter exit, close every Recorder still open as ``interrupted``: a
    script that raised or was interrupted keeps every step it captured.  It runs
    among threading's exit calls, before thread pools (zarr's among them) refuse
    new work, and waits at most each Recorder's ``close_timeout``."""
    _close_all("at exit", nowait=False)


def _close_all(when: str, nowait: bool) -> None:
    """Close every open Recorder ``interrupted`` (``nowait``: as a finaliser
    would), then wait for the writers asked to end."""
    for rec in list(_open):
        try:
            _end_nowait(rec) if nowait else rec.close(fmt.STATUS_INTERRUPTED)
        except BaseException as e:   # never raise here; say it in one line
            _say(f"tensortape: closing {rec.store_location!r} {when} failed: "
                 f"{type(e).__name__}: {e}")
    for writer in list(_ending):
        writer.worker.thread.join(writer.config.close_timeout)
        if writer.worker.thread.is_alive():   # as close() gives up: marked, halted, said
            try:
                writer.give_up()
            except BaseException as e:        # never raise here
                _say(f"tensortape: giving up on a writer {when} failed: {type(e).__name__}: {e}")


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr)
    except Exception:                 # no stderr to say it on
        pass


# --- SIGTERM (see the module) ------------------------------------------------------------
def _install() -> None:
    global _previous
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is _on_sigterm or current in (signal.SIG_IGN, None):
            return                    # ours already; ignored; or not Python's to chain to
        signal.signal(signal.SIGTERM, _on_sigterm)
        _previous = current
    except ValueError:                # not the main thread (Python allows only it)
        pass


def _uninstall() -> None:
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:   # else the user's since
            signal.signal(signal.SIGTERM, _previous)
    except ValueError:                # not the main thread: it stays, and passes the
        pass                          # signal on as the previous handler would


def _on_sigterm(signum, frame) -> None:
    global _terminating
    if callable(_previous):           # the user's handler decides
        _previous(signum, frame)
        return
    if _terminating:                  # again, while closing: the first ends the process
        return
    _terminating = True
    if _open:
        _say("tensortape: terminated (SIGTERM); the run is closed as 'interrupted'")
        _close_all("at SIGTERM", nowait=_inside(frame))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)    # the default action, delivered again
    os.kill(os.getpid(), signal.SIGTERM)


def _inside(frame) -> bool:
    """Whether the interrupted code (``frame`` and its callers) is tensortape's own,
    which may hold one of its locks."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(f"{__package__}.") and name not in _RUNNERS:
            return True
        frame = frame.f_back
    return False


# --- a Recorder not closed ---------------------------------------------------------------
def _end_nowait(rec) -> None:
    """End ``rec`` now as its finaliser would (``_abandon``), without a word."""
    end = _open.pop(rec, None)
    parts = end.detach() if end is not None else None     # (rec, func, args, kwargs)
    if parts is not None:
        writer, hooks, buffer, _ = parts[2]
        _abandon(writer, hooks, buffer)


def _abandon(writer, hooks, buffer) -> None:
    """Remove the hooks, end the open step (unless a thread is inside the step
    buffer now), and ask the writer to end the run ``interrupted``; the exit (or
    the SIGTERM handler) waits for it.  This may run in the middle of any code,
    even code holding one of tensortape's locks, so it takes no lock it could
    wait for and waits for nothing."""
    hooks.detach(wait=False)
    if buffer.state.step is not None and buffer.idle():
        writer.post_nowait(buffer.end())
    writer.close_nowait()
    for ended in [w for w in _ending if not w.worker.thread.is_alive()]:
        _ending.discard(ended)
    _ending.add(writer)


def _forgotten(writer, hooks, buffer, location: str) -> None:
    """A Recorder collected without ``close()``: ``_abandon`` it, from its finaliser,
    and say so."""
    _abandon(writer, hooks, buffer)
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
