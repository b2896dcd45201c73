"""`make demo`: a tour of normscope on built-in defaults."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> None:
    print(f"\n$ normscope {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "normscope", *args], check=True)


if __name__ == "__main__":
    run("explain")
    run("presets")
