"""Scalars in the store: rec.log, run.scalars(), stats --scalars, and the scalars the
trainers' callbacks and `tensortape record` log by themselves.  Every value is checked
against what was logged (or what the trainer / the script computed)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tensortape import cli
from tensortape.analysis import open_run
from tensortape.recorder import Recorder
from tensortape.recorder.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "plain_train.py")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def train(store, steps, log, mode="w-", logged=None):
    """Steps with forward and backward; ``log(rec, i, loss)`` logs; the values logged
    are kept in ``logged`` ({step: {name: value}}) by the caller's ``log``."""
    m = model()
    with Recorder(m, store, mode=mode, max_bytes=None, tensors_every=None, stats_every=1) as rec:
        for i in steps:
            with rec.step(i):
                loss = m(torch.randn(3, 4)).pow(2).mean()
                loss.backward()
                log(rec, i, loss, inside=True)
            log(rec, i, loss, inside=False)


def as_dict(ds):
    """run.scalars() as {step: {name: value}} (NaN left out)."""
    out = {}
    for name in ds.data_vars:
        for s, v in zip(ds.step.values.tolist(), ds[name].values.tolist()):
            if not np.isnan(v):
                out.setdefault(s, {})[name] = v
    return out


def test_logged_numbers_and_tensors_read_back_exactly(tmp_path):
    store, logged = str(tmp_path / "run.zarr"), {}

    def log(rec, i, loss, inside):
        if inside:
            values = {"loss": loss, "lr": 0.1 / (i + 1), "tokens": np.int64(1000 * i)}
            logged.setdefault(i, {}).update(loss=float(loss.detach()), lr=0.1 / (i + 1),
                                            tokens=1000.0 * i)
        else:                              # after the step: that step's, a numpy scalar
            values = {"grad_norm": np.float32(i + 0.5)}
            logged[i]["grad_norm"] = float(np.float32(i + 0.5))
        rec.log(values)
    train(store, range(4), log)
    ds = open_run(store).scalars()
    assert set(ds.dims) == {"step"} and all(ds[n].dtype == np.float64 for n in ds.data_vars)
    assert list(ds.data_vars) == ["loss", "lr", "tokens", "grad_norm"]
    assert as_dict(ds) == logged


def test_a_tensor_is_read_at_the_steps_end_without_a_sync_at_log_time(tmp_path, monkeypatch):
    """A user relies on: the value a logged tensor has when its step ends is stored
    (rec.log reads nothing: no .item(), no float()); logged after its step, its value
    when logged."""
    store = str(tmp_path / "run.zarr")
    m = model()
    with Recorder(m, store, max_bytes=None, tensors_every=None, stats_every=1) as rec:
        with rec.step(0):
            m(torch.randn(2, 4)).sum().backward()
            t = torch.tensor(1.5)
            with monkeypatch.context() as p:
                for name in ("item", "__float__", "tolist", "numpy"):
                    p.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("read at log"))
                rec.log({"x": t})
            t.add_(2.0)                                  # before the step ends: stored
        late = torch.tensor(7.0)
        rec.log({"late": late})
        late.add_(1.0)                                   # after it was logged: not stored
    assert as_dict(open_run(store).scalars()) == {0: {"x": 3.5, "late": 7.0}}


@pytest.mark.parametrize("bad, words", [
    ([("loss", 1.0)], "dict"),
    ({"loss": "high"}, "not a number"),
    ({"loss": torch.ones(3)}, "shape [3]"),
    ({"loss": torch.tensor(1j)}, "real 0-dim"),
    ({"": 1.0}, "non-empty string"),
])
def test_bad_input_is_one_line_that_names_the_fix(tmp_path, bad, words):
    m = model()
    with Recorder(m, str(tmp_path / "run.zarr"), max_bytes=None, tensors_every=1, stats_every=1) as rec:
        with rec.step(0):
            m(torch.randn(2, 4))
            with pytest.raises(ConfigError) as e:
                rec.log(bad)
            rec.log({"ok": 1.0})
    msg = str(e.value)
    assert "\n" not in msg and words in msg and "rec.log" in msg
    assert list(open_run(str(tmp_path / "run.zarr")).scalars().data_vars) == ["ok"]


def test_resume_replaces_a_recorded_again_steps_scalars_whole(tmp_path):
    store = str(tmp_path / "run.zarr")
    expect = {}

    def first(rec, i, loss, inside):
        if inside:
            rec.log({"loss": float(i), "lr": 1.0})
            expect[i] = {"loss": float(i), "lr": 1.0}
    train(store, range(6), first)

    def again(rec, i, loss, inside):       # resumed from step 2's checkpoint
        if inside and i != 3:               # step 3 of the new recording logs nothing
            rec.log({"loss": 100.0 + i})
    train(store, range(2, 5), again, mode="a")
    expect.update({2: {"loss": 102.0}, 4: {"loss": 104.0}})
    del expect[3]                           # recorded again without scalars: none of the old
    assert as_dict(open_run(store).scalars()) == expect


