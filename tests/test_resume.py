"""A job resumed with mode="a" from an earlier checkpoint records steps the store
already holds: every reader returns the latest recording of each step, whole
(none of an older recording's micro-batches, layers or events), and the steps
it did not record again keep their old data.

The oracle is independent of tensortape: plain forward hooks and tensor hooks
copy every output and output gradient, and numpy computes what each reader
should return from the copies of the last recording of each step."""
import json
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from tensortape import cli
from tensortape.analysis import open_run
from tensortape.recorder import ConfigError, Recorder

LAYERS = ("a", "b", "c")
KINDS = ("activations", "gradients")


class Net(nn.Module):
    """``b`` runs only when ``use_b`` (a mixture-of-experts expert that got no tokens
    is skipped so, in some micro-batches or steps)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.use_b = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_b:
            h = h + self.b(h)
        return self.c(h)


class Oracle:
    """Plain hooks: ``latest[step]`` holds the copies of the last recording of that
    step, ``{(kind, layer, micro): array}``; a step recorded again starts afresh."""

    def __init__(self, model: Net):
        self.latest: dict[int, dict] = {}
        self.at: tuple[int, int] | None = None       # (step, micro) now
        self.keep = True                             # this step's full tensors are stored
        self.stats: dict[int, dict] = {}             # every capture of the step
        self.with_stats: dict[int, bool] = {}        # whether the step has statistics
        for name in LAYERS:
            getattr(model, name).register_forward_hook(self._hook(name))

    def _hook(self, name):
        def fwd(module, args, out):
            step, micro = self.at
            self._put(step, ("activations", name, micro), out)
            out.register_hook(lambda g: self._put(step, ("gradients", name, micro), g))
        return fwd

    def _put(self, step, key, t):
        value = t.detach().numpy().copy()
        self.stats[step][key] = value
        if self.keep:
            self.latest[step][key] = value

    def begin(self, step: int, keep: bool, stats: bool) -> None:
        self.latest[step], self.stats[step], self.keep = {}, {}, keep
        self.with_stats[step] = stats


def batch(recording: int, step: int, micro: int, bad: bool) -> torch.Tensor:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(
        1000 * recording + 10 * step + micro))
    if bad:
        x[0, 0] = float("nan")
    return x


def record(path, model, oracle, recording, steps, tensors_every=1, stats_every=1):
    """One job: ``steps`` is [(step, [(use_b, bad), ...]), ...], a micro-batch each."""
    mode = "w-" if recording == 0 else "a"
    # on_nonfinite="record": the oracle holds full tensors at due steps only (the
    # default's dump of the ring at a NaN is tests/test_defaults.py's)
    with Recorder(model, path, layers=list(LAYERS), mode=mode, tensors_every=tensors_every,
                  stats_every=stats_every, on_nonfinite="record") as rec:
        for step, micros in steps:
            oracle.begin(step, keep=step % tensors_every == 0, stats=step % stats_every == 0)
            with rec.step(step):
                for micro, (use_b, bad) in enumerate(micros):
                    oracle.at = (step, micro)
                    model.use_b = use_b
                    model(batch(recording, step, micro, bad)).sum().backward()
    model.use_b = True


def expected_events(oracle):
    out = set()
    for step, caps in oracle.stats.items():
        for (kind, layer, micro), v in caps.items():
            bad = (int(np.isnan(v).sum()), int(np.isposinf(v).sum()), int(np.isneginf(v).sum()))
            if any(bad):
                out.add((step, layer, kind, micro, *bad))
    return out


def got_events(run):
    return {(e.step, e.layer, e.kind, e.micro, e.nan, e.posinf, e.neginf) for e in run.events}


def invoke(*args):
    return CliRunner().invoke(cli.cli, list(args), prog_name="tensortape")


def check(path, oracle):
    """Every reader against the oracle's last recording of each step."""
    run = open_run(path)
    steps = sorted(s for s, on in oracle.with_stats.items() if on)
    for kind in KINDS:
        # full tensors: every micro-batch of the latest recording, nothing of an older one
        held = {(s, layer, m) for s, caps in oracle.latest.items()
                for (k, layer, m) in caps if k == kind}
        if kind not in run.kinds:               # nothing of it stored (e.g. no step was due)
            assert not held and not steps, (kind, held, steps)
            with pytest.raises(ConfigError, match="not recorded"):
                run.steps(kind)
            continue
        assert sorted(run.tensor_layers(kind)) == sorted({h[1] for h in held})
        assert run.steps(kind, tensors=True).tolist() == sorted({h[0] for h in held})
        for layer in run.tensor_layers(kind):
            mine = {(s, m) for s, x, m in held if x == layer}
            assert run.steps(kind, tensors=True, layer=layer).tolist() == \
                sorted({s for s, _ in mine})
            for m in range(4):
                want = sorted(s for s, mm in mine if mm == m)
                if not want:
                    with pytest.raises(ConfigError, match=f"micro-batch {m}"):
                        run.tensor(layer, kind, micro=m)
                    continue
                got = run.tensor(layer, kind, micro=m)
                assert got.step.values.tolist() == want
                np.testing.assert_array_equal(
                    got.values, np.stack([oracle.latest[s][(kind, layer, m)] for s in want]))
        # statistics and histograms: over the latest recording's micro-batches, -1 and
        # NaN where its step did not run the layer
        ds = run.stats(kind).compute()
        assert ds.step.values.tolist() == steps
        for layer in ds.layer.values.tolist():
            h = run.histogram(layer, kind).compute()
            assert h.step.values.tolist() == steps
            for i, s in enumerate(steps):
                parts = [v.ravel() for (k, x, _), v in oracle.stats[s].items()
                         if k == kind and x == layer]
                row = ds.sel(step=s, layer=layer)
                if not parts:
                    assert int(row["count"]) == -1 and np.isnan(float(row["mean"]))
                    assert (h.values[i] == -1).all()
                    continue
                v = np.concatenate(parts).astype(np.float64)
                fin = v[np.isfinite(v)]
                assert int(row["count"]) == v.size and int(row["nan"]) == np.isnan(v).sum()
                assert int(h.values[i].sum()) == fin.size
                if fin.size:
                    np.testing.assert_allclose(
                        [float(row[k]) for k in ("mean", "min", "max")],
                        [fin.mean(), fin.min(), fin.max()], rtol=1e-6, atol=1e-7)
        layers_run = {x for s in steps for (k, x, _) in oracle.stats[s] if k == kind}
        assert layers_run <= set(ds.layer.values.tolist())
    # events and the post-mortem: the latest recording's, none of an older one's
    want = expected_events(oracle)
    assert got_events(run) == want
    assert run.summary()["events_total"] == len(want)
    first = run.first_nonfinite()
    assert (first and first.step) == (min(w[0] for w in want) if want else None)
    out = invoke("nan", path, "--format", "json")
    assert out.exit_code == (1 if want else 0), out.output
    if want:
        assert json.loads(out.output)["step"] == first.step
    return run


