"""Fused norm kernels against memcpy and eager torch, as same-run ratios (CPU, numba; GPU when there is one).

    PYTHONPATH=src python bench/kernels.py                    # 2 threads, 8192 × 4096 float32, N sweep, plot
    PYTHONPATH=src python bench/kernels.py --threads 2 --no-compile --plot docs/kernels_gbps.png

The process re-runs itself with glibc's malloc told to keep freed memory (``MALLOC_MMAP_MAX_=0``,
``MALLOC_TRIM_THRESHOLD_``): otherwise every fresh 128 MiB output (of every implementation alike) is a new
mmap whose first touch page-faults, which costs more than the kernel (measured: ``--system-malloc``).

Every number is measured in this run: the median of ``--repeat`` timed calls after a warm-up. Bandwidth is
the bytes a call must move (read x [and the residual], write y [and h]; backward: read x and dy, write dx)
over its time. The targets (issue: fused norm kernels) are printed with each ratio, met or not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from normscope import NormSpec  # noqa: E402
from normscope.kernels import norm  # noqa: E402

RMS = NormSpec.preset("torch_rmsnorm", eps=1e-6)
LN = NormSpec.preset("torch_layernorm")


def timed(fn, repeat: int) -> float:
    fn()  # warm-up (compiles, caches, pages in)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it needs a C++ compiler)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--plot", default="kernels_gbps.png", help="where to write the GB/s plot ('' for none)")
    ap.add_argument("--system-malloc", action="store_true", help="keep glibc's default mmap/trim behaviour")
    args = ap.parse_args(argv)
    keep = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
    if not args.system_malloc and any(os.environ.get(k) != v for k, v in keep.items()) and argv is None:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **keep})

    import numba

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    torch.manual_seed(0)
    m, n = args.rows, args.hidden
    x = torch.randn(m, n)
    r = torch.randn(m, n)
    w = 1 + 0.1 * torch.randn(n)
    b = 0.1 * torch.randn(n)
    dy = torch.randn(m, n)
    nb = x.numel() * x.element_size()
    print(f"CPU, {args.threads} threads (torch and numba), {m} × {n} float32, median of {args.repeat}")

    dst = torch.empty_like(x)
    t_copy = timed(lambda: dst.copy_(x), args.repeat)
    bw_copy = gbps(2 * nb, t_copy)
    t_clone = timed(lambda: x.clone(), args.repeat)
    rows = [("memcpy (dst.copy_(x))", t_copy, bw_copy), ("memcpy into a new tensor (x.clone())", t_clone,
                                                          gbps(2 * nb, t_clone))]

    def fwd_rms():
        return norm(x, RMS, w)

    def fwd_ln():
        return norm(x, LN, w, b)

    t_rms = timed(fwd_rms, args.repeat)
    t_ln = timed(fwd_ln, args.repeat)
    t_rms_eager = timed(lambda: F.rms_norm(x, (n,), w, 1e-6), args.repeat)
    t_ln_eager = timed(lambda: F.layer_norm(x, (n,), w, b, 1e-5), args.repeat)
    t_add = timed(lambda: norm(x, RMS, w, residual=r), args.repeat)

    def add_eager():
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-6), h

    t_add_eager = timed(add_eager, args.repeat)

    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()

    def fb_ns():
        xg.grad = wg.grad = None
        norm(xg, RMS, wg).backward(dy)

    def fb_eager():
        xg.grad = wg.grad = None
        F.rms_norm(xg, (n,), wg, 1e-6).backward(dy)

    t_fb = timed(fb_ns, args.repeat)
    t_fb_eager = timed(fb_eager, args.repeat)

    rows += [
        ("normscope RMS forward", t_rms, gbps(2 * nb, t_rms)),
        ("eager F.rms_norm", t_rms_eager, gbps(2 * nb, t_rms_eager)),
        ("normscope LN forward", t_ln, gbps(2 * nb, t_ln)),
        ("eager F.layer_norm", t_ln_eager, gbps(2 * nb, t_ln_eager)),
        ("normscope add + RMS (fused)", t_add, gbps(4 * nb, t_add)),
        ("eager x + r; F.rms_norm", t_add_eager, gbps(4 * nb, t_add_eager)),
        ("normscope RMS fwd + bwd", t_fb, gbps(5 * nb, t_fb)),
        ("eager autograd RMS fwd + bwd", t_fb_eager, gbps(5 * nb, t_fb_eager)),
    ]
    print(f"{'':38}{'ms':>9}{'GB/s':>9}")
    for name, t, bw in rows:
        print(f"{name:38}{t * 1e3:9.2f}{bw:9.2f}")

    def verdict(value, target):
        return f"{value:6.2f}  target ≥ {target:<5g} {'met' if value >= target else 'NOT met'}"

    print("\nsame-run ratios")
    print("  RMS forward / memcpy bandwidth  ", verdict(gbps(2 * nb, t_rms) / bw_copy, 0.8))
    print("  LN forward / memcpy bandwidth   ", verdict(gbps(2 * nb, t_ln) / bw_copy, 0.8))
    print("  RMS forward vs eager F.rms_norm ", verdict(t_rms_eager / t_rms, 5))
    print("  LN forward vs eager F.layer_norm", verdict(t_ln_eager / t_ln, 2))
    print("  fused add + RMS vs unfused eager", verdict(t_add_eager / t_add, 1.5))
    print("  RMS fwd + bwd vs eager autograd ", verdict(t_fb_eager / t_fb, 3))

    if args.no_sweep:
        return 0
    total = m * n
    sweep = [512, 1024, 2048, 4096, 8192, 16384]
    curves: dict[str, list[float]] = {"memcpy": [], "eager F.rms_norm": [], "normscope RMS": []}
    if not args.no_compile:
        curves["torch.compile F.rms_norm"] = []
    print(f"\nN sweep (rows × N = {total}, float32, forward RMS), GB/s"
          + ("" if args.no_compile else "; torch.compile's compile time apart"))
    print(f"{'N':>7}" + "".join(f"{k:>26}" for k in curves) + ("" if args.no_compile else f"{'compile s':>11}"))
    for nn_ in sweep:
        vals, extra = _sweep_point(total // nn_, nn_, args)
        for k, v in zip(curves, vals, strict=True):
            curves[k].append(v)
        print(f"{nn_:>7}" + "".join(f"{v:26.2f}" for v in vals) + extra)

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for k, v in curves.items():
            ax.plot(sweep, v, marker="o", label=k)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hidden size N (rows × N fixed)")
        ax.set_ylabel("GB/s (read x + write y)")
        ax.set_title(f"RMSNorm forward, float32, CPU {args.threads} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


def _sweep_point(rows: int, n: int, args) -> tuple[list[float], str]:
    """GB/s of memcpy, eager, normscope (and torch.compile) RMS forward at rows × n; compile seconds apart."""
    xs = torch.randn(rows, n)
    ws = 1 + 0.1 * torch.randn(n)
    out = torch.empty_like(xs)
    bytes_ = 2 * xs.numel() * 4
    vals = [gbps(bytes_, timed(lambda: out.copy_(xs), args.repeat)),
            gbps(bytes_, timed(lambda: F.rms_norm(xs, (n,), ws, 1e-6), args.repeat)),
            gbps(bytes_, timed(lambda: norm(xs, RMS, ws), args.repeat))]
    extra = ""
    if not args.no_compile:
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, g: F.rms_norm(a, (a.shape[-1],), g, 1e-6), dynamic=False)
        t0 = time.perf_counter()
        compiled(xs, ws)
        extra = f"{time.perf_counter() - t0:11.1f}"
        vals.append(gbps(bytes_, timed(lambda: compiled(xs, ws), args.repeat)))
    return vals, extra


if __name__ == "__main__":
    raise SystemExit(main())
