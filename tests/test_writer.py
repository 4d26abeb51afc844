"""Committed means stored, on the machines users train on.

This machine has 2 cores, so the recorder writes with one thread by default; a
GPU server writes with up to 8, to a store that may be an object store 0.2 s a
PUT away, that fails at times, under a strict warnings filter.  These tests
force each of those (``TENSORTAPE_WRITE_THREADS``, ``tests/faultstore.py``,
``warnings.simplefilter("error")``) and check every step against the plain-hooks
oracle: each is stored exactly, or counted as dropped with its reason.  And a
writer that dies or hangs never hangs training, nor its end.
"""
import copy
import gc
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortape.analysis import open_run
from faultstore import faulty
from oracle import STATS, Oracle
from tensortape.recorder import Recorder, RecorderError, TensortapeWarning

UNWRITABLE = "store could not be written"
STEPS = 36


def _model(seed=0, layers=6):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])


def _train(model, rec, oracle, twin, steps=range(STEPS), between=None):
    """SGD on both copies, the recorded one in ``rec``'s steps and the twin in the
    oracle's."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, twin)]
    for i in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        if between is not None:
            between(i)
        oracle.begin(i)
        with rec.step(i):
            model(x).square().mean().backward()
        twin(x).square().mean().backward()
        oracle.end()
        for o in opts:
            o.step()
            o.zero_grad()


def _same(got, want, what):
    got, want = float(got), float(want)
    if np.isnan(want):
        assert np.isnan(got), what
    else:
        assert abs(got - want) <= 1e-9 * max(abs(got), abs(want)), (what, got, want)


def check(store, oracle, tensors_lost_ok=False):
    """Every committed statistic and histogram equals the oracle's; every full tensor
    is stored bit-exactly, or counted in ``dropped`` as unwritable.  Each table is
    read once, whole, and compared step by step."""
    run = open_run(store)
    assert run.attrs["status"] == "complete"
    keys = oracle.keys()
    for kind in ("activations", "gradients"):
        ds = run.stats(kind).compute()
        want_steps = sorted({s for s, k, _ in keys if k == kind})
        assert ds.step.values.tolist() == want_steps, kind
        at = {s: i for i, s in enumerate(want_steps)}
        layers = {n: i for i, n in enumerate(ds.layer.values.tolist())}
        got = {stat: ds[stat].transpose("step", "layer").values for stat in STATS}
        for step, k, name in keys:
            if k != kind:
                continue
            want = oracle.stats(step, kind, name)
            for stat in STATS:
                _same(got[stat][at[step], layers[name]], want[stat], (step, kind, name, stat))
        for name in {n for _, k, n in keys if k == kind}:
            hist = run.histogram(name, kind).compute()        # every step, in one read
            hist = hist.transpose("step", ...).values
            for step in want_steps:
                np.testing.assert_array_equal(hist[at[step]], oracle.histogram(step, kind, name),
                                              err_msg=f"{step} {kind} {name}")
    missing, tables = 0, {}
    for (kind, name, step, micro), t in oracle.tensors().items():
        if (kind, name, micro) not in tables:            # one read of each table
            if name not in run.tensor_layers(kind):
                tables[kind, name, micro] = None
            else:
                stored = run.tensor(name, kind, micro=micro)
                tables[kind, name, micro] = (stored.step.values.tolist(), stored.compute())
        table = tables[kind, name, micro]
        if table is None or step not in table[0]:
            missing += 1
            continue
        row = table[1].isel(step=table[0].index(step))
        extent = tuple(int(row[f"extent_{d}"]) for d in row.dims)
        np.testing.assert_array_equal(row.values[tuple(slice(0, e) for e in extent)], t.numpy(),
                                      err_msg=f"{kind} {name} {step}")
    reasons = run.attrs["drop_reasons"]
    assert missing == reasons.get(UNWRITABLE, 0), (missing, reasons)
    assert tensors_lost_ok or missing == 0
    assert run.dropped == sum(reasons.values())
    return run


def _record(store, layers=6, steps=STEPS, tensors_every=3, flush_interval=0.05, **kw):
    model = _model(layers=layers)
    twin = copy.deepcopy(model)
    oracle = Oracle(twin, "*", ("activations", "gradients"), tensors_every=tensors_every)
    with Recorder(model, store, layers="*", tensors_every=tensors_every,
                  flush_interval=flush_interval, **{"stats_every": 1, **kw}) as rec:
        _train(model, rec, oracle, twin, steps=range(steps))
    oracle.close()
    return oracle


@pytest.mark.parametrize("threads", [1, 4, 16])
def test_every_row_is_stored_whatever_the_threads(tmp_path, monkeypatch, threads):
    monkeypatch.setenv("TENSORTAPE_WRITE_THREADS", str(threads))
    store = str(tmp_path / "run.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a strict CI: no warning of ours or theirs
        with faulty() as faults:                  # commits at the end: blocks of one shard queue up
            oracle = _record(store, steps=64, flush_interval=60.0)
    assert faults.overlap == 1                    # never two writes in flight on one key
    check(store, oracle)


def test_every_row_is_stored_on_a_slow_store_whatever_the_threads(tmp_path, monkeypatch):
    """Writes take 0.05-0.1 s (an object store's PUT), with 1, 4 and 16 write threads:
    three runs side by side (they mostly wait), each against its own oracle."""
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with faulty(latency=0.1) as faults:
            for threads in (1, 4, 16):            # each store takes its thread count at attach
                monkeypatch.setenv("TENSORTAPE_WRITE_THREADS", str(threads))
                model = _model(seed=threads, layers=2)
                twin = copy.deepcopy(model)
                store = str(tmp_path / f"run{threads}.zarr")
                oracle = Oracle(twin, "*", ("activations", "gradients"), tensors_every=10)
                rec = Recorder(model, store, layers="*", tensors_every=10,
                               flush_interval=0.05, stats_every=1).attach()
                runs[store] = (model, twin, oracle, rec)
            errors = []

            def train(model, twin, oracle, rec):  # 24 steps: blocks of one shard in flight
                try:
                    with rec:
                        _train(model, rec, oracle, twin, steps=range(24))
                    oracle.close()
                except BaseException as e:
                    errors.append(e)

            trainers = [threading.Thread(target=train, args=r) for r in runs.values()]
            for t in trainers:
                t.start()
            for t in trainers:
                t.join()
    assert not errors, errors
    assert faults.overlap == 1
    for store, (_, _, oracle, _) in runs.items():
        check(store, oracle)


def test_every_row_is_stored_on_s3_with_many_threads(s3_server, monkeypatch):
    monkeypatch.setenv("TENSORTAPE_WRITE_THREADS", "8")
    store = f"{s3_server}/run.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        oracle = _record(store)
    check(store, oracle)


class _Told:
    """tensortape's warnings, with the thread each was issued on."""

    def __init__(self):
        self.seen = []

    def __call__(self, message, category, *a, **k):
        self.seen.append((category, str(message), threading.current_thread().name))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(fails=st.sets(st.integers(0, 150), max_size=12), threads=st.sampled_from([1, 4, 16]),
       after=st.floats(0, 1))
def test_random_store_faults_lose_nothing_uncounted(tmp_path_factory, fails, threads, after):
    """Writes fail on a random schedule (before or after the bytes land); the
    statistics of every step are stored exactly in the end, and every full tensor
    is stored or counted."""
    store = str(tmp_path_factory.mktemp("faults") / "run.zarr")
    told = _Told()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("TENSORTAPE_WRITE_THREADS", str(threads))
        warnings.simplefilter("error")                 # theirs raise
        warnings.simplefilter("always", TensortapeWarning)
        mp.setattr(warnings, "showwarning", told)
        with faulty(schedule=lambda n: n in fails, after=after) as faults:
            model = _model()
            twin = copy.deepcopy(model)
            oracle = Oracle(twin, "*", ("activations", "gradients"), tensors_every=3)
            faults.enabled = False                     # creating the run may fail: not this test
            with Recorder(model, store, layers="*", tensors_every=3, flush_interval=0.05, stats_every=1) as rec:
                faults.enabled = True
                _train(model, rec, oracle, twin)
                faults.enabled = False                 # the store heals before the end
            oracle.close()
    check(store, oracle, tensors_lost_ok=True)
    assert all(thread == threading.main_thread().name for _, _, thread in told.seen), told.seen
    assert all(cat is TensortapeWarning for cat, _, _ in told.seen)
    if faults.failures:
        assert any("cannot be written" in m for _, m, _ in told.seen)


def test_a_hung_store_never_hangs_training_nor_close(tmp_path):
    """Every chunk write hangs: training goes on (captures dropped and counted, told
    once, on the training thread), and close returns within close_timeout, the run
    marked interrupted with a note of what was not committed."""
    store = str(tmp_path / "run.zarr")
    release = threading.Event()
    model = _model()
    with faulty(hang=lambda key: "/c/" in key or "/c" == key[-2:], release=release):
        with pytest.warns(TensortapeWarning) as told:
            start = time.monotonic()
            with Recorder(model, store, layers="*", tensors_every=1, flush_interval=0.05,
                          close_timeout=1.0, max_pending_bytes=1 << 20, stats_every=1) as rec:
                for i in range(100):                   # more than the inbox holds
                    with rec.step(i):
                        model(torch.randn(64, 16)).square().mean().backward()
            took = time.monotonic() - start
        release.set()
    assert took < 60, took                       # a hang never ends; 100 steps take seconds
    messages = [str(w.message) for w in told]
    assert any("made no progress" in m for m in messages), messages
    assert any("close_timeout=1 s" in m and "not stored" in m for m in messages), messages
    assert rec.dropped > 0
    run = open_run(store)
    assert run.attrs["status"] == "interrupted"
    assert "not stored" in run.attrs["note"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_writer_never_hangs_training(tmp_path, monkeypatch):
    """The writer thread dies (a bug in its loop): each later step's captures are
    dropped and counted, the training thread is told once, and close returns."""
    from tensortape.recorder.writer import _worker
    store = str(tmp_path / "run.zarr")
    model = _model()
    real_take = _worker.Worker._take
    alive = {"n": 0}

    def take(self):
        alive["n"] += 1
        if alive["n"] > 30:
            raise SystemExit("the writer's loop broke")
        return real_take(self)

    monkeypatch.setattr(_worker.Worker, "_take", take)
    with pytest.warns(TensortapeWarning, match="writer thread died") as told:
        # close_timeout is also how long a writer may make no progress before it is
        # called stuck: a loaded machine's slow writes must not read as that (a dead
        # writer is seen at once, whatever the timeout)
        with Recorder(model, store, layers="*", flush_interval=0.05, close_timeout=120,
                      tensors_every=1, stats_every=1) as rec:
            for i in range(200):
                with rec.step(i):
                    model(torch.randn(4, 16)).square().mean().backward()
                time.sleep(0.002)
    assert sum("writer thread died; the captures" in str(w.message) for w in told) == 1
    assert rec.dropped > 0
    assert open_run(store).attrs["status"] == "interrupted"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_writer_raises_once_under_on_error_raise(tmp_path, monkeypatch):
    from tensortape.recorder.writer import _worker
    monkeypatch.setattr(_worker.Worker, "_take", lambda self: (_ for _ in ()).throw(SystemExit()))
    model = _model()
    rec = Recorder(model, str(tmp_path / "run.zarr"), layers="*", on_error="raise",
                   close_timeout=120, tensors_every=1, stats_every=1)         # a writer not yet run is not "stuck" on a busy machine
    errors, noticed = 0, None
    with pytest.warns(TensortapeWarning, match="did not commit within close_timeout"), rec:
        # the writer dies when it first runs, which a loaded machine may put off for a
        # while: step on until the death is raised, then 5 steps more, which must not raise
        deadline = time.monotonic() + 60
        i = 0
        while (noticed is None and time.monotonic() < deadline) or \
                (noticed is not None and i <= noticed + 5):
            try:
                with rec.step(i):
                    model(torch.randn(4, 16)).sum().backward()
            except RecorderError as e:
                errors += 1
                noticed = i if noticed is None else noticed
                assert "writer thread died" in str(e)
            i += 1
            time.sleep(0.005)
    assert errors == 1 and noticed is not None


def test_a_forgotten_recorder_is_ended_without_a_lock_or_a_wait(tmp_path):
    """A Recorder dropped without close() is ended as interrupted by a finaliser that
    takes no lock (the garbage collector may run it while the training thread holds
    the writer's lock) and joins nothing."""
    store = str(tmp_path / "run.zarr")
    model = _model()
    rec = Recorder(model, store, layers="*", tensors_every=1, stats_every=1).attach()
    for i in range(3):
        with rec.step(i):
            model(torch.randn(4, 16)).sum().backward()
    writer = rec._writer
    held, done = threading.Event(), threading.Event()

    def hold():                                        # another thread holds the writer's lock
        with writer.worker._cond:
            held.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    finished = threading.Event()

    def collect():
        nonlocal rec
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del rec
            gc.collect()
        finished.set()

    threading.Thread(target=collect, daemon=True).start()
    assert finished.wait(5), "the finaliser blocked on the writer's lock"
    done.set()
    holder.join()
    writer.worker.thread.join(10)
    assert not any(m._forward_hooks for m in model.modules())
    run = open_run(store)
    assert run.attrs["status"] == "interrupted"
    assert run.steps("activations").tolist() == [0, 1, 2]


def test_close_always_reaches_the_writer(tmp_path, monkeypatch):
    """The last record's hand-over raises (on_error='raise'): close still ends the
    writer, and the run is not left 'recording'."""
    from tensortape.recorder.writer import _writer
    store = str(tmp_path / "run.zarr")
    model = _model()
    rec = Recorder(model, store, layers="*", outside_step="ignore", tensors_every=1, stats_every=1).attach()
    with rec.step(0):
        model(torch.randn(4, 16)).sum().backward()
    model(torch.randn(4, 16))                          # counted at close: a late record
    real_put = _writer.Writer.put

    def put(self, record):
        real_put(self, record)
        raise RecorderError("the hand-over failed")

    monkeypatch.setattr(_writer.Writer, "put", put)
    with pytest.raises(RecorderError):
        rec.close()
    assert not rec._writer.worker.thread.is_alive()
    assert open_run(store).attrs["status"] == "complete"


def test_the_backlog_of_an_outage_is_bounded_in_records(tmp_path, monkeypatch):
    """While the store cannot be written, at most BACKLOG_RECORDS steps keep their
    statistics; those past it are counted with their reason, never silently lost."""
    from tensortape.recorder.store import _journal
    monkeypatch.setattr(_journal, "BACKLOG_RECORDS", 5)
    store = str(tmp_path / "run.zarr")
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TensortapeWarning)
        with Recorder(model, store, layers="0", capture="activations", tensors_every=None,
                      flush_interval=60.0, stats_every=1) as rec:
            with faulty(fail=1.0) as faults:
                for i in range(20):
                    with rec.step(i):
                        model(torch.randn(4, 16))
                    if i == 0:
                        rec.flush()                    # a fault: nothing commits from here
            assert faults.failures
    run = open_run(store)
    reasons = run.attrs["drop_reasons"]
    kept = run.steps("activations").tolist()
    lost = [k for k in reasons if "backlog" in k]
    assert lost and reasons[lost[0]] == 20 - len(kept), (reasons, kept)
    assert len(kept) <= 1 + 5 + 1


HUNG_EXIT = """
import sys, threading, torch
sys.path.insert(0, sys.argv[2])
from faultstore import faulty
from tensortape.recorder import Recorder
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(24)])
hang = faulty(hang=lambda key: "/c" in key and "/data/" in key, release=threading.Event())
hang.__enter__()                                   # never released
rec = Recorder(model, sys.argv[1], layers="*", tensors_every=1, flush_interval=0.05,
               close_timeout=1.0, stats_every=1).attach()
for i in range(20):
    with rec.step(i):
        model(torch.randn(256, 256)).sum().backward()
if sys.argv[3] == "forgotten":                     # collected unclosed: its finaliser ends it
    import gc
    del rec
    gc.collect()
print("trained", flush=True)
"""


@pytest.mark.parametrize("threads,ended", [(1, "at exit"), (4, "at exit"), (4, "forgotten")])
def test_a_hung_store_never_hangs_the_interpreter_s_exit(tmp_path, threads, ended):
    """A script that never closes its Recorder (or drops it unclosed) exits with its
    own status (the run closed at exit within close_timeout, marked 'interrupted' with
    a note) although every chunk write hangs for good, with a pool of write threads
    too (their threads never hold up the exit; the writer, still summarising later
    steps with torch, is halted first: a thread inside torch at finalization aborted
    the process)."""
    import os
    import subprocess
    import sys
    script = tmp_path / "hung.py"
    script.write_text(HUNG_EXIT)
    env = {**os.environ, "TENSORTAPE_WRITE_THREADS": str(threads)}
    start = time.monotonic()
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "run.zarr"),
                        os.path.dirname(__file__), ended], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "trained" in p.stdout and "did not commit within close_timeout" in p.stderr
    assert time.monotonic() - start < 60
    attrs = open_run(str(tmp_path / "run.zarr")).attrs
    assert attrs["status"] == "interrupted" and "did not commit" in attrs["note"]


