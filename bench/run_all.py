"""`make bench`: the benchmarks in this folder, one after another, each in its own process (bench/xiong2020.py,
a training reproduction of several CPU-minutes, runs on its own: python bench/xiong2020.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    failed = []
    for script in ("infer.py", "check.py", "scan.py", "contract.py", "diff.py", "trace.py", "kernel_bandwidth.py"):
        print(f"\n=== bench/{script}", flush=True)
        if subprocess.run([sys.executable, str(HERE / script)]).returncode != 0:
            failed.append(script)
    if failed:
        sys.exit(f"bench: {', '.join(failed)} exited with an error")
