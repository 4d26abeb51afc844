"""Gradient accumulation, knowing nothing of tensortape (for `tensortape record`):
each optimizer step takes 2 micro-batches.

    python accum_train.py STEPS

A test builds the same model with ``build()`` and trains it with ``train()`` under
plain torch hooks, as the oracle of what the recording holds.
"""
import sys

import torch
from torch import nn

MICRO = 2


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        for _ in range(MICRO):
            model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    train(build(), int(sys.argv[1]))
    print("trained")
