"""The claim at an fsspec URL: S3's conditional writes, or the best a file system has.

At an ``s3://`` URL the claim is created with a conditional PUT
(``If-None-Match: *``) and read back; one whose owner is gone is taken over
with a PUT conditional on its ETag (``If-Match``), and deleted at release
under the same condition: of two jobs at once, one wins.  The heartbeat
rewrites the object (its LastModified, and the time written in it).  A server
that does not support a condition (501, or a 400 for a header it does not
know), or a client too old to send one (botocore's ``ParamValidationError``),
is written without it: a claim taken so is written, given ``SETTLE_S`` and
read back, the read-back deciding.  On other fsspec file systems the claim is
created with ``open(mode="xb")`` where the file system has it, else by
checking, writing, waiting ``SETTLE_S`` and reading back, and taken over by
writing, waiting and reading back: two jobs whose writes come further apart
than that window there can both believe they own the store.

Runs on the thread that calls it: the training thread at attach
(``acquire``), the ``tensortape-claim`` thread and the writer thread (``beat``,
serialised by ``_heartbeat.Heartbeat``'s lock), whichever thread releases the
claim, and the training thread when ``mode="w"`` clears a run (``drop_folder``).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import NamedTuple

from .. import format as fmt
from ._holder import LOCK_FILE, TRIES, Held, Holder, beaten, parse_claim

__all__ = ["ObjectLock", "condition_failed", "drop_folder"]

SETTLE_S = 1.0                 # fsspec without exclusive create: write, wait, read back


def _s3_error(e: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status behind an s3fs error."""
    seen = 0
    while e is not None and seen < 8:
        r = getattr(e, "response", None)
        if isinstance(r, dict):
            return (str(r.get("Error", {}).get("Code", "")),
                    r.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        e, seen = e.__cause__ or e.__context__, seen + 1
    return "", None


def _precondition(e: BaseException) -> bool:
    code, status = _s3_error(e)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412) \
        or "pre-condition" in str(e).lower()


def _unsupported(e: BaseException) -> bool:
    """The server answered, but not to the condition: it does not support it
    (501, or a 400 for a header it does not know); not a network error."""
    code, status = _s3_error(e)
    return not _precondition(e) and (status in (400, 501) or code in (
        "NotImplemented", "InvalidArgument", "InvalidRequest"))


def _old_client(e: BaseException) -> bool:
    """The client refused the condition before sending it (a botocore too old to
    know ``IfMatch`` or ``IfNoneMatch``)."""
    return isinstance(e, TypeError) or type(e).__name__ == "ParamValidationError"


def condition_failed(e: BaseException) -> bool:
    """What a conditional request that raised ``e`` means: True, its condition
    failed (the object changed or is gone); False, the server or the client does
    not support the condition (go on without it); anything else is raised again."""
    if isinstance(e, FileNotFoundError) or _precondition(e):
        return True
    if not _unsupported(e) and not _old_client(e):
        raise e
    return False


def drop_folder(fs, path: str) -> None:
    """Remove the empty "folder" an object store may keep of ``path`` once its
    objects are deleted (SeaweedFS does; zarr would list it and warn)."""
    if not hasattr(fs, "_call_s3"):
        return
    bucket, key, _ = fs.split_path(path.rstrip("/"))
    try:
        fs.call_s3("delete_object", Bucket=bucket, Key=key + "/")
    except Exception:
        pass
    fs.invalidate_cache(path)


class Stored(NamedTuple):
    """A claim object as read at once: its bytes, ETag (S3 only) and mtime."""
    data: bytes
    etag: str | None
    mtime: float

    def holder(self) -> Holder:
        return parse_claim(self.data, self.mtime)


