"""Reading a GGUF file's contract: time, and proof that tensors stay memory-mapped.

A Llama-shaped GGUF (24 blocks, hidden 2048, 49 norm tensors plus one 8 MiB f16 projection per block,
about 200 MB) is written to a temporary folder; a fresh process reads its contract and reports the wall
time and how far its peak resident memory rose above the level after imports; as a control, the same
process then reads every tensor's bytes, which raises the peak by about the file size. Target: the rise is a small
fraction of the file size (only the norm weights are copied).
Run: .venv/bin/python bench/contract.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

LAYERS, HIDDEN = 24, 2048

CHILD = r"""
import json, sys, time
from normscope.artifacts import contract
import gguf  # imported before the baseline, like normscope's own imports

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])  # KiB

def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

reset_peak()
base = status("VmRSS")
times = []
for _ in range(3):
    t0 = time.perf_counter()
    c = contract(sys.argv[1])
    times.append(time.perf_counter() - t0)
rise = status("VmHWM") - base
# control: the same measure when every tensor's bytes are read shows what loading would cost
reset_peak()
base = status("VmRSS")
reader = gguf.GGUFReader(sys.argv[1], "r")
total = sum(float(t.data.sum(dtype="float64")) for t in reader.tensors)
control = status("VmHWM") - base
print(json.dumps({"sites": len(c.sites), "times": times, "rise_kib": rise, "control_kib": control, "eps": c.eps}))
"""


def write(path: Path) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(LAYERS)
    w.add_layer_norm_rms_eps(1e-5)
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.normal(1, 0.05, HIDDEN).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.normal(0, 0.02, (HIDDEN, HIDDEN)).astype(np.float16))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", rng.normal(1, 0.05, HIDDEN).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    src = Path(__file__).resolve().parent.parent / "src"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-24.gguf"
        write(path)
        size = path.stat().st_size
        out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
        r = json.loads(out.stdout)
    rise = r["rise_kib"] * 1024
    print(f"GGUF file: {size / 2**20:.1f} MiB, {r['sites']} norm sites, ε = {r['eps']:g}")
    print(f"contract(): best {min(r['times']) * 1e3:.0f} ms, first {r['times'][0] * 1e3:.0f} ms (3 reads)")
    print(f"peak RSS rise while reading: {rise / 2**20:.2f} MiB = {100 * rise / size:.2f}% of the file "
          f"({'memory-mapped' if rise < 0.1 * size else 'NOT memory-mapped'})")
    print(f"control, reading every tensor's bytes in the same process: +{r['control_kib'] / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