def test_the_journal_is_bounded_in_records(monkeypatch):
    """Past BACKLOG_RECORDS steps, the journal holds one record for all the others:
    their counts add up, their statistics are counted, memory stays flat."""
    from tensortape.recorder.store import _journal
    from tensortape.recorder.format import RankState
    monkeypatch.setattr(_journal, "BACKLOG_RECORDS", 5)
    journal = _journal.Journal(RankState())
    for step in range(1000):
        rows = type("Rows", (), {"layers": ["a"], "stats": {}, "hist": np.zeros(0)})()
        journal.keep(_journal.Unsaved(step, [f"l{step}"], {"x": 1}, 1, [], {"k": rows}),
                     "backlog")
    assert len(journal.unsaved) == 6
    last = journal.unsaved[-1]
    assert last.step == 999 and last.outside == 995 and last.drops == {"x": 995, "backlog": 995}
    assert last.layers == [f"l{s}" for s in range(5, 1000)]
    assert sum(len(u.layers) for u in journal.unsaved) == 1000


def test_a_bad_write_threads_setting_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    from tensortape.recorder import ConfigError
    monkeypatch.setenv("TENSORTAPE_WRITE_THREADS", "abc")
    with pytest.raises(ConfigError, match="TENSORTAPE_WRITE_THREADS='abc' is not valid"):
        Recorder(_model(), str(tmp_path / "run.zarr"), tensors_every=1, stats_every=1)
    assert not (tmp_path / "run.zarr").exists()


