"""A training script that knows nothing of tensortape (for `tensortape record`)."""
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = int(sys.argv[1])
for i in range(steps):
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(torch.randn(3, 8))          # evaluation
print("trained", steps)
sys.exit(3)
