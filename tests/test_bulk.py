"""Full tensors on the disk: what the recorder stores is what zarr itself would
store, byte for byte, and reaches the store without zarr's codec pipeline.

The oracles are independent of tensortape: plain forward hooks (what the model
produced), zarr's own reader (``zarr.open_array``), and zarr's own writer: the
same rows written by zarr into an array made from the stored array's own
metadata must give the same files.
"""
import json
import pathlib

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, example, given, settings, strategies as st
from torch import nn

from tensortape import Recorder
from tensortape.recorder import format as fmt

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "bool": torch.bool}


class Emit(nn.Module):
    def __init__(self, k: float, dtype: torch.dtype):
        super().__init__()
        self.k, self.dtype = k, dtype

    def forward(self, x):
        y = x + self.k
        return y > 0 if self.dtype == torch.bool else (y * 100).to(self.dtype)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's stored numbers: bfloat16 as its uint16 bits, the rest as numpy has them."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _record(path, dtype, shape, steps, compression):
    """``steps`` steps of two layers' full tensors; what plain hooks saw, by layer."""
    torch.manual_seed(0)
    model = nn.Sequential(Emit(0.0, dtype), Emit(0.5, dtype))
    seen = {n: [] for n in ("0", "1")}
    for n, m in model.named_children():
        m.register_forward_hook(lambda m, a, out, n=n: seen[n].append(_bits(out.detach().clone())))
    with Recorder(model, path, layers=["0", "1"], capture="activations", tensors_every=1,
                  compression=compression, max_bytes=None) as rec:
        for i in range(steps):
            with rec.step(i), torch.no_grad():
                model(torch.randn(shape))
    return seen


def _chunk_files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "zarr.json"}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(sorted(DTYPES)),
       shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
       steps=st.integers(1, 9),
       compression=st.sampled_from([None, 1, "auto"]))
def test_full_tensors_are_stored_as_zarr_writes_them(tmp_path_factory, dtype, shape, steps,
                                                    compression):
    """Every step's full tensor reads back bit-exactly through zarr's own reader, and
    each data array's chunk files are byte for byte the ones zarr writes for the same
    rows into an array of the same metadata (shape, chunks, codecs, fill value)."""
    tmp = tmp_path_factory.mktemp("bulk")
    path = tmp / "run.zarr"
    seen = _record(str(path), DTYPES[dtype], shape, steps, compression)
    for layer, rows in seen.items():
        where = path / fmt.tensor_group(0, "activations", layer) / "data"
        ours = zarr.open_array(str(where), mode="r")
        assert ours.shape == (steps, *shape)
        got = ours[...]
        for i, want in enumerate(rows):
            assert got[i].tobytes() == want.tobytes(), (layer, i)
        meta = json.loads((where / "zarr.json").read_text())
        oracle = tmp / f"oracle-{layer}"
        oracle.mkdir()
        (oracle / "zarr.json").write_text(json.dumps(meta))
        theirs = zarr.open_array(str(oracle), mode="r+",
                                 config={"write_empty_chunks": True})
        theirs[...] = got
        assert _chunk_files(where) == _chunk_files(oracle), layer


@pytest.mark.parametrize("compression", [None, "auto"])
def test_full_tensors_skip_zarrs_codec_pipeline(tmp_path, monkeypatch, compression):
    """A whole chunk of full tensors is encoded by the recorder and stored in one
    write (zarr's pipeline costs copies into new memory and Python per chunk):
    zarr's array assignment never writes a ``data`` array, and each of its chunk
    files is one store write."""
    from zarr.storage import LocalStore
    assigned, stored = [], []
    setitem, put = zarr.Array.__setitem__, LocalStore.set

    def spy_setitem(self, key, value):
        assigned.append(self.path)
        return setitem(self, key, value)

    async def spy_set(self, key, value, *a, **k):
        stored.append(key)
        return await put(self, key, value, *a, **k)
    monkeypatch.setattr(zarr.Array, "__setitem__", spy_setitem)
    monkeypatch.setattr(LocalStore, "set", spy_set)
    seen = _record(str(tmp_path / "run.zarr"), torch.float32, (64, 1024), 20, compression)
    assert seen and not [p for p in assigned if p.endswith("/data")]
    data = [k for k in stored if "/data/c/" in k]
    files = [p for p in (tmp_path / "run.zarr").rglob("*") if "/data/c/" in str(p) and p.is_file()]
    assert files and len(data) >= len(files)


