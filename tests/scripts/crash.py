"""Training that fails at step K: its data raises, or sends this process SIGINT.

    python crash.py FRAMEWORK HOW K STORE LOG

FRAMEWORK is ``plain`` (a loop under ``with Recorder``), ``hf`` (a Hugging Face
Trainer with ``TrainerCallback``), ``lightning`` (``LightningCallback``) or
``none`` (no tensortape at all: for ``tensortape record``); HOW is ``raise`` or
``sigint``.  Every optimizer step that completes appends a line to LOG, so a test
knows which steps were trained.
"""
import os
import signal
import sys

import torch
from torch import nn

BATCH = 2
LAYERS = {"plain": "0", "none": "0", "hf": "transformer.h.*.mlp.c_fc",
          "lightning": "model.transformer.h.*.mlp.c_fc"}


class Failing(torch.utils.data.Dataset):
    """Rows of token ids; fetching the first row of step ``k`` fails (counted in
    fetches, not indices: samplers shuffle)."""

    def __init__(self, how: str, k: int):
        self.how, self.k, self.fetched = how, k, 0

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        self.fetched += 1
        if self.fetched == self.k * BATCH + 1:
            if self.how == "raise":
                raise RuntimeError(f"a broken sample at step {self.k}")
            os.kill(os.getpid(), signal.SIGINT)
        return torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))


def gpt2():
    import transformers
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def main(framework, how, k, store, log, models=None):
    """``models`` (a list) receives the model, then the trainer, kept alive."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def logged(*args):
        with open(log, "a") as f:
            f.write("step\n")
    register_optimizer_step_post_hook(logged)
    data = Failing(how, k)
    kw = dict(layers=LAYERS[framework], tensors_every=2, flush_interval=60.0)  # no commit but the last
    if framework in ("plain", "none"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
        if models is not None:
            models.append(model)
            models.append(data)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH)

        def train(rec=None):
            for i, ids in enumerate(loader):
                with rec.step(i) if rec else nullcontext():
                    model(ids).logsumexp(-1).mean().backward()
                opt.step()
                opt.zero_grad()
        from contextlib import nullcontext
        if framework == "none":
            train()
        else:
            from tensortape.recorder import Recorder
            with Recorder(model, store, **{"stats_every": 1, **kw}) as rec:
                train(rec)
    elif framework == "hf":
        import transformers
        from tensortape.recorder.integrations import TrainerCallback
        model = gpt2()
        if models is not None:
            models.append(model)
        args = transformers.TrainingArguments(
            output_dir=os.path.join(os.path.dirname(store), "hf-out"),
            per_device_train_batch_size=BATCH, max_steps=1000, save_strategy="no", report_to=[],
            use_cpu=True, disable_tqdm=True, logging_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(data),
                                       callbacks=[TrainerCallback(store, **{"stats_every": 1, **kw})])
        if models is not None:
            models.append(trainer)          # alive after a failure, as in a notebook
        trainer.train()
    elif framework == "lightning":
        import lightning.pytorch as pl
        from tensortape.recorder.integrations import LightningCallback
        model = gpt2()
        if models is not None:
            models.append(model)

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = model

            def training_step(self, batch, i):
                return self.model(input_ids=batch, labels=batch).loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1e-2)
        trainer = pl.Trainer(max_steps=1000, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False,
                             callbacks=[LightningCallback(store, **{"stats_every": 1, **kw})],
                             default_root_dir=os.path.dirname(store))
        if models is not None:
            models.append(trainer)
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=BATCH))


class _Rows(torch.utils.data.Dataset):
    """The failing rows as a Trainer takes them (dicts, labels included)."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids}


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)   # as on a terminal, even when the
    framework, how, k, store, log = sys.argv[1:6]              # tests run in the background
    main(framework, how, int(k), store, log)
