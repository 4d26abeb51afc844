"""What is at a store location, and opening its root for writing.

Before anything is created, ``check_mode`` says what a location holds
(``look``: nothing, an empty folder, a tensortape run and nothing else, or
something else) and refuses a ``mode`` that cannot apply there: tensortape
never deletes or overwrites what it did not write, and no mode touches a run
that a live job has claimed (``_lock.live_holder``).  ``open_root`` then opens
the root group: rank 0 applies the mode (``"w"`` deletes a run's own entries
and nothing else), other ranks open what rank 0 prepared.  ``run_claim`` reads
under whose claim the root was last committed (``fmt.CLAIM_TOKEN``).

Runs on the training thread at attach (rank 0 under its claim, before the
writer thread starts), on the caller's thread for the tools (``tensortape
record``'s early check, ``migrate``), and on the writer thread (``run_claim``,
a rank's fence).  No state.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import shutil
from dataclasses import dataclass
from typing import Literal

import zarr

from .. import format as fmt
from ._holder import refusal
from ._lock import live_holder
from ._lockobject import drop_folder
from ..errors import (ConfigError, StoreExistsError, StoreFormatError, StoreNotFoundError,
                     argument)

__all__ = ["Found", "Contents", "Mode", "check_mode", "look", "open_root", "run_claim"]

Mode = Literal["w", "w-", "a"]     # overwrite a run, create only, append to a run


class Contents(enum.Enum):
    """What a store location holds."""
    MISSING = "missing"            # nothing there
    EMPTY = "empty"                # a folder or prefix with nothing in it but a claim or a
                                   # killed start's temporary file
    RUN = "run"                    # a tensortape store and nothing else
    OTHER = "other"                # anything else


@dataclass(frozen=True)
class Found:
    """What a store location holds (``what``): for ``Contents.RUN``, ``own`` lists its
    entries; for ``Contents.OTHER``, ``detail`` says what it is.  ``claimed``: a job's
    claim (``tensortape.lock``) is there, live or not."""
    what: Contents
    detail: str = ""
    own: tuple[str, ...] = ()
    claimed: bool = False


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _is_run(raw: bytes | None) -> bool:
    try:
        return "tensortape_format" in json.loads(raw)["attributes"]
    except Exception:
        return False


def _classify(entries: list[str], ours: set[str], root_json: bytes | None) -> Found:
    """A location's entries -> what it holds (``ours``: the entries tensortape may
    have written: ``zarr.json``, and rank groups and the claim that are real folders)."""
    claimed = fmt.CLAIM_NAME in ours
    if all(fmt.is_partial(e) or (e == fmt.CLAIM_NAME and claimed) for e in entries):
        return Found(Contents.EMPTY, claimed=claimed)      # nothing, or a start claimed or killed
    if not _is_run(root_json):
        return Found(Contents.OTHER, f"holds files that are not a tensortape run ({_shown(entries)})")
    theirs = [e for e in entries if e not in ours]
    if theirs:
        return Found(Contents.OTHER,
                     f"holds a tensortape run with other files beside it ({_shown(theirs)})")
    return Found(Contents.RUN, own=tuple(entries), claimed=claimed)


def _look_local(path: str) -> Found:
    if os.path.islink(path) and not os.path.exists(path):
        return Found(Contents.OTHER, "is a broken symbolic link")
    if not os.path.exists(path):
        return Found(Contents.MISSING)
    if not os.path.isdir(path):
        return Found(Contents.OTHER, "is a file")
    real, cwd = os.path.realpath(path), os.path.realpath(os.getcwd())
    if real == cwd:
        return Found(Contents.OTHER, "is the current directory")
    if cwd.startswith(real.rstrip(os.sep) + os.sep):
        return Found(Contents.OTHER, "is a folder that holds the current directory")
    if real == os.path.realpath(os.path.expanduser("~")):
        return Found(Contents.OTHER, "is your home directory")
    entries = sorted(os.listdir(path))
    ours = {e for e in entries if fmt.is_own_entry(e) and not os.path.islink(os.path.join(path, e))
            and os.path.isdir(os.path.join(path, e)) == (e != "zarr.json" and not fmt.is_partial(e))}
    root_json = None
    if "zarr.json" in ours:
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            root_json = f.read(1 << 20)
    return _classify(entries, ours, root_json)


def _look_url(location: str) -> Found:
    import fsspec
    fs, root = fsspec.core.url_to_fs(location)
    root = root.rstrip("/")
    fs.invalidate_cache()
    if fs.isfile(root):
        return Found(Contents.OTHER, "is an object (a file)")
    try:
        listed = fs.ls(root, detail=True)
    except FileNotFoundError:
        return Found(Contents.MISSING)
    kinds = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type") for e in listed}
    # an object store has no folders: a "directory" that holds no object is nothing
    entries = sorted(n for n, t in kinds.items()
                     if t != "directory" or fmt.is_own_entry(n) or fs.find(f"{root}/{n}"))
    if not entries:
        return Found(Contents.MISSING)
    ours = {e for e in entries if fmt.is_own_entry(e)
            and (kinds[e] == "directory") == (e != "zarr.json" and not fmt.is_partial(e))}
    root_json = fs.cat(f"{root}/zarr.json") if "zarr.json" in ours else None
    return _classify(entries, ours, root_json)


def look(location) -> Found:
    """What is at a store location (a local path or an fsspec URL)."""
    location = os.fspath(location)
    return _look_url(location) if fmt.is_url(location) else _look_local(location)


def run_claim(location) -> str | None:
    """The token of the claim under which the run's root at ``location`` was last
    committed (``fmt.CLAIM_TOKEN``); None where there is no root or no token."""
    location = fmt.location(os.fspath(location))
    try:
        if fmt.is_url(location):
            import fsspec
            fs, root = fsspec.core.url_to_fs(location)
            fs.invalidate_cache()
            raw = fs.cat_file(f"{root.rstrip('/')}/zarr.json")
        else:
            with open(os.path.join(location, "zarr.json"), "rb") as f:
                raw = f.read()
    except FileNotFoundError:
        return None
    try:
        token = json.loads(raw)["attributes"].get(fmt.CLAIM_TOKEN)
    except Exception:
        return None
    return token if isinstance(token, str) else None


def check_mode(location, mode: Mode, claimed: str = "") -> Found:
    """Raise now, before anything is created, if ``mode`` cannot apply to
    ``location``; else say what is there.  Only a tensortape run (and nothing
    beside it) may be overwritten: tensortape never deletes what it did not write,
    and no mode touches a run that a live job has claimed (``_lock.live_holder``;
    ``claimed``: the token of this job's own claim, which is no obstacle)."""
    location = os.fspath(location)
    found = look(location)
    if found.what is Contents.OTHER:
        if mode == "a":
            raise StoreFormatError(f"{location!r} {found.detail}; {argument('mode', 'a')} appends "
                                   f"only to a tensortape run: pass the path of a recorded run")
        raise StoreExistsError(f"{location!r} {found.detail}; tensortape will not delete or "
                               f"overwrite what it did not write: choose a new path for the run "
                               f"(a missing or empty folder)")
    if found.claimed:
        holder = live_holder(location, ignore=claimed)
        if holder is not None:
            raise StoreExistsError(refusal(location, mode, holder))
    if mode == "w-" and found.what is Contents.RUN:
        raise StoreExistsError(f"store {location!r} already exists (a tensortape run); pass "
                               f"{argument('mode', 'w')} to overwrite it or "
                               f"{argument('mode', 'a')} to append further steps")
    if mode == "a" and found.what is not Contents.RUN:
        raise StoreNotFoundError(f"store {location!r} does not exist, so {argument('mode', 'a')} "
                                 f"cannot append to it; use {argument('mode', 'w-')} to create it")
    return found


def _clear(location: str, entries: tuple[str, ...]) -> None:
    """Delete a run's own entries (``mode="w"``), and nothing else: never the claim
    (this job's, taken before)."""
    entries = tuple(e for e in entries if e != fmt.CLAIM_NAME)
    if fmt.is_url(location):
        import fsspec
        fs, root = fsspec.core.url_to_fs(location)
        for e in entries:
            fs.rm(f"{root.rstrip('/')}/{e}", recursive=True)
            if e != "zarr.json":
                drop_folder(fs, f"{root.rstrip('/')}/{e}")
        fs.invalidate_cache()
        return
    for e in entries:
        p = os.path.join(location, e)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def open_root(location, mode: Mode, rank: int = 0, attributes: dict | None = None,
              claimed: str = "") -> zarr.Group:
    """Open the root group of a store for writing.  Rank 0 applies the run's
    ``mode`` (``"w"`` deletes a run's own entries; the new root's ``zarr.json`` is
    written once, with ``attributes``); other ranks open what it prepared.

    ``claimed``: the token of rank 0's claim on the store (taken first), which
    makes what is seen here this job's to change.  Without one (tools that own the
    store otherwise) a live job's claim still refuses.  Every refusal is a
    ``StoreExistsError``, ``StoreNotFoundError``, ``StoreFormatError`` or
    ``ConfigError``."""
    location = os.fspath(location)
    if rank != 0:
        try:
            return zarr.open_group(location, mode="r+")
        except FileNotFoundError as e:
            raise StoreNotFoundError(f"rank {rank} found no store at {location!r} that rank 0 "
                                     f"prepared: {e}") from e
    found = check_mode(location, mode, claimed)
    try:
        if mode == "a":
            root = zarr.open_group(location, mode="a")
            version = root.attrs.get("tensortape_format")
            if isinstance(version, int) and version < fmt.FORMAT_VERSION:
                raise ConfigError(f"{location!r} is a format-{version} store; appending needs "
                                  f"format {fmt.FORMAT_VERSION}: convert it first with `tensortape "
                                  f"migrate {location} NEW` and append to NEW")
            return root
        if found.what is Contents.RUN:
            _clear(location, found.own)
        elif found.what is Contents.EMPTY and not fmt.is_url(location) and os.path.isdir(location):
            for name in os.listdir(location):        # zarr's temporary file of a killed start
                if fmt.is_partial(name):
                    os.remove(os.path.join(location, name))
        # under a claim "a": what is left is the claim, and it is ours.  Else locally
        # "w-": zarr's "w" would delete the folder itself (a link's target too); an
        # object store keeps empty "folders" of what was cleared, which "w" removes
        create = "a" if claimed else ("w" if fmt.is_url(location) else "w-")
        return zarr.open_group(location, mode=create, zarr_format=3, attributes=attributes or {})
    except (StoreExistsError, StoreNotFoundError, StoreFormatError, ConfigError):
        raise
    except OSError as e:                     # zarr's FileExistsError: something appeared
        if not isinstance(e, FileExistsError) and e.errno not in (
                errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
        raise StoreExistsError(f"store {location!r} changed while {argument('mode', mode)} prepared it "
                               f"(another job writes there?): {e}") from e
