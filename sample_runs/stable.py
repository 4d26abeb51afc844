"""A stable run: python sample_runs/stable.py OUT"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensortape.sample_runs.task import record  # noqa: E402

if __name__ == "__main__":
    record(sys.argv[1])
