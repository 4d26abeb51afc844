"""The Hugging Face Trainer and Lightning callbacks, on tiny models built from configs."""
import copy
import os

import numpy as np
import pytest
import torch

from tensortape.analysis import open_run
from tensortape.recorder import Recorder

transformers = pytest.importorskip("transformers")

LAYERS = ["transformer.h.*.mlp.c_fc", "transformer.h.1.attn.c_proj"]
ACCUM, STEPS = 4, 3


def gpt2(seed=0):
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def token_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (12,), generator=g)} for _ in range(n)]


class TrainingBatches:
    """A forward pre-hook that keeps every batch the model saw in training mode."""

    def __init__(self, model):
        self.seen = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            self.seen.append({k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v)})


def hf_weights(batches):
    """The Trainer's loss scaling: each micro-batch's loss is a sum over its predicted
    tokens divided by the step's label count (``num_items_in_batch``)."""
    total = sum(int((b["labels"] != -100).sum()) for b in batches)
    return [int((b["labels"][:, 1:] != -100).sum()) / total for b in batches]


def check_against_hand_loop(run, batches, model0, tmp_path, weights, prefix="", **kw):
    """The recorded optimizer steps, and step 0 against a plain loop recording the same
    micro-batches (one step of ACCUM micro-batches, losses scaled as the trainer does)."""
    assert run.steps().tolist() == list(range(STEPS))                 # optimizer steps
    assert run.steps("gradients").tolist() == list(range(STEPS))
    store = str(tmp_path / "hand.zarr")
    with Recorder(model0, store, **kw) as rec:
        with rec.step(0):
            for b, w in zip(batches[:ACCUM], weights(batches[:ACCUM])):
                (model0(**b).loss * w).backward()
    hand = open_run(store)
    assert [prefix + n for n in hand.layers] == run.layers
    for kind in ("activations", "gradients", "weight_grads"):
        a = run.stats(kind).sel(step=0).compute()
        b = hand.stats(kind).sel(step=0).compute()
        assert a.layer.values.tolist() == [prefix + n for n in b.layer.values.tolist()]
        np.testing.assert_array_equal(a["count"].values, b["count"].values)
        for s in ("mean", "std", "abs_max", "norm"):
            np.testing.assert_allclose(a[s].values, b[s].values, rtol=1e-4, atol=1e-7,
                                       err_msg=f"{kind} {s}")
    assert float(run.stats("weight_grads")["norm"].min()) > 0       # taken before zero_grad
    for k in range(ACCUM):                                            # every micro-batch kept
        run.tensor(prefix + "transformer.h.0.mlp.c_fc", step=STEPS - 1, micro=k)


def test_hugging_face_trainer_records_optimizer_steps_and_no_evaluation(tmp_path):
    pytest.importorskip("accelerate")
    from tensortape.recorder.integrations import TrainerCallback
    model = gpt2()
    model0 = copy.deepcopy(model)
    seen = TrainingBatches(model)
    store = str(tmp_path / "hf.zarr")
    kw = dict(layers=LAYERS, capture=("activations", "gradients", "weight_grads"), tensors_every=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
        per_device_eval_batch_size=2, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        eval_strategy="steps", eval_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=1, disable_tqdm=True, learning_rate=1e-3, max_grad_norm=0.0)
    data = token_rows(2 * ACCUM * STEPS, 0)
    collate = transformers.DataCollatorForLanguageModeling(
        transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), pad_token="[PAD]"),
        mlm=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   eval_dataset=token_rows(4, 1), data_collator=collate,
                                   callbacks=[TrainerCallback(store, **{"stats_every": 1, **kw})])
    trainer.train()
    run = open_run(store)
    assert run.status == "complete"
    assert run.attrs["outside_steps"] >= STEPS                        # the evaluations ran
    assert len(seen.seen) == ACCUM * STEPS
    batches = [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in seen.seen]
    check_against_hand_loop(run, batches, model0, tmp_path, hf_weights, **kw)


def _tokenizer():
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({f"t{i}": i for i in range(63)} | {"[PAD]": 63},
                                      unk_token="[PAD]"))


