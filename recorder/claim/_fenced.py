"""A commit's record on S3, written only while no other job wrote it since.

A commit ends with the rank's state, then (rank 0) the run's attributes, each
the ``zarr.json`` of a group.  At an ``s3://`` URL ``Fenced`` writes them with
a PUT conditional on the ETag this job last wrote or read there (``If-Match``;
``If-None-Match: *`` where there was none), learned at attach.  A job that
takes the run over writes those objects anew, so a job that lost its claim
between its commit's read of the claim and its PUT finds the condition failed:
the new owner's record stands, and the loser reads the claim again, finds it
lost, and writes nothing more.  The owner's own condition fails only after
such a loser wrote: the claim read again is still its own, so it writes over
it.  Where the server ignores or refuses the conditions, or the client is too
old to send them, the record is written without them (as on a local disk,
where a write whose check had passed can still land after a takeover).

Runs on the writer thread (commits), and on the training thread at attach
(``fenced``, which learns the ETags) and at close (``mark_interrupted``).
"""

from __future__ import annotations

from collections.abc import Callable

from .. import format as fmt
from ._lockobject import condition_failed

__all__ = ["Fenced", "fenced"]

TRIES = 3                      # an owner's PUT that keeps failing its condition: an error


def fenced(location: str, paths: list[str],
           mine: Callable[[], bool]) -> Fenced | None:
    """A ``Fenced`` for the groups' records at ``paths`` of the store at
    ``location``, their ETags learned now; None where ``location`` is not on S3.
    ``mine()``: whether the claim, read again, is still this job's."""
    location = fmt.location(location)
    if not fmt.is_url(location):
        return None
    import fsspec
    fs, root = fsspec.core.url_to_fs(location)
    if not (hasattr(fs, "call_s3") and hasattr(fs, "split_path")):
        return None
    writer = Fenced(fs, root, mine)
    for path in paths:
        writer.learn(path)
    return writer


class Fenced:
    """``put(path, doc)``: a group's ``zarr.json`` written only while no other job
    wrote it since this one last did (see the module)."""

    def __init__(self, fs, root: str, mine: Callable[[], bool]):
        self.fs, self.root, self.mine = fs, root.rstrip("/"), mine
        self.etags: dict[str, str | None] = {}
        self.conditional = True        # False once the server or client refused a condition

    def _key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path("/".join(p for p in (self.root, path, "zarr.json") if p))
        return bucket, key

    def learn(self, path: str) -> None:
        """The ETag of the record at ``path`` as stored now (None: there is none)."""
        bucket, key = self._key(path)
        try:
            self.etags[path] = self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]
        except FileNotFoundError:
            self.etags[path] = None

    def put(self, path: str, doc: bytes) -> bool:
        """Write ``doc`` as the record at ``path``; False when another job wrote it
        since and the claim is no longer this job's (nothing written)."""
        for _ in range(TRIES):
            if self._put(path, doc):
                return True
            if not self.mine():
                return False
            self.learn(path)           # a job that lost its claim wrote: written over
        raise OSError(f"{self.root}/{path}/zarr.json changed under every try of this job's "
                      f"commit: another writer keeps writing there")

    def _put(self, path: str, doc: bytes) -> bool:
        bucket, key = self._key(path)
        try:
            if self.conditional:
                if path not in self.etags:
                    self.learn(path)
                etag = self.etags[path]
                condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
                try:
                    r = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=doc,
                                        **condition)
                    self.etags[path] = r.get("ETag")
                    return True
                except Exception as e:
                    if condition_failed(e):
                        del self.etags[path]
                        return False
                    self.conditional = False      # not supported here: as a local disk
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=doc)
            return True
        finally:
            self.fs.invalidate_cache(f"{bucket}/{key}")