@pytest.mark.parametrize("compression", [None, "auto"])
def test_rows_read_a_chunk_file_whole_without_zarrs_pipeline(tmp_path, monkeypatch, compression):
    """``run.rows`` reads each full-tensor chunk as one file read, checked and decoded
    by numpy (zarr's pipeline costs a task and copies per chunk): zarr's array
    reads never read a ``data`` array, and the rows, in order, are the ones plain
    hooks saw, bit for bit."""
    from tensortape import open_run
    path = str(tmp_path / "run.zarr")
    seen = _record(path, torch.float32, (3, 5, 16), 11, compression)
    read = []
    getitem = zarr.Array.__getitem__

    def spy(self, key):
        read.append(self.path)
        return getitem(self, key)
    monkeypatch.setattr(zarr.Array, "__getitem__", spy)
    for layer, tensors in seen.items():
        got = [b["x"] for b in open_run(path).rows(layer, shuffle=False, batch_size=7)]
        want = np.concatenate([t.reshape(-1, 16) for t in tensors])
        assert np.concatenate(got).tobytes() == want.tobytes()
    assert not [p for p in read if p.endswith("/data")]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(["float32", "uint16", "bool", "complex64", "int8"]),
       rows=st.integers(0, 30), chunk=st.integers(1, 7), width=st.integers(1, 5),
       level=st.sampled_from([None, 1, -1]), gone=st.sets(st.integers(0, 5), max_size=2),
       lo=st.integers(-35, 35), hi=st.integers(-35, 35) | st.none())
@example(dtype="float32", rows=20, chunk=3, width=2, level=None, gone={2}, lo=4, hi=17)
@example(dtype="complex64", rows=9, chunk=4, width=3, level=1, gone=set(), lo=-6, hi=None)
def test_chunk_file_reads_agree_with_zarrs_reader(tmp_path_factory, dtype, rows, chunk, width,
                                                  level, gone, lo, hi):
    """The reader's chunk-file reads (``analysis._chunks``) give what zarr's own reader
    gives for any slice of rows: within a chunk, across chunks, past the ends, from
    the end, empty; a chunk not stored reads as the fill value."""
    from zarr.codecs import Crc32cCodec, ZstdCodec
    from tensortape.analysis._chunks import rows as chunk_rows
    where = str(tmp_path_factory.mktemp("chunks") / "a")
    compressors = ([] if level is None else [ZstdCodec(level=level)]) + [Crc32cCodec()]
    a = zarr.create_array(where, shape=(rows, width), chunks=(chunk, width), dtype=dtype,
                          fill_value=0, compressors=compressors,
                          config={"write_empty_chunks": True})
    a[...] = np.random.default_rng(rows).integers(0, 100, (rows, width)).astype(dtype)
    for c in gone:
        p = pathlib.Path(where, "c", str(c), "0")
        if p.exists():
            p.unlink()
    a = zarr.open_array(where, mode="r")
    got = chunk_rows(a, slice(lo, hi))
    assert got is not None
    want = a[lo:hi]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_a_chunk_whose_frame_is_shorter_than_the_chunk_is_left_to_zarr(tmp_path):
    """A zstd chunk whose frame decodes to fewer bytes than the array's metadata says
    (its checksum right: written under other metadata) is not read here: the reader
    leaves it to zarr, which refuses it, rather than returning memory it never filled."""
    import google_crc32c
    from numcodecs import Zstd
    from zarr.codecs import Crc32cCodec, ZstdCodec
    from tensortape.analysis._chunks import rows as chunk_rows
    where = str(tmp_path / "a")
    a = zarr.create_array(where, shape=(8, 4), chunks=(4, 4), dtype="float32", fill_value=0,
                          compressors=[ZstdCodec(level=1), Crc32cCodec()],
                          config={"write_empty_chunks": True})
    a[...] = np.arange(32, dtype="float32").reshape(8, 4)
    frame = np.frombuffer(Zstd(1).encode(np.arange(8, dtype="float32").tobytes()), np.uint8)
    crc = np.uint32(google_crc32c.value(frame.tobytes())).tobytes()
    pathlib.Path(where, "c", "1", "0").write_bytes(frame.tobytes() + crc)
    a = zarr.open_array(where, mode="r")
    assert chunk_rows(a, slice(0, 8)) is None
    assert chunk_rows(a, slice(0, 4)).tobytes() == np.arange(16, dtype="float32").tobytes()
    with pytest.raises(Exception):
        a[0:8]                                   # zarr's own reader refuses the chunk
