"""`make bench`: the benchmarks in this folder, one after another (bench/xiong2020.py, a training
reproduction of several CPU-minutes, runs on its own: python bench/xiong2020.py)."""

from __future__ import annotations

import runpy
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    for script in ("infer.py", "check.py", "scan.py", "contract.py", "diff.py", "trace.py", "kernels.py"):
        print(f"\n=== bench/{script}")
        runpy.run_path(str(HERE / script), run_name="__main__")