def test_tensortape_s_warnings_name_the_user_s_line(tmp_path):
    """A warning points at the user's code that called tensortape (here a forward
    outside a step), not at tensortape's or torch's frames."""
    model = _model()
    with Recorder(model, str(tmp_path / "run.zarr"), layers="*", tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            model(torch.randn(2, 16)).sum().backward()
        with pytest.warns(TensortapeWarning, match="outside a step") as told:
            model(torch.randn(2, 16))
    assert told[0].filename == __file__, told[0].filename


def _files(root):
    """Every stored file under ``root``: its path and bytes."""
    import pathlib
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file() and "/c/" in str(p)}


@pytest.mark.parametrize("layers", [3, 201, 300])
def test_statistics_shards_are_written_byte_for_byte_as_zarr_writes_them(tmp_path, layers):
    """The writer encodes the statistics tables' shards itself (``recorder.store._table``);
    the oracle is zarr writing the same blocks into an identical array: every stored
    file is the same, byte for byte, after each write (a first write, a shard's
    other bands kept, a band written again, several shards across the layers, the
    edge padded), and zarr reads back what was written."""
    import zarr
    from tensortape.recorder.store._layout import stats_columns
    from tensortape.recorder.store._shards import Shards
    rng = np.random.default_rng(layers)
    made = {}
    for side in ("zarr", "ours"):
        g = zarr.open_group(str(tmp_path / side), mode="w")
        made[side] = stats_columns(g, "activations", layers)
    for name, rows in (("hist", 16), ("stats", 1024)):
        ours, theirs = made["ours"][name], made["zarr"][name]
        shards = Shards.of(ours)
        assert shards is not None
        for a in (ours, theirs):
            a.resize((512 if name == "hist" else 2048, *a.shape[1:]))
        for start in (0, 16, 16, 240, 256) if name == "hist" else (0, 0, 1024):
            block = np.full((rows, *ours.shape[1:]), ours.fill_value, dtype=ours.dtype)
            filled = rng.integers(1, rows + 1)
            block[:filled] = (rng.integers(0, 50, (filled, *ours.shape[1:])) if name == "hist"
                              else rng.standard_normal((filled, *ours.shape[1:])))
            assert shards.fits(start, block)
            theirs[start: start + rows] = block
            shards.write(start, block)
            stored = _files(tmp_path / "ours")
            assert stored and stored == _files(tmp_path / "zarr")
            np.testing.assert_array_equal(ours[start: start + rows], block)
    assert not Shards.of(made["ours"]["step"])          # not sharded: zarr writes it