CLEAN = [(True, False)]


# --- the cases the issue names ---------------------------------------------------------
def test_a_step_recorded_again_with_fewer_micro_batches_has_none_of_the_old(tmp_store):
    model = Net()
    oracle = Oracle(model)
    three = [(True, False)] * 3
    record(tmp_store, model, oracle, 0, [(0, three), (1, three), (2, three)])
    record(tmp_store, model, oracle, 1, [(1, [(True, False)] * 2)])   # from a step-1 checkpoint
    run = check(tmp_store, oracle)
    np.testing.assert_array_equal(run.tensor("a", step=1, micro=1).values,
                                  oracle.latest[1][("activations", "a", 1)])
    with pytest.raises(ConfigError) as e:
        run.tensor("a", step=1, micro=2)
    assert "'a' (activations) at step 1, micro-batch 2 has no full tensor" in str(e.value)
    assert "\n" not in str(e.value)
    # steps not recorded again keep their old data, every micro-batch
    np.testing.assert_array_equal(run.tensor("a", step=2, micro=2).values,
                                  oracle.latest[2][("activations", "a", 2)])


def test_a_negative_step_recorded_again_has_none_of_the_old(tmp_store):
    """``rec.step`` accepts negative steps (a warm-up numbered before 0): one of them
    recorded again with mode="a" reads as its latest recording only."""
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(-3, CLEAN * 2), (-2, CLEAN * 2)])
    record(tmp_store, model, oracle, 1, [(-2, CLEAN)])
    run = check(tmp_store, oracle)
    np.testing.assert_array_equal(run.tensor("a", step=-2, micro=0).values,
                                  oracle.latest[-2][("activations", "a", 0)])
    with pytest.raises(ConfigError, match="micro-batch 1"):
        run.tensor("a", step=-2, micro=1)
    np.testing.assert_array_equal(run.tensor("a", step=-3, micro=1).values,
                                  oracle.latest[-3][("activations", "a", 1)])


