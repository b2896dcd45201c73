"""`make bench`: every benchmark in this folder, one after another."""

from __future__ import annotations

import runpy
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    for script in ("infer.py", "check.py", "scan.py", "trace.py"):
        print(f"\n=== bench/{script}")
        runpy.run_path(str(HERE / script), run_name="__main__")
