"""`make demo`: a tour of normscope on built-in defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(*args: str, expect: int = 0) -> None:
    print(f"\n$ normscope {' '.join(args)}", flush=True)
    path = os.environ.get("PYTHONPATH")  # examples/ first, then whatever the caller set (e.g. src)
    env = {**os.environ, "PYTHONPATH": str(HERE) + (os.pathsep + path if path else "")}
    code = subprocess.run([sys.executable, "-m", "normscope", *args], env=env).returncode
    if code != expect:
        sys.exit(f"demo: `normscope {' '.join(args)}` exited {code}, expected {expect}")


if __name__ == "__main__":
    run("explain")
    run("presets")
    run("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,64")
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "layernorm.onnx"
        subprocess.run([sys.executable, str(HERE / "onnx_layernorm.py"), str(onnx_path)], check=True)
        run("infer", str(onnx_path), "--shape", "2,8,64")
    run("infer", "primer:layer_norm", "--framework", "numpy", "--shape", "2,8,64")
    run("check", "torch.nn:RMSNorm", "--args", "[64]", "--shape", "2,8,64", "--expect", "torch_rmsnorm")
    run("check", "primer:layer_norm", "--framework", "numpy", "--shape", "2,8,64", "--expect", "torch_layernorm",
        expect=1)
    print("\ndemo: done (the last check fails on purpose: the primer divides by std + ε)")
