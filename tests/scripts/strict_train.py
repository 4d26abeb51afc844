"""Training recorded by tensortape and, on the same model, by the plain oracle
(``tests/oracle.py``), for ``test_strict.py``, which runs it under ``python -W error``.

    python strict_train.py MODE OUT.json [STORE]

MODE is ``plain`` (a loop under ``with Recorder``), ``hf`` (a Hugging Face Trainer
with ``TrainerCallback``), ``lightning`` (``LightningCallback``) or ``bare`` (no
tensortape: the script ``tensortape record`` runs).  OUT.json receives what the
oracle says the store must hold (names, per-step statistics and histograms,
events), and whether every compiled statistics kernel of the process stayed
compiled (a strict filter must never demote one).
"""
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from oracle import Oracle  # noqa: E402

STEPS = 4
ACCUM = 2
GPT2_LAYERS = ["transformer.h.*.mlp.c_fc", "transformer.h.1.attn.c_proj"]
CAPTURE = ("activations", "gradients", "weight_grads")


class Norm(nn.Module):
    """Normalises rows: 0/0 (NaN) where a row is constant."""

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / var.sqrt()


def mlp():
    torch.manual_seed(0)
    # 32 x 512 outputs take the per-tensor kernels, 32 x 2 the batched ones
    return nn.Sequential(nn.Linear(8, 512), nn.ReLU(), Norm(), nn.Linear(512, 2))


def plain_loop(model, rec=None, oracle=None):
    """SGD steps; the last one's first layer is zeroed, so Norm makes NaN (0/0)
    there; an evaluation pass (paused) after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(STEPS):
        if i == STEPS - 1:
            with torch.no_grad():
                model[0].weight.zero_()
                model[0].bias.zero_()
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(i))
        if oracle is not None:
            oracle.begin(i)
        scope = rec.step(i) if rec is not None else None
        if scope is not None:
            scope.__enter__()
        loss = model(x).pow(2).mean()
        loss.backward()
        if scope is not None:
            scope.__exit__(None, None, None)
        if oracle is not None:
            oracle.end()
        opt.step()
        opt.zero_grad()
        if rec is not None:
            with rec.pause(), oracle.pause(), torch.no_grad():
                model(torch.randn(4, 8))
        else:
            with torch.no_grad():
                model(torch.randn(4, 8))       # evaluation, outside any step


def gpt2():
    import transformers
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def token_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 64, (12,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def hugging_face(store, out_dir):
    import transformers
    from tensortape.recorder.integrations import TrainerCallback
    model = gpt2()
    oracle = Oracle(model, GPT2_LAYERS, CAPTURE)

    class Mirror(transformers.TrainerCallback):
        """The oracle's steps where the recorder's are: an optimizer step each."""

        def on_step_begin(self, args, state, control, **kwargs):
            if oracle.step is None:
                oracle.begin(state.global_step)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if oracle.step is not None:
                oracle.end()

        on_step_end = on_pre_optimizer_step

    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, eval_strategy="steps", eval_steps=2,
        save_strategy="no", report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
        learning_rate=1e-3, max_grad_norm=0.0)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=token_rows(2 * ACCUM * STEPS, 0),
        eval_dataset=token_rows(4, 1), data_collator=transformers.default_data_collator,
        callbacks=[TrainerCallback(store, layers=GPT2_LAYERS, capture=CAPTURE, tensors_every=2,
                                   stats_every=1),
                   Mirror()])
    trainer.train()
    return oracle, ""


def lightning(store, out_dir):
    import lightning.pytorch as pl
    from tensortape.recorder.integrations import LightningCallback

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

    model = gpt2()
    oracle = Oracle(model, GPT2_LAYERS, CAPTURE)    # the inner model: a micro-batch a call

    class Mirror(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if oracle.step is None:
                oracle.begin(trainer.global_step)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            oracle.end()

    rows = torch.stack([r["input_ids"] for r in token_rows(2 * ACCUM * STEPS, 0)])
    train = torch.utils.data.DataLoader(rows, batch_size=2)
    val = torch.utils.data.DataLoader(rows[:4], batch_size=2)
    trainer = pl.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUM, accelerator="cpu",
                         val_check_interval=ACCUM, num_sanity_val_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out_dir,
                         callbacks=[LightningCallback(store, layers=[f"model.{p}" for p in GPT2_LAYERS],
                                                      capture=CAPTURE, tensors_every=2,
                                                      stats_every=1),
                                    Mirror()])
    trainer.fit(Module(model), train, val)
    return oracle, "model."


def compiled_kept() -> bool | None:
    """Whether every compiled statistics kernel this process made is still
    compiled (None: tensortape compiled nothing here)."""
    engines = sys.modules.get("tensortape.recorder.capture._engines")
    if engines is None:
        return None
    numba = [e for e in engines._instances.values() if type(e).__name__ == "NumbaEngine"]
    if numba:          # the numba engine: its kernels load under -W error (waited for here)
        return all(e.ready(d, wait=True) for e in numba for d in list(e._ready))
    compiled = [e for e in engines._instances.values() if e.compile]
    if not compiled or not any(e._compiled for e in compiled):
        return None
    return all(v is not False for e in compiled for v in e._compiled.values())


def expected(oracle, prefix=""):
    """What the store must hold, as JSON (NaN allowed)."""
    stats, hists = [], []
    for step, kind, name in oracle.keys():
        want = oracle.stats(step, kind, name)
        stats.append([step, kind, prefix + name, {k: float(v) for k, v in want.items()}])
        h = oracle.histogram(step, kind, name)
        hists.append([step, kind, prefix + name, None if h is None else h.tolist()])
    events = [[s, prefix + n, *rest] for s, n, *rest in oracle.events()]
    return {"names": [prefix + n for n in oracle.names()], "stats": stats, "hists": hists,
            "events": events, "outside": oracle.outside, "dropped": oracle.dropped}


def main(mode, out, store=None):
    prefix = ""
    if mode == "plain":
        from tensortape.recorder import Recorder
        model = mlp()
        oracle = Oracle(model, "*", ("activations", "gradients"), tensors_every=2)
        with Recorder(model, store, tensors_every=2, on_nonfinite="replay", stats_every=1) as rec:
            plain_loop(model, rec, oracle)
    elif mode == "bare":                    # knows nothing of tensortape
        model = mlp()
        oracle = Oracle(model, "*", ("activations", "gradients"))
        plain_loop(model, oracle=oracle)
    elif mode == "hf":
        oracle, prefix = hugging_face(store, os.path.join(os.path.dirname(out), "hf-out"))
    elif mode == "lightning":
        oracle, prefix = lightning(store, os.path.join(os.path.dirname(out), "pl-out"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    oracle.close()
    result = expected(oracle, prefix)
    result["compiled_kept"] = compiled_kept()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