class _Branch(torch.nn.Module):
    """``b`` runs from step 1 on, between ``a`` and ``c``: at step 1 the step's layers come
    in another order than the stats table's (``a``, ``c``, then ``b``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(5, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 3)
        self.step = 0

    def forward(self, x):
        x = self.a(x)
        if self.step:
            x = self.b(x)
        return self.c(x)


def test_a_steps_rows_land_in_their_layers_whatever_their_order(tmp_store):
    """Each stored statistics and histogram row is its own layer's (the oracle's, from plain
    hooks and numpy), whether a step's layers come in the table's order or not (a layer first
    seen later, between others), and a layer absent at a step reads as absent there."""
    model = _Branch()
    twin = copy.deepcopy(model)
    oracle = Oracle(twin, ["a", "b", "c"], ("activations", "gradients"), tensors_every=None)
    with Recorder(model, tmp_store, layers=["a", "b", "c"], tensors_every=None,
                  on_nonfinite="record", stats_every=1) as rec:
        for s in range(4):
            model.step = twin.step = s
            with rec.step(s):
                oracle.begin(s)
                for m in (model, twin):
                    m(torch.randn(3, 5, generator=torch.Generator().manual_seed(s))).square().sum().backward()
                oracle.end()
    oracle.close()
    run = open_run(tmp_store)
    assert run.layers == ["a", "c", "b"] == oracle.names()
    tables = {kind: run.stats(kind).compute() for kind in run.kinds}     # read once
    for s, kind, name in oracle.keys():
        np.testing.assert_array_equal(run.histogram(name, kind, step=s).values,
                                      oracle.histogram(s, kind, name), err_msg=f"{s} {kind} {name}")
        got, want = tables[kind].sel(step=s, layer=name), oracle.stats(s, kind, name)
        for stat in ("count", "min", "max", "abs_max"):
            assert float(got[stat]) == want[stat], (s, kind, name, stat)
    assert (run.histogram("b", "activations", step=0).values == -1).all()     # absent there
