"""Recorded activations as a data set (``run.rows``, ``run.dataset``), against an
oracle: plain forward hooks on the same model, in the same steps, and the
token ids and masks the loop fed it.

The run is recorded once (a module fixture) with small data chunks (one step's
tensor a chunk), so that chunks, workers and the shuffle buffer have something
to split; its batches change shape, so the table holds padding."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from tensortape import Recorder, open_run
from tensortape.recorder.errors import ConfigError

from ranks import PREAMBLE, run_ranks

SHAPES = ((3, 7), (2, 5), (1, 7), (3, 4))        # (batch, sequence) by turns: padded rows
STEPS, MICROS, VOCAB, D = 12, 2, 40, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, attention_mask=None, temperature=None):
        h = self.emb(input_ids)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        out = self.head(h)
        return out if temperature is None else out / temperature


def record(store, steps=STEPS):
    """Record ``blocks.0``'s activations and the root's integer inputs; the
    oracle: (step, micro, sequence, position) -> (row, token, mask)."""
    model = TinyLM()
    truth, box = {}, {}
    model.blocks[0].register_forward_hook(
        lambda m, a, out: box.__setitem__("out", out.detach().clone()))
    gen = torch.Generator().manual_seed(1)
    with Recorder(model, store, layers="blocks.0", capture=("activations", "batch"),
                  tensors_every=1, max_bytes=None, compression=None, stats_every=1) as rec:
        for s in range(steps):
            with rec.step(s):
                for m in range(MICROS):
                    b, t = SHAPES[(s * MICROS + m) % len(SHAPES)]
                    ids = torch.randint(0, VOCAB, (b, t), generator=gen)
                    mask = (torch.rand(b, t, generator=gen) > 0.3).long()
                    model(ids, attention_mask=mask,
                          temperature=torch.tensor(2.0)).logsumexp(-1).mean().backward()
                    out = box["out"].numpy()
                    for i in range(b):
                        for j in range(t):
                            truth[(s, m, i, j)] = (out[i, j], int(ids[i, j]), int(mask[i, j]))
    return truth


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("dataset") / "run.zarr")
    with pytest.MonkeyPatch.context() as mp:        # a chunk a step (the default: ~8 MB)
        mp.setattr("tensortape.recorder.store._layout.CHUNK_BYTES", 2048)
        truth = record(store)
    return store, truth


def key(item) -> tuple:
    return (item["step"], item["micro"], item["sequence"], item["position"])


def as_rows(items) -> list[dict]:
    """Items (single rows or batches, numpy or torch) as single rows of numpy."""
    out = []
    for it in items:
        it = {c: (v.numpy() if isinstance(v, torch.Tensor) else v) for c, v in it.items()}
        if np.ndim(it["step"]) == 0:
            out.append(it)
            continue
        for i in range(len(it["step"])):
            out.append({c: (v[i] if c == "x" else int(v[i])) for c, v in it.items()})
    return out


def check_against(truth, rows, masked=False):
    """Every row of the oracle (less masked positions) once, each as recorded."""
    want = {k for k, (_, _, m) in truth.items() if m or not masked}
    keys = [key(r) for r in rows]
    assert len(keys) == len(set(keys)), "a row was given twice"
    assert set(keys) == want
    for r in rows:
        x, token, _ = truth[key(r)]
        assert np.array_equal(r["x"], x)
        assert r.get("token", token) == token and r["rank"] == 0


def test_in_order_every_row_once_as_the_hooks_saw_it_and_no_padding(recorded):
    store, truth = recorded
    run = open_run(store)
    # the float input (temperature) is not stored; a positional one is (root):0
    assert run.tensor_layers("inputs") == ["(root):0", "(root):attention_mask"]
    rows = run.rows("blocks.0", shuffle=False)
    assert len(rows) == len(truth) and not rows.unmatched
    got = list(rows)
    check_against(truth, got)
    assert [key(r) for r in got] == sorted(truth)            # in order: step, micro, ...
    assert not any(np.isnan(r["x"]).any() for r in got)
    assert run.tensor("blocks.0").shape[1:3] == (3, 7)       # the table is padded


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), buffer_rows=st.integers(1, 60),
       batch_size=st.one_of(st.none(), st.integers(1, 13)), masked=st.booleans(),
       tokens=st.sampled_from(["auto", None]),
       steps=st.one_of(st.none(), st.tuples(st.integers(0, STEPS), st.integers(0, STEPS))))
def test_shuffled_rows_are_each_row_once_within_steps_and_mask(recorded, seed, buffer_rows,
                                                                batch_size, masked, tokens, steps):
    store, truth = recorded
    chosen = None if steps is None else slice(min(steps), max(steps))
    if chosen is not None:
        truth = {k: v for k, v in truth.items() if chosen.start <= k[0] < chosen.stop}
    rows = open_run(store).rows("blocks.0", seed=seed, buffer_rows=buffer_rows,
                                batch_size=batch_size, steps=chosen, tokens=tokens,
                                mask="(root):attention_mask" if masked else None)
    items = list(rows)
    if batch_size is not None:
        assert all(len(b["x"]) == batch_size for b in items[:-1])
    assert all(("token" in b) == (tokens is not None) for b in items)
    check_against(truth, as_rows(items), masked)


def test_the_order_is_the_seed_and_epoch_s(recorded):
    store, _ = recorded
    run = open_run(store)

    def order(seed, epoch=0):
        rows = run.rows("blocks.0", seed=seed, buffer_rows=32)
        rows.set_epoch(epoch)
        return [key(r) for r in rows]

    first = order(0)
    assert order(0) == first
    assert order(1) != first and sorted(order(1)) == sorted(first)
    assert order(0, epoch=1) != first
    assert [key(r) for r in run.rows("blocks.0", shuffle=False)] != first


def test_the_rows_held_are_the_buffer_and_one_chunk(recorded):
    """Rows read but not yet given out never exceed ``buffer_rows`` plus the
    chunk being read: chunks are read as the rows go out, not before."""
    store, _ = recorded
    rows = open_run(store).rows("blocks.0", buffer_rows=10, seed=5)
    assert len(rows.chunks) >= STEPS * MICROS
    read, largest = [0], [0]
    reader = rows.read

    def counting(chunk):
        block = reader(chunk)
        read[0] += len(block["x"])
        largest[0] = max(largest[0], len(block["x"]))
        return block

    rows.read = counting
    for given_out, _ in enumerate(rows, 1):
        assert read[0] - given_out <= 10 + largest[0]
    assert read[0] == given_out


@settings(max_examples=10, deadline=None)
@given(workers=st.integers(1, 5), seed=st.integers(0, 100))
def test_workers_split_the_chunks_nothing_twice_nothing_missed(recorded, workers, seed):
    store, truth = recorded
    rows = open_run(store).rows("blocks.0", seed=seed, buffer_rows=8)
    seen = collections.Counter(key(r) for w in range(workers) for r in rows.iterate(w, workers))
    assert set(seen) == set(truth) and set(seen.values()) == {1}


@pytest.mark.parametrize("batch_size", [None, 16])
def test_a_dataloader_with_workers_gives_every_row_once(recorded, batch_size):
    store, truth = recorded
    ds = open_run(store).dataset("blocks.0", batch_size=batch_size, buffer_rows=16, seed=2)
    assert isinstance(ds, torch.utils.data.IterableDataset) and len(ds) == len(truth)
    loader = torch.utils.data.DataLoader(ds, num_workers=2,
                                         batch_size=8 if batch_size is None else None)
    batches = list(loader)
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].shape[1] == D for b in batches)
    check_against(truth, as_rows(batches))


def test_bad_choices_are_one_line_naming_the_fix(recorded):
    store, _ = recorded
    run = open_run(store)
    with pytest.raises(ConfigError, match="buffer_rows=0"):
        run.rows("blocks.0", buffer_rows=0)
    with pytest.raises(ConfigError, match="not the 1 leading axes"):
        run.rows("(root):0", kind="inputs", tokens="(root):0")
    with pytest.raises(ConfigError, match="capture"):
        Recorder(TinyLM(), store + "x", capture=("activations", "tokens"), stats_every=1)


def test_the_numpy_rows_import_no_torch(recorded):
    store, truth = recorded
    code = ("import sys\nfrom tensortape import open_run\n"
            f"rows = list(open_run({store!r}).rows('blocks.0', batch_size=50))\n"
            "print(sum(len(r['x']) for r in rows), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(len(truth)), "False"]


def test_rows_from_s3(s3_server):
    url = f"{s3_server}/rows.zarr"
    truth = record(url, steps=3)
    check_against(truth, as_rows(open_run(url).dataset("blocks.0", buffer_rows=20, seed=1)))


def test_the_sae_sample_walks_the_whole_path(tmp_path):
    """sample_runs/sae.py, shortened: a GPT-2 recorded with its token ids, a sparse
    autoencoder trained on the rows, its loss drawn."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "sample_runs", "sae.py")
    spec = importlib.util.spec_from_file_location("sae_sample", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    got = sample.main(str(tmp_path), steps=6, epochs=2)
    sae = got["sae"]
    assert sae["rows"] == 6 * sample.BATCH * sample.SEQ
    assert sae["tokens_seen"] <= set(range(sample.VOCAB)) and len(sae["tokens_seen"]) > 10
    assert sae["fvu"][-1] < sae["fvu"][0]
    assert (tmp_path / "sae.png").stat().st_size > 0


def test_bfloat16_rows_are_the_stored_bits_decoded_and_the_dataset_pickles(tmp_path):
    import pickle
    model = nn.Sequential(nn.Linear(8, 8))
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(
        out.detach().to(torch.bfloat16).float().numpy().reshape(-1, 8)))
    with Recorder(model, str(tmp_path / "bf.zarr"), layers="0", capture="activations",
                  tensors_every=1, tensor_dtype="bfloat16", max_bytes=None, stats_every=1) as rec:
        for s in range(3):
            with rec.step(s):
                model(torch.randn(2, 5, 8)).sum().backward()
    run = open_run(str(tmp_path / "bf.zarr"))
    got = np.stack([r["x"] for r in run.rows("0", shuffle=False)])
    assert got.dtype == np.float32 and np.array_equal(got, np.concatenate(seen))
    ds = pickle.loads(pickle.dumps(run.dataset("0", batch_size=4)))     # a spawned worker's copy
    assert sum(len(b["x"]) for b in ds) == len(got)


MIXED_RANKS = PREAMBLE + """
model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
capture = ("activations", "batch") if rank == 0 else ("activations",)
with Recorder(model, store, layers="1", capture=capture, tensors_every=1, max_bytes=None, stats_every=1) as rec:
    for s in range(3):
        with rec.step(s):
            model(torch.randint(0, 10, (2, 3))).sum().backward()
dist.destroy_process_group()
"""


def test_token_ids_held_by_one_rank_of_two_give_every_row_the_same_fields(tmp_path):
    """tokens="auto" across ranks: a row has a ``token`` only where every rank chosen
    holds token ids, so items (and a DataLoader's batches of them) keep one form."""
    store = str(tmp_path / "run.zarr")
    assert run_ranks(MIXED_RANKS, store, tmp_path) == [0, 0]
    run = open_run(store)
    both = list(run.rows("1", shuffle=False))
    assert len(both) == 2 * 3 * 2 * 3 and {r["rank"] for r in both} == {0, 1}
    assert {tuple(sorted(r)) for r in both} == {("micro", "position", "rank", "sequence", "step", "x")}
    alone = list(run.rows("1", ranks=0, shuffle=False))
    assert len(alone) == 18 and all(0 <= r["token"] < 10 for r in alone)