class ObjectLock:
    """The claim object of the store at ``location``; ``held`` while this job has it."""

    def __init__(self, location: str):
        import fsspec
        self.fs, root = fsspec.core.url_to_fs(location)
        self.key = f"{root.rstrip('/')}/{fmt.CLAIM_NAME}/{LOCK_FILE}"
        self.s3 = hasattr(self.fs, "_call_s3") and hasattr(self.fs, "split_path")
        self.token = ""
        self.held = False
        self.sure = True               # the last ``_put`` was conditional (or exclusive)

    def _get(self) -> Stored | None:
        """The claim as stored now; None if there is none."""
        if self.s3:
            from fsspec.asyn import sync
            bucket, key, _ = self.fs.split_path(self.key)

            async def get():
                try:
                    r = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                except FileNotFoundError:
                    return None
                try:
                    data = await r["Body"].read()
                finally:
                    r["Body"].close()
                return Stored(data, r.get("ETag"), r["LastModified"].timestamp())
            return sync(self.fs.loop, get)
        try:
            data = self.fs.cat_file(self.key)
            info = self.fs.info(self.key)
        except FileNotFoundError:
            return None
        mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
        if isinstance(mtime, datetime):
            mtime = mtime.timestamp()
        return Stored(data, None, float(mtime))

    def read(self) -> Holder | None:
        """The claim there, or None if there is none."""
        got = self._get()
        return None if got is None else got.holder()

    def _put(self, doc: bytes, etag: str | None) -> bool:
        """Overwrite the claim only if it is still the object ``etag`` names (where
        the store cannot make that a condition, ``sure`` is False after it)."""
        self.sure = True
        if self.s3 and etag:
            bucket, key, _ = self.fs.split_path(self.key)
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=doc, IfMatch=etag)
                return True
            except Exception as e:
                if condition_failed(e):
                    return False
            finally:
                self.fs.invalidate_cache(self.key)
        self.fs.pipe_file(self.key, doc)   # no conditional overwrite: the read-back decides
        self.fs.invalidate_cache(self.key)
        self.sure = False
        return True

    def _settled(self) -> bool:
        """After an unconditional write: wait for any other writer's to land first."""
        if not self.sure:
            time.sleep(SETTLE_S)
        return True

    def _create(self, doc: bytes) -> bool:
        """Write the claim only if there is none; False if there is one."""
        try:
            if self.s3:
                self.fs.pipe_file(self.key, doc, mode="create")    # If-None-Match: *
            else:
                with self.fs.open(self.key, "xb") as f:
                    f.write(doc)
            return True
        except FileExistsError:
            return False
        except Exception as e:
            if self.s3 and condition_failed(e):
                return False               # (else no If-None-Match there: as below)
        finally:
            self.fs.invalidate_cache(self.key)
        if self.fs.exists(self.key):      # no exclusive create: check, write, wait, read back
            return False
        self.fs.pipe_file(self.key, doc)
        time.sleep(SETTLE_S)
        return True

    def _mine(self) -> bool:
        got = self._get()
        return got is not None and got.holder().token == self.token

    def acquire(self, doc: bytes, token: str) -> None:
        """Write the claim ``doc`` (whose token is ``token``) if there is none or
        its owner is gone; else raise ``Held``."""
        self.token = token
        for _ in range(TRIES):
            # a look first: a server that ignores If-None-Match would overwrite a claim
            if self._get() is None and self._create(doc) and self._mine():
                self.held = True
                return
            got = self._get()
            if got is None:                # released meanwhile
                continue
            h = got.holder()
            if h.token == token:
                self.held = True
                return
            if h.alive():
                raise Held(h)
            if self._put(doc, got.etag) and self._settled() and self._mine():   # gone: taken over
                self.held = True
                return
        raise Held(self.read() or Holder.unreadable())

    def _lost(self) -> tuple[str | None, Stored | None]:
        """Why the claim is no longer this job's (or None), and the claim as read."""
        if not self.held:
            return "released", None
        got = self._get()
        if got is None:
            return f"its lock {self.key!r} was deleted", None
        h = got.holder()
        return (None if h.token == self.token else f"taken over by {h.describe()}"), got

    def check(self) -> str | None:
        """Why the claim is no longer this job's, or None: one GET."""
        return self._lost()[0]

    def beat(self) -> str | None:
        """Rewrite the claim's heartbeat; why it is no longer this job's, or None."""
        why, got = self._lost()
        if why is None and not self._put(beaten(got.data), got.etag):
            return "taken over while its heartbeat was written"
        return why

    def release(self) -> bool:
        """Delete the claim if it is still this job's; True if this call did."""
        if not self.held:
            return False
        self.held = False
        got = self._get()
        if got is None or got.holder().token != self.token:
            return False
        if self.s3 and got.etag:
            bucket, key, _ = self.fs.split_path(self.key)
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=got.etag)
            except Exception as e:
                if condition_failed(e):
                    return False
                self.fs.rm_file(self.key)
        else:
            self.fs.rm_file(self.key)
        drop_folder(self.fs, self.key.rsplit("/", 1)[0])
        self.fs.invalidate_cache()
        return True