def test_lightning_records_optimizer_steps_and_skips_validation(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def validation_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    from tensortape.recorder.integrations import LightningCallback
    model = gpt2()
    model0 = copy.deepcopy(model)
    seen = TrainingBatches(model)
    rows = torch.stack([r["input_ids"] for r in token_rows(2 * ACCUM * STEPS, 0)])
    train = torch.utils.data.DataLoader(rows, batch_size=2)
    val = torch.utils.data.DataLoader(rows[:4], batch_size=2)
    store = str(tmp_path / "pl.zarr")
    kw = dict(layers=[f"model.{p}" for p in LAYERS],
              capture=("activations", "gradients", "weight_grads"), tensors_every=1)
    trainer = pl.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="cpu",
                         val_check_interval=ACCUM, num_sanity_val_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[LightningCallback(store, **{"stats_every": 1, **kw})],
                         default_root_dir=str(tmp_path))
    trainer.fit(Module(model), train, val)
    run = open_run(store)
    assert run.status == "complete" and run.attrs["outside_steps"] == 0   # the model is a child
    assert len(seen.seen) == ACCUM * STEPS
    batches = [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in seen.seen]
    check_against_hand_loop(run, batches, model0, tmp_path, lambda bs: [1 / ACCUM] * len(bs),
                            prefix="model.", **dict(kw, layers=LAYERS))


def test_a_trainer_subclass_that_raises_closes_its_run(tmp_path):
    """The callback finds the Trainer by the frame of the base ``Trainer.__init__``, which a
    subclass reaches through ``super()``: an exception in its ``train`` closes the run as
    ``interrupted``, with the steps trained before it, while the trainer lives on."""
    pytest.importorskip("accelerate")
    from tensortape.recorder.integrations import TrainerCallback

    class Breaks(torch.utils.data.Dataset):
        def __init__(self):
            self.rows, self.fetched = token_rows(64, 0), 0

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            self.fetched += 1
            if self.fetched == 2 * 2 + 1:                # the first row of step 2
                raise RuntimeError("a broken sample")
            return dict(self.rows[i], labels=self.rows[i]["input_ids"])

    class MyTrainer(transformers.Trainer):
        def __init__(self, *args, note, **kwargs):
            self.note = note
            super().__init__(*args, **kwargs)

    store = str(tmp_path / "hf.zarr")
    callback = TrainerCallback(store, layers=LAYERS, flush_interval=60.0, tensors_every=1,
                               stats_every=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=10,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        logging_strategy="no")
    trainer = MyTrainer(model=gpt2(), args=args, train_dataset=Breaks(), note="mine",
                        callbacks=[callback])
    with pytest.raises(RuntimeError, match="a broken sample"):
        trainer.train()
    run = open_run(store)
    assert trainer.state.global_step >= 1                 # trained before the failure
    assert run.status == "interrupted"
    assert run.steps().tolist() == list(range(trainer.state.global_step))
    other = transformers.Trainer(model=gpt2(), args=args, train_dataset=Breaks())
    assert not hasattr(other.train, "_tensortape")   # only the callback's own trainer


def test_a_nan_loss_is_stored_as_nan_not_as_the_trainers_filtered_value(tmp_path):
    """The Trainer's ``logging_nan_inf_filter`` (on by default) logs a NaN step's loss as
    the window's running average (0 at its first step).  Before: the run stored that 0,
    and the page drew it as a real loss.  The truth here is the loss the model returned
    (a plain forward hook on the root); a NaN is injected into it at one step."""
    pytest.importorskip("accelerate")
    from tensortape.recorder.integrations import TrainerCallback
    model, poisoned, returned = gpt2(), 2, []

    def inject(module, args, out):             # the loss of the training call `poisoned`
        if module.training and torch.is_grad_enabled():
            if len(returned) == poisoned:
                out["loss"] = out["loss"] * float("nan")
            returned.append(float(out["loss"].detach()))
        return out
    model.register_forward_hook(inject)
    store = str(tmp_path / "nan.zarr")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=5,
        save_strategy="no", report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
        learning_rate=1e-3, max_grad_norm=0.0)
    assert args.logging_nan_inf_filter                # the Trainer's default
    data = [dict(r, labels=r["input_ids"]) for r in token_rows(10, 0)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[TrainerCallback(store, layers=LAYERS)])
    trainer.train()
    assert not np.isfinite(returned[poisoned:]).any() and np.isfinite(returned[:poisoned]).all()
    logged = {h["step"] - 1: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert logged[poisoned] == 0.0                     # what the filter logged: a number
    final = next(h["train_loss"] for h in trainer.state.log_history if "train_loss" in h)
    assert np.isfinite(final)
    scalars = open_run(store).scalars()
    loss = scalars["loss"].sel(step=list(logged)).values
    np.testing.assert_allclose(loss[:poisoned], returned[:poisoned], rtol=1e-6)   # as logged
    np.testing.assert_allclose(loss[:poisoned], [logged[s] for s in range(poisoned)])
    assert np.isnan(loss[poisoned:]).all(), loss       # the model's loss, not the filter's
    assert np.isnan(scalars["train_loss"].dropna("step", how="all").values).all()