def test_a_step_recorded_again_with_more_micro_batches(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(0, CLEAN), (1, CLEAN)])
    record(tmp_store, model, oracle, 1, [(1, CLEAN * 3), (2, CLEAN * 2)])
    run = check(tmp_store, oracle)
    assert int(run.stats().sel(step=1, layer="c")["count"]) == 3 * 2 * 3


def test_an_old_nan_at_a_step_recorded_again_clean_is_not_reported(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, [(True, s == 3)]) for s in range(5)])
    assert open_run(tmp_store).first_nonfinite().step == 3
    record(tmp_store, model, oracle, 1, [(s, CLEAN) for s in range(2, 5)])
    run = check(tmp_store, oracle)
    assert run.events == [] and run.first_nonfinite() is None
    assert run.state().events_total == 0 and run.attrs["events"] == []
    out = invoke("nan", tmp_store)
    assert out.exit_code == 0 and "clean" in out.output
    assert "non-finite events: 0" in invoke("info", tmp_store).output


def test_a_nan_of_the_new_recording_is_reported_and_an_old_one_elsewhere_kept(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, [(True, s in (1, 4))]) for s in range(6)])
    record(tmp_store, model, oracle, 1, [(3, CLEAN), (4, [(True, False), (True, True)])])
    run = check(tmp_store, oracle)
    assert sorted({(e.step, e.micro) for e in run.events}) == [(1, 0), (4, 1)]


def test_a_layer_skipped_in_the_new_recording_reads_as_absent_there(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, CLEAN * 2) for s in range(3)])
    # the expert gets no tokens at step 1 now, and only in micro-batch 0 at step 2
    record(tmp_store, model, oracle, 1, [(1, [(False, False)] * 2),
                                         (2, [(False, False), (True, False)])])
    run = check(tmp_store, oracle)
    b = run.stats().sel(layer="b")
    assert b["count"].values.tolist() == [2 * 2 * 6, -1, 2 * 6]
    assert np.isnan(b["std"].values[1])
    assert run.steps(tensors=True, layer="b").tolist() == [0, 2]
    with pytest.raises(ConfigError, match=r"'b' \(activations\) at step 1 has no full tensor"):
        run.tensor("b", step=1)
    with pytest.raises(ConfigError, match=r"'b' \(activations\) at step 2 has no full tensor"):
        run.tensor("b", step=2, micro=0)


def test_a_layer_of_old_steps_only_has_no_full_tensors_left(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(0, CLEAN), (1, CLEAN)])
    record(tmp_store, model, oracle, 1, [(0, [(False, False)]), (1, [(False, False)])])
    run = check(tmp_store, oracle)
    assert run.tensor_layers() == ["a", "c"]
    with pytest.raises(Exception, match="no full activations tensors"):
        run.tensor("b", step=0)
    assert (run.stats().sel(layer="b")["count"] == -1).all()


