"""Never lose a user's data: ``mode`` deletes only what tensortape wrote, and says so."""
import os

import pytest
import torch

from tensortape.analysis import open_run
from tensortape.recorder import Recorder, StoreExistsError, StoreFormatError, StoreNotFoundError
from conftest import InplaceMLP, has_hooks


def tree(path) -> dict:
    """Every file under ``path`` (links not followed) with its bytes, and every link."""
    out = {}
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, path)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = f.read()
            else:
                out[rel] = "dir"
    return out


def record(store, mode="w-", steps=1):
    model = InplaceMLP()
    with Recorder(model, store, layers="fc1", mode=mode, tensors_every=1, stats_every=1) as rec:
        for _ in range(steps):
            with rec.step():
                model(torch.randn(2, 8)).sum().backward()
    return model


def user_files(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "important.txt").write_text("a week of notes")
    (d / "sub").mkdir()
    (d / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return d


def case_path(kind, tmp_path, monkeypatch) -> str:
    """A store location holding something that is not a tensortape run."""
    if kind == "user folder":
        return str(user_files(tmp_path / "precious"))
    if kind == "current directory":
        monkeypatch.chdir(user_files(tmp_path / "cwd"))
        return "."
    if kind == "empty current directory":
        (tmp_path / "cwd").mkdir()
        monkeypatch.chdir(tmp_path / "cwd")
        return "."
    if kind == "parent of the current directory":
        user_files(tmp_path / "up")
        (tmp_path / "up" / "down").mkdir()
        monkeypatch.chdir(tmp_path / "up" / "down")
        return ".."
    if kind == "home":
        monkeypatch.setenv("HOME", str(user_files(tmp_path / "home")))
        return os.path.expanduser("~")
    if kind == "a file":
        (tmp_path / "f.zarr").write_text("not a store")
        return str(tmp_path / "f.zarr")
    if kind == "link to a user folder":
        os.symlink(user_files(tmp_path / "precious"), tmp_path / "link")
        return str(tmp_path / "link")
    if kind == "broken link":
        os.symlink(tmp_path / "nowhere", tmp_path / "link")
        return str(tmp_path / "link")
    if kind == "run with user files beside it":
        record(str(tmp_path / "run.zarr"))
        (tmp_path / "run.zarr" / "notes.txt").write_text("mine")
        return str(tmp_path / "run.zarr")
    raise AssertionError(kind)


CASES = ["user folder", "current directory", "empty current directory",
         "parent of the current directory", "home", "a file", "link to a user folder",
         "broken link", "run with user files beside it"]


@pytest.mark.parametrize("mode", ["w", "w-"])
@pytest.mark.parametrize("kind", CASES)
def test_what_tensortape_did_not_write_is_never_deleted(tmp_path, monkeypatch, kind, mode):
    path = case_path(kind, tmp_path, monkeypatch)
    before = tree(tmp_path)
    model = InplaceMLP()
    with pytest.raises(StoreExistsError) as e:
        Recorder(model, path, mode=mode, tensors_every=1, stats_every=1)
    msg = str(e.value)
    assert "\n" not in msg and "will not delete" in msg and "choose a new path" in msg, msg
    assert "mode='w'" not in msg            # it would not be safe to follow
    assert tree(tmp_path) == before and not has_hooks(model)
    with pytest.raises(StoreFormatError, match="appends only to a tensortape run"):
        Recorder(model, path, mode="a", tensors_every=1, stats_every=1)


def test_mode_w_overwrites_a_run_and_nothing_beside_it(tmp_path):
    user_files(tmp_path / "keep")
    store = str(tmp_path / "run.zarr")
    record(store, steps=3)
    with pytest.raises(StoreExistsError, match="pass mode='w' to overwrite it"):
        Recorder(InplaceMLP(), store, tensors_every=1, stats_every=1)               # the suggestion is safe here: a run
    record(store, mode="w", steps=1)                 # ... and following it works
    assert open_run(store).steps().tolist() == [0]
    assert sorted(os.listdir(store)) == ["rank0", "zarr.json"]
    assert (tmp_path / "keep" / "important.txt").read_text() == "a week of notes"


def test_mode_w_uses_an_empty_folder_and_overwrites_a_run_through_a_link(tmp_path):
    (tmp_path / "empty").mkdir()
    record(str(tmp_path / "empty"), mode="w-")                 # an empty folder is no store
    assert open_run(str(tmp_path / "empty")).steps().tolist() == [0]
    record(str(tmp_path / "real.zarr"), steps=2)
    os.symlink(tmp_path / "real.zarr", tmp_path / "link.zarr")
    record(str(tmp_path / "link.zarr"), mode="w", steps=1)
    assert os.path.islink(tmp_path / "link.zarr")
    assert open_run(str(tmp_path / "real.zarr")).steps().tolist() == [0]


def test_append_needs_a_run(tmp_path):
    with pytest.raises(StoreNotFoundError, match="mode='w-' to create it"):
        Recorder(InplaceMLP(), str(tmp_path / "missing.zarr"), mode="a", tensors_every=1, stats_every=1)


def test_an_s3_prefix_holding_other_objects_is_never_cleared(s3_server):
    import s3fs
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]},
                           skip_instance_cache=True)
    bucket = s3_server.removeprefix("s3://")
    fs.pipe(f"{bucket}/precious/important.txt", b"a week of notes")
    url = f"{s3_server}/precious"
    for mode in ("w", "w-"):
        with pytest.raises(StoreExistsError, match="important.txt.*will not delete"):
            Recorder(InplaceMLP(), url, mode=mode, tensors_every=1, stats_every=1)
    fs.invalidate_cache()
    assert fs.cat(f"{bucket}/precious/important.txt") == b"a week of notes"
    run_url = f"{s3_server}/run.zarr"
    record(run_url, steps=2)
    record(run_url, mode="w", steps=1)
    assert open_run(run_url).steps().tolist() == [0]
