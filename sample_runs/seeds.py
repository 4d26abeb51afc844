"""The stable run under two seeds, for compare: python sample_runs/seeds.py OUT [STEPS]
(writes OUT/seed0.zarr and OUT/seed1.zarr; STEPS: as the stable run's, 150)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensortape.sample_runs.task import record  # noqa: E402

if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    for seed in (0, 1):
        record(os.path.join(sys.argv[1], f"seed{seed}.zarr"), seed=seed,
               steps=int(sys.argv[2]) if len(sys.argv) > 2 else None)