def test_a_new_recording_without_full_tensors_at_a_step_hides_the_old_ones(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, CLEAN) for s in range(4)])
    record(tmp_store, model, oracle, 1, [(s, CLEAN) for s in range(1, 4)], tensors_every=2)
    run = check(tmp_store, oracle)
    assert run.steps(tensors=True).tolist() == [0, 2]


def test_steps_between_those_recorded_again_keep_their_old_data(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, CLEAN * 2) for s in range(7)])
    record(tmp_store, model, oracle, 1, [(s, CLEAN) for s in (0, 2, 5)])   # with gaps
    run = check(tmp_store, oracle)
    assert [int(run.stats().sel(step=s, layer="a")["count"]) for s in range(7)] == \
        [12, 24, 12, 24, 24, 12, 24]


def test_a_step_recorded_again_without_statistics_has_none(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, CLEAN) for s in range(4)])
    record(tmp_store, model, oracle, 1, [(s, CLEAN) for s in range(1, 4)], stats_every=2)
    run = check(tmp_store, oracle)
    assert run.steps().tolist() == [0, 2]
    with pytest.raises(ConfigError, match="step 1 has no statistics"):
        run.histogram("a", step=1)


def test_steps_lost_in_an_outage_of_the_store_still_hide_the_old_recording(tmp_store,
                                                                           monkeypatch):
    """A resumed job whose store fails: past the backlog's bound the journal merges
    steps into one record (their statistics counted, not kept); the old recording of
    those steps is not read either, and its NaN there is not reported."""
    from faultstore import faulty
    from tensortape.recorder import TensortapeWarning
    from tensortape.recorder.store import _journal
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, [(True, s == 4)]) for s in range(8)])
    monkeypatch.setattr(_journal, "BACKLOG_RECORDS", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TensortapeWarning)
        with Recorder(model, tmp_store, layers=list(LAYERS), mode="a",
                      flush_interval=60.0, tensors_every=1, stats_every=1) as rec:
            with faulty(fail=1.0) as faults:
                for s in range(1, 8):
                    with rec.step(s):
                        model(batch(1, s, 0, False)).sum().backward()
                    if s == 1:
                        rec.flush()                  # a fault: nothing commits from here
            assert faults.failures
    run = open_run(tmp_store)
    assert run.events == [] and run.state().events_total == 0
    kept = run.steps().tolist()
    assert kept[0] == 0 and len(kept) < 8                 # steps past the backlog are lost
    assert run.steps(tensors=True).tolist() == [0]        # full tensors of the outage: dropped
    for s in range(1, 8):
        if s in kept:                                     # the new recording's, not the old
            assert int(run.stats().sel(step=s, layer="a")["count"]) == 12


def test_a_second_resume(tmp_store):
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, CLEAN * 3) for s in range(6)])
    record(tmp_store, model, oracle, 1, [(s, CLEAN * 2) for s in range(2, 8)])
    record(tmp_store, model, oracle, 2, [(s, [(s != 4, s == 5)]) for s in range(4, 7)])
    run = check(tmp_store, oracle)
    assert [int(run.stats().sel(step=s, layer="a")["count"]) for s in range(8)] == \
        [36, 36, 24, 24, 12, 12, 12, 24]
    assert run.state().recording == 2


class Fragile(nn.Module):
    """NaN from finite inputs when ``log`` (of the negative ones)."""
    log = False

    def forward(self, x):
        return torch.log(x) if self.log else torch.tanh(x)