def test_a_store_without_scalars_reads_as_having_none(tmp_path):
    store = str(tmp_path / "run.zarr")
    train(store, range(2), lambda *a, **k: None)
    ds = open_run(store).scalars()
    assert len(ds.data_vars) == 0 and ds.sizes.get("step", 0) == 0
    r = CliRunner().invoke(cli.cli, ["stats", store, "--scalars", "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output) == []


def test_stats_scalars_prints_them(tmp_path):
    store, logged = str(tmp_path / "run.zarr"), {}

    def log(rec, i, loss, inside):
        if inside:
            rec.log({"loss": loss})
            logged[i] = float(loss.detach())
    train(store, range(3), log)
    r = CliRunner().invoke(cli.cli, ["stats", store, "--scalars", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [{"step": s, "loss": v} for s, v in logged.items()]
    r = CliRunner().invoke(cli.cli, ["stats", store, "--scalars", "--format", "csv", "--step", "1"])
    assert r.output.splitlines() == ["step,loss", f"1,{logged[1]!r}"]
    r = CliRunner().invoke(cli.cli, ["stats", store, "--scalars", "--layer", "0"])
    assert r.exit_code == 2 and "--layer" in r.output


def test_scalars_named_as_a_coordinate_read_back_renamed(tmp_path):
    """A scalar named ``step`` or ``rank`` (the coordinates of run.scalars(); ``step`` is
    a common name to log) reads as ``step'``, ``rank'`` (a ``'`` more while that name is
    logged too), in run.scalars(), ``stats --scalars`` and /api/scalars: before, each
    of them (and so ``tensortape serve``) failed on such a run."""
    from test_serve import Served
    store, logged = str(tmp_path / "run.zarr"), {}

    def log(rec, i, loss, inside):
        if inside:
            rec.log({"step": float(i), "rank": 0.5, "step'": -1.0 - i, "loss": loss})
            logged[i] = {"step''": float(i), "rank'": 0.5, "step'": -1.0 - i,
                         "loss": float(loss.detach())}
    train(store, range(3), log)
    ds = open_run(store).scalars()
    assert list(ds.data_vars) == ["step''", "rank'", "step'", "loss"] and list(ds.coords) == ["step"]
    assert as_dict(ds) == logged
    r = CliRunner().invoke(cli.cli, ["stats", store, "--scalars", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [{"step": s, **v} for s, v in logged.items()]
    served = Served(store)
    try:
        status, body = served.get("scalars")
    finally:
        served.close()
    assert status == 200 and body["step"] == [0, 1, 2], body
    assert body["values"] == {k: [logged[s][k] for s in range(3)] for k in logged[0]}


def test_tensortape_record_stores_the_loss_backward_was_called_on(tmp_path):
    store = str(tmp_path / "run.zarr")
    exe = shutil.which("tensortape")
    cmd = [exe] if exe else [sys.executable, os.path.join(ROOT, "cli.py")]
    p = subprocess.run([*cmd, "record", "-o", store, "--", "python", SCRIPT, "4"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 3, p.stderr
    torch.manual_seed(0)                     # the script's training, replayed here
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(4):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            m(torch.randn(3, 8))
    ds = open_run(store).scalars()
    assert ds.step.values.tolist() == [0, 1, 2, 3]
    assert ds["loss"].values.tolist() == losses
    assert torch.Tensor.backward.__module__ == "torch._tensor"     # put back
    h5 = str(tmp_path / "run.h5")                                  # and the HDF5 export holds it
    assert CliRunner().invoke(cli.cli, ["export", store, h5]).exit_code == 0
    assert open_run(h5).scalars().identical(ds)


ACCUMULATING = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
micro = int(sys.argv[1])
for step in range(3):
    total = 0.0
    for _ in range(micro):
        loss = model(torch.randn(5, 4)).pow(2).mean() / micro     # scaled for accumulation
        loss.backward()
        print("micro", repr(loss.item()))
        total += loss.item()
    print("step", repr(total))
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("micro", [2, 3])
def test_tensortape_record_stores_the_sum_of_a_steps_scaled_losses(tmp_path, micro):
    """Gradient accumulation with a scaled loss: the stored loss is the step's, the sum
    over its micro-batches of what backward() was called on, as the script prints it
    (and as exact rational arithmetic sums the values it printed)."""
    from fractions import Fraction
    script, store = tmp_path / "train.py", str(tmp_path / "run.zarr")
    script.write_text(ACCUMULATING)
    r = CliRunner().invoke(cli.cli, ["record", "-o", store, "--tensors-every", "0", "--",
                                     "python", str(script), str(micro)], prog_name="tensortape")
    assert r.exit_code == 0, r.output
    printed = [line.split() for line in r.stdout.splitlines()]
    steps, exact = [], Fraction(0)
    for word, value in printed:
        if word == "micro":
            exact += Fraction(float(value))
        else:
            assert Fraction(float(value)) == exact       # the script's sum, exact here
            steps.append(float(value))
            exact = Fraction(0)
    assert len(steps) == 3 and len(printed) == 3 * (micro + 1)
    ds = open_run(store).scalars()
    assert ds.step.values.tolist() == [0, 1, 2]
    assert ds["loss"].values.tolist() == steps


def test_hugging_face_trainer_stores_each_logged_scalar_once_as_its_log_history(tmp_path):
    """Training logs every 2 steps, an evaluation at the start and every 3 steps, and
    the summary at the end: each number of the Trainer's own ``state.log_history`` is
    stored once, on the step just ended when it was logged (the evaluation at the start,
    before any step, on the first), and nothing else is."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tensortape.recorder.integrations import TrainerCallback
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (x := torch.randint(0, 64, (12,), generator=g)), "labels": x}
            for _ in range(8)]
    store = str(tmp_path / "hf.zarr")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=6,
        save_strategy="no", report_to=[], use_cpu=True, logging_steps=2, disable_tqdm=True,
        learning_rate=1e-3, eval_strategy="steps", eval_steps=3, eval_on_start=True)
    class Noter(transformers.TrainerCallback):       # another callback logs a value that is
        def on_log(self, args, state, control, logs=None, **kwargs):   # no number: skipped,
            logs["phase"] = np.array("warmup")        # never raised into the training
    trainer = transformers.Trainer(model=gpt, args=args, train_dataset=data, eval_dataset=data[:4],
                                   callbacks=[Noter(), TrainerCallback(store,
                                                                       layers="transformer.h.0.mlp", tensors_every=1)])
    trainer.train()
    want = {}
    for e in trainer.state.log_history:      # on_log's step is the one just ended
        for name, v in e.items():             # (a later value of a name at a step wins)
            if name not in ("step", "phase"):
                want[(max(e["step"] - 1, 0), name)] = float(v)
    assert {name for _, name in want} >= {"loss", "grad_norm", "eval_loss", "train_runtime"}
    assert sorted(s for s, name in want if name == "eval_loss") == [0, 2, 5]
    stored = _stored(store)
    assert stored == want


def _stored(store) -> dict:
    """{(step, name): value} of the run's scalars, where one was logged."""
    ds = open_run(store).scalars()
    return {(int(s), name): float(v) for name in ds.data_vars
            for s, v in zip(ds.step.values, ds[name].values) if not np.isnan(v)}


def _lightning(pl):
    """A LightningModule logging a training metric every step (``seen``: its values by
    step), its epoch mean, and a validation metric."""
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.seen = model(), {}

        def training_step(self, batch, i):
            loss = self.net(batch).pow(2).mean()
            self.log("train_loss", loss)
            self.log("train_mean", loss, on_step=False, on_epoch=True)
            self.seen[self.global_step] = float(loss.detach())
            return loss

        def validation_step(self, batch, i):
            self.log("val_loss", self.net(batch).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)
    return Module()


def _loaders():
    g = torch.Generator().manual_seed(0)
    return (torch.utils.data.DataLoader(torch.randn(16, 4, generator=g), batch_size=2),
            torch.utils.data.DataLoader(torch.randn(6, 4, generator=g), batch_size=2))


def test_lightning_stores_what_self_log_logged(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from tensortape.recorder.integrations import LightningCallback
    store = str(tmp_path / "pl.zarr")
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1,          # no logger: what Lightning logs all the same
                         callbacks=[LightningCallback(store, layers="net.0", tensors_every=1)],
                         default_root_dir=str(tmp_path))
    module = _lightning(pl)
    trainer.fit(module, *_loaders())
    ds = open_run(store).scalars()
    seen = module.seen
    assert ds.step.values.tolist() == sorted(seen)
    np.testing.assert_array_equal(ds["train_loss"].values, [seen[s] for s in sorted(seen)])


def test_lightning_stores_each_logged_scalar_once_at_its_step_as_its_csv_logger_does(tmp_path):
    """Two epochs of 8 steps, a training metric every 3 steps, an epoch mean, and a
    validation at each epoch's end: tensortape's scalars are, name for name and step
    for step, what Lightning's own CSVLogger wrote (a validation value once, at its
    step, the last one too), whatever the trainer keeps in ``callback_metrics``."""
    pl = pytest.importorskip("lightning.pytorch")
    import csv
    from lightning.pytorch.loggers import CSVLogger
    from tensortape.recorder.integrations import LightningCallback
    logger = CSVLogger(str(tmp_path), name="csv")
    store = str(tmp_path / "pl.zarr")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=logger, log_every_n_steps=3,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[LightningCallback(store, layers="net.0")])
    trainer.fit(_lightning(pl), *_loaders())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        written = {(int(row["step"]), name): float(v) for row in csv.DictReader(f)
                   for name, v in row.items() if v and name not in ("step", "epoch")}
    assert {name for _, name in written} == {"train_loss", "train_mean", "val_loss"}
    assert sorted(s for s, name in written if name == "val_loss") == [7, 15]
    stored = _stored(store)
    assert stored == written
    assert "log_metrics" not in vars(trainer._logger_connector)     # Lightning's own again
