"""Time of the acceptance battery.

Targets on a 2-core machine: full battery on torch.nn.LayerNorm(64) ≤ 10 s, --quick ≤ 2 s.
Run: .venv/bin/python bench/check.py
"""

from __future__ import annotations

import time

import torch

from normscope import check

SHAPE = (2, 8, 64)
TARGETS = {"full": 10.0, "quick": 2.0}


def timed(quick: bool, make) -> tuple[float, object]:
    best, report = None, None
    for _ in range(3):
        t0 = time.perf_counter()
        report = check(make(), expect="torch_layernorm" if "LayerNorm" in repr(make()) else "torch_rmsnorm",
                       shape=SHAPE, quick=quick)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, report


def main() -> None:
    check(torch.nn.LayerNorm(64), expect="torch_layernorm", shape=SHAPE, quick=True)  # warm-up
    print(f"{'target':24} {'mode':6} {'seconds':>8} {'target s':>9} {'ratio':>6} {'calls':>6} {'findings':>9}  verdict")
    for name, make in (("torch LayerNorm(64)", lambda: torch.nn.LayerNorm(64)),
                       ("torch RMSNorm(64)", lambda: torch.nn.RMSNorm(64))):
        for mode, limit in TARGETS.items():
            seconds, report = timed(mode == "quick", make)
            print(f"{name:24} {mode:6} {seconds:8.3f} {limit:9.1f} {seconds / limit:6.2f} {report.calls:6d} "
                  f"{len(report.findings):9d}  {'PASS' if report.ok else 'FAIL'}")


if __name__ == "__main__":
    main()
