"""Activations as a data set, end to end: python sample_runs/sae.py OUT [STEPS]

Records a small GPT-2 (random initialisation, nothing downloaded) learning a toy
language for STEPS steps (default 300): the residual stream after its second
block as full tensors, with the token ids beside it (``capture="batch"``).
Then trains a sparse autoencoder on the recorded rows with plain torch
(``run.dataset``: shuffled in bounded memory) and draws its reconstruction
loss: OUT/run.zarr, OUT/sae.png.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, SEQ, BATCH, D = 64, 32, 8, 64


def toy_language(steps: int, seed: int = 0):
    """Batches of a first-order Markov chain: each token has three likely successors."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)
    for _ in range(steps):
        ids = torch.empty(BATCH, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for t in range(1, SEQ):
            pick = torch.randint(0, 3, (BATCH,), generator=g)
            ids[:, t] = successors[ids[:, t - 1], pick]
        yield ids


def record_lm(store: str, steps: int) -> list[float]:
    """Train the model for ``steps`` steps, recording one residual stream and the
    token ids; the language-model losses."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from tensortape import Recorder
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    with Recorder(model, store, layers="transformer.h.1", capture=("activations", "batch"),
                  stats_every=1, tensors_every=1, compression=None, max_bytes=None,
                  mode="w") as rec:
        for ids in toy_language(steps):
            with rec.step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                rec.log({"loss": loss})
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return losses


class SparseAutoencoder(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.enc = nn.Linear(d, hidden)
        self.dec = nn.Linear(hidden, d)

    def forward(self, x):
        f = torch.relu(self.enc(x))
        return self.dec(f), f


def train_sae(store: str, epochs: int = 2, hidden: int = 256, l1: float = 0.1) -> dict:
    """A sparse autoencoder on the recorded rows: the fraction of variance it
    leaves unexplained and its active features, batch by batch."""
    from tensortape import open_run
    run = open_run(store)
    layer = run.tensor_layers("activations")[0]
    ds = run.dataset(layer, batch_size=512, buffer_rows=8192, seed=0)
    torch.manual_seed(0)
    sae = SparseAutoencoder(D, hidden)
    opt = torch.optim.Adam(sae.parameters(), lr=2e-3)
    out = {"layer": layer, "rows": len(ds), "fvu": [], "active": [], "tokens_seen": set()}
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in torch.utils.data.DataLoader(ds, batch_size=None):
            x = batch["x"].float()
            x = x - x.mean(0)
            x = x / x.pow(2).sum(-1).mean().sqrt()      # unit mean square norm: mse is the FVU
            rec, f = sae(x)
            mse = (rec - x).pow(2).sum(-1).mean()
            loss = mse + l1 * f.abs().sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out["fvu"].append(float(mse.detach()))
            out["active"].append(float((f > 0).float().sum(-1).mean()))
            out["tokens_seen"].update(batch["token"].tolist())
    return out


def draw(lm_losses, sae, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(lm_losses)
    a.set_xlabel("training step")
    a.set_ylabel("language-model loss")
    a.set_title("GPT-2 (2 layers), recorded")
    b.plot(sae["fvu"], label="unexplained variance")
    b.set_xlabel("SAE batch (512 recorded rows)")
    b.set_ylabel("fraction of variance unexplained")
    b.set_ylim(0, None)
    b.set_title(f"sparse autoencoder on {sae['layer']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str, steps: int = 300, epochs: int = 2) -> dict:
    os.makedirs(out, exist_ok=True)
    store = os.path.join(out, "run.zarr")
    lm = record_lm(store, steps)
    sae = train_sae(store, epochs)
    draw(lm, sae, os.path.join(out, "sae.png"))
    print(f"recorded {sae['rows']} rows of {sae['layer']} over {steps} steps; SAE unexplained "
          f"variance {sae['fvu'][0]:.3f} -> {sae['fvu'][-1]:.3f}, "
          f"{sae['active'][-1]:.1f} active features a row; {os.path.join(out, 'sae.png')}")
    return {"lm": lm, "sae": sae}


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