def test_a_replay_bundle_of_a_step_recorded_again_is_the_new_recording_s_whole(tmp_path):
    import zarr
    path = str(tmp_path / "run.zarr")

    def job(mode, huge: bool):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(5, 5), Fragile(), nn.Linear(5, 2))
        with Recorder(m, path, mode=mode, on_nonfinite="replay", tensors_every=1, stats_every=1) as rec:
            for s in range(2):
                if s == 1 and huge:                  # the Linear overflows: its bundle
                    with torch.no_grad():            # holds its parameters
                        m[0].weight.fill_(3e38)
                m[1].log = s == 1 and not huge       # the log makes NaN: no parameters
                with rec.step(s):
                    m(torch.randn(3, 5, generator=torch.Generator().manual_seed(s))).sum().backward()
        return m

    job("w-", huge=True)
    old = open_run(path).first_nonfinite()
    assert (old.step, old.replay["module"]) == (1, "0")
    assert "param_weight" in zarr.open_group(path, mode="r")["rank0/replay/step1"]
    model = job("a", huge=False)                     # step 1 again, from a checkpoint
    run = open_run(path)
    first = run.first_nonfinite()
    assert (first.step, first.replay["module"]) == (1, "1") and "log" in first.replay["op"]
    assert first.replay["bundle"] == "rank0/replay/step1"
    bundle = zarr.open_group(path, mode="r")["rank0/replay/step1"]
    assert not any(k.startswith("param_") for k in bundle.array_keys())   # none of the old
    assert run.replay(model)["op"] == first.replay["op"]


def test_a_resume_killed_while_it_gave_a_table_its_recording_column_reads_and_resumes(
        tmp_store):
    """A kill after the column's metadata and before its chunks: the store still
    opens, reads as before, and a job resumed again records into it."""
    import zarr
    model = Net()
    oracle = Oracle(model)
    record(tmp_store, model, oracle, 0, [(s, CLEAN * 2) for s in range(3)])
    table = zarr.open_group(tmp_store)["rank0/tensors/activations/a"]
    table.create_array("recording", shape=(1024,), chunks=(1024,), dtype="int64",
                       fill_value=0, dimension_names=["step"])        # no chunk written
    check(tmp_store, oracle)
    record(tmp_store, model, oracle, 1, [(1, CLEAN)])
    check(tmp_store, oracle)


def test_a_resumed_run_migrates_and_exports_as_it_reads(tmp_path):
    from tensortape.analysis._migrate import migrate
    path = str(tmp_path / "run.zarr")
    model = Net()
    oracle = Oracle(model)
    record(path, model, oracle, 0, [(s, [(True, s == 1)] * 3) for s in range(3)])
    record(path, model, oracle, 1, [(1, [(False, False)] * 2)])
    h5 = open_run(path).to_hdf5(str(tmp_path / "run.h5"))
    # a store of the current format is not migrated (nothing to do): its HDF5 export is
    for copy in (h5, migrate(h5, str(tmp_path / "new.zarr"))):
        check(copy, oracle)


# --- any schedule -------------------------------------------------------------------------
micro_batch = st.tuples(st.booleans(), st.sampled_from([False] * 4 + [True]))


@st.composite
def schedules(draw):
    """Recordings, each of increasing steps from a checkpoint at or before the last
    step so far, each step a micro-batch or a few, the expert run or not in each, a
    NaN now and then; full tensors and statistics every step or every other."""
    out, last = [], -1
    for r in range(draw(st.integers(1, 3))):
        start = 0 if r == 0 else draw(st.integers(0, last + 1))
        steps = sorted(draw(st.sets(st.integers(start, start + 5), min_size=1, max_size=4)))
        last = max(last, steps[-1])
        plan = [(s, draw(st.lists(micro_batch, min_size=1, max_size=3))) for s in steps]
        out.append((plan, draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 1, 2]))))
    return out


@settings(max_examples=6, deadline=None)
@given(schedules())
@example([([(1, [(False, False)])], 2, 2)])     # no step due: nothing stored
@example([([(1, [(True, False), (False, False)]), (2, [(True, False)]), (3, [(False, False)]),
            (4, [(True, False), (True, True), (True, False)])], 2, 1),
          ([(8, [(False, False)]), (9, [(False, False), (True, False), (True, False)])], 1, 1),
          ([(6, [(False, False), (False, True), (False, False)])], 1, 1)])  # a NaN at a due step
def test_every_reader_returns_the_last_recording_of_each_step(schedule):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.zarr")
        model = Net()
        oracle = Oracle(model)
        for recording, (plan, tensors, stats) in enumerate(schedule):
            record(path, model, oracle, recording, plan, tensors_every=tensors, stats_every=stats)
        check(path, oracle)
