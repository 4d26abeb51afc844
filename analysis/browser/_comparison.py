"""The two-run page's comparison of one kind and rank, kept while a live run grows.

The statistics' comparison is made at once (no tensor table read:
``_compare.statistics(shapes=False)``) and answers meanwhile; the shared layers'
full-tensor shapes are checked and their full tensors scanned in a thread of its
own, on runs of its own (opened again from their paths: no reader shared with the
requests).  When a run commits more steps, the comparison that follows
(``Comparison.then``) lets the scan under way finish the steps it began on, and
scans only the steps since: a scan that outlasts the time between two commits
still ends, and the answer covers more steps at each.
"""

from __future__ import annotations

import threading

__all__ = ["Comparison"]


def _same_recording(old, new) -> bool:
    """Whether run ``new`` is ``old`` with more commits: the same recording of the
    same run (a resumed or new recording may record its steps again)."""
    return old.attrs.get("created") == new.attrs.get("created") and old.ranks == new.ranks \
        and all(old.state(r).recording == new.state(r).recording for r in old.ranks)


class Comparison:
    """Two runs' ``compare_runs`` of one kind and rank, its full tensors scanned in a
    thread: ``done`` of ``of`` layers so far.  ``before``: the comparison of these
    runs before their last commits (``then``), whose answer it keeps."""

    def __init__(self, a, b, kind: str, rank, rtol: float, before: Comparison | None = None):
        from .._compare import statistics
        self.runs = (a, b)
        self.stats = statistics(a, b, kind, rank=rank, shapes=False)
        self.full = self.error = self.known = None
        self.done, self.of = 0, None
        self._kind, self._rank, self._rtol, self._before = kind, rank, rtol, before
        self._stop, self._followed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._scan, args=(a.path, b.path, rank),
                                        name="tensortape-compare", daemon=True)
        self._thread.start()

    def over(self, a, b) -> bool:
        """Whether this compares the runs ``a`` and ``b`` as opened (not since)."""
        return self.runs[0] is a and self.runs[1] is b

    def then(self, a, b) -> Comparison:
        """The comparison of runs ``a`` and ``b``, this one's runs since changed: it
        follows this one where they are the same recordings with more commits (this
        scan ends with the steps it began on; a scan not begun yet is left to it),
        else starts anew (this one scans no further layer)."""
        if all(_same_recording(o, n) for o, n in zip(self.runs, (a, b))):
            head = self._before         # not begun: the new one waits on what this waits on
            self._followed.set()        # (its thread then ends, its memory with it)
            return Comparison(a, b, self._kind, self._rank, self._rtol, before=head or self)
        self.stop()
        return Comparison(a, b, self._kind, self._rank, self._rtol)

    def _scan(self, a: str, b: str, rank) -> None:
        from .._compare import divergence, with_tensors
        try:
            before = self._before
            if before is not None:
                while before._thread.is_alive() and not self._left():
                    before._thread.join(0.1)
                if self._left():
                    return          # the comparison that follows scans these steps
                self.known, self._before = before.latest(), None
            if self._left():
                return
            ds = with_tensors(self.stats, a, b, self._count, rank, known=self.known)
            self.known, self.full = ds, (ds, divergence(ds, self._rtol))
        except Exception as e:              # answered by the next request
            self.error = e

    def _left(self) -> bool:
        return self._followed.is_set() or self._stop.is_set()

    def _count(self, layers):
        layers = list(layers)
        self.of = len(layers)
        for layer in layers:
            if self._stop.is_set():
                return
            yield layer
            self.done += 1

    def stop(self) -> None:
        """Scan no further layer, nor those before it (this line of comparisons is
        dropped)."""
        self._stop.set()
        before = self._before
        if before is not None:
            before.stop()

    def latest(self):
        """The last whole answer of the full tensors in this line of comparisons (of
        fewer steps while this one scans), or None."""
        before = self._before
        return self.known if before is None else before.latest()

    def answer(self):
        """``(ds, first divergence, pending)``: the whole comparison once it is made
        (pending None), else the statistics' with the full tensors' metrics of the
        steps scanned so far (``covers`` says which), and ``{"done", "of",
        "covered"}``: layers of full tensors scanned, and the steps whose full
        tensors the answer holds."""
        from .._compare import carried, divergence
        if self.error is not None:
            raise self.error
        if self.full is not None:
            return (*self.full, None)
        known = self.latest()
        ds = self.stats if known is None else carried(self.stats, known)
        covered = ds["rel_l2"].attrs["covers"] if "rel_l2" in ds else None
        return ds, divergence(ds, self._rtol), {"done": self.done, "of": self.of,
                                                "covered": covered}
