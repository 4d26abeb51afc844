"""A real, small task for the sample runs: a transformer learns to sort digits.

Each sequence of 12 digits must be mapped, position by position, to its sorted
version.  It trains on the CPU in well under a minute and reaches high
accuracy with the stable settings; with ``diverge=True`` a too-large learning
rate makes it blow up to NaN at a reproducible step.
"""

from __future__ import annotations

import torch
from torch import nn

from tensortape.recorder import Recorder

VOCAB, LENGTH = 10, 12


class Sorter(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(LENGTH, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x) + self.pos))


LAYERS = ["embed", "encoder.layers.*.self_attn", "encoder.layers.*.linear*", "head"]


def record(out: str, *, seed: int = 0, steps: int | None = None, diverge: bool = False,
           mode: str = "w-", log=print) -> str:
    """Train the sorter and record it into ``out``; returns ``out``.

    ``steps`` defaults to 150, or 60 for a diverging run (it is NaN by step 10).
    """
    if steps is None:
        steps = 60 if diverge else 150
    torch.manual_seed(seed)
    model = Sorter()
    lr = 3.0 if diverge else 3e-3
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if diverge else \
        torch.optim.Adam(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1000 + seed)
    meta = {"task": "sort 12 digits", "seed": seed, "lr": lr, "diverge": diverge}
    with Recorder(model, out, layers=LAYERS, stats_every=1, tensors_every=25, ring=3,
                  on_nonfinite="dump", mode=mode, metadata=meta) as rec:   # a short run: every step
        for step in range(steps):
            x = torch.randint(0, VOCAB, (64, LENGTH), generator=data)
            y = x.sort(dim=1).values
            with rec.step(step):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0) if not diverge else None
            opt.step()
            opt.zero_grad()
            if step % 25 == 0 or step == steps - 1:
                acc = (logits.argmax(-1) == y).float().mean().item()
                log(f"step {step:4d}  loss {loss.item():8.4f}  accuracy {acc:.3f}")
    return out
