"""Fused norm kernels against a copy, eager torch and torch.compile, as same-run ratios (CPU: numba; CUDA: Triton).

    PYTHONPATH=src python bench/kernel_bandwidth.py                    # 2 threads, 8192 × 4096 float32, N sweep, plot
    PYTHONPATH=src python bench/kernel_bandwidth.py --threads 2 --no-compile --plot docs/kernels_gbps.png
    PYTHONPATH=src python bench/kernel_bandwidth.py --device cuda --dtype bfloat16   # the Triton kernels on a GPU

The process re-runs itself with glibc's malloc told to keep freed memory (``MALLOC_MMAP_MAX_=0``,
``MALLOC_TRIM_THRESHOLD_``): otherwise every fresh 128 MiB output (of every implementation alike) is a new
mmap whose first touch page-faults, which costs more than the kernel (measured: ``--system-malloc``).

Every number is measured in this run. The implementations are timed in ``--rounds`` interleaved rounds: each
is called once per round, in an order that rotates from round to round, so a change of a shared machine's load
hits every implementation of a round alike; each ratio is taken within a round and printed as the median over the
rounds with its range (the times are medians over rounds). Bandwidth is the bytes a call must move (read x [and
the residual], write y [and h]; backward: read x and dy, write dx) over its time. A norm's output is a fresh
tensor, so its fair limit is an allocating copy (``x.clone()``), printed beside ``dst.copy_(x)``. The targets are
printed with each ratio, met or not; on CUDA every call is timed to a ``torch.cuda.synchronize()``.
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


def timed(fn, repeat: int, sync=None, warm: int = 3) -> float:
    """The median of ``repeat`` timed calls of one implementation after ``warm`` untimed ones."""
    return statistics.median(interleaved({"": fn}, repeat, sync, warm)[""])


def interleaved(fns: dict, rounds: int, sync=None, warm: int = 3) -> dict[str, list[float]]:
    """Seconds per call of each implementation in each of ``rounds`` rounds; within a round every implementation
    runs once, in an order that rotates from round to round (no implementation always first, or always after the
    same one)."""
    for fn in fns.values():
        for _ in range(warm):  # compiles, caches, and pages the heap in (the first calls after another size allocate)
            fn()
    if sync:
        sync()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            if sync:
                sync()
            times[name].append(time.perf_counter() - t)
    return times


def streaming_stores(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the CPU kernels' streaming stores switched on (``NORMSCOPE_STREAMING_STORES=1``:
    outputs at least as large as the last-level cache)."""
    from normscope.kernels import streaming

    keep, streaming.STREAM_MIN_BYTES = streaming.STREAM_MIN_BYTES, streaming.LAST_LEVEL_CACHE_BYTES
    try:
        return fn(*args, **kwargs)
    finally:
        streaming.STREAM_MIN_BYTES = keep


def per_round(top: list[float], bottom: list[float]) -> list[float]:
    return [a / b for a, b in zip(top, bottom, strict=True)]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


#: above this 1-minute load average the run is not a quiet machine's (a warning says so)
QUIET_LOAD = 0.5
#: the targets of the kernel issue, as same-run ratios (name → (target, how it is computed))
TARGETS = {
    "RMS forward / x.clone() bandwidth": 0.9,
    "LN forward / x.clone() bandwidth": 0.9,
    # 1.5 retired: eager LayerNorm runs near the copy on the CPU, and no forward beats the copy (its ceiling)
    "LN forward vs eager F.layer_norm": 1.0,
    "RMS forward vs torch.compile(F.rms_norm)": 1.5,
    "fused add + RMS vs unfused eager": 2.0,
    "RMS fwd + bwd vs eager autograd": 4.0,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the Triton kernels against eager, torch.compile and a device-to-device copy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds of the main comparison")
    ap.add_argument("--repeat", type=int, default=7, help="timed calls per point of the N sweep")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it needs a C++ compiler)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-small", action="store_true", help="skip the per-call cost of small inputs")
    ap.add_argument("--plot", default="kernels_gbps.png", help="where to write the GB/s plot ('' for none)")
    ap.add_argument("--system-malloc", action="store_true", help="keep glibc's default mmap/trim behaviour")
    args = ap.parse_args(argv)
    keep = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
    if args.device == "cpu" and not args.system_malloc and any(os.environ.get(k) != v for k, v in keep.items()) \
            and argv is None:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **keep})

    dev = torch.device(args.device)
    sync = None
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device here")
        sync = torch.cuda.synchronize
        where = f"CUDA {torch.cuda.get_device_name()}, Triton kernels"
    else:
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
        load = os.getloadavg()[0]
        where = f"CPU, {args.threads} threads (torch and numba), load average {load:.1f}"
        if load > QUIET_LOAD:
            print(f"warning: load average {load:.1f} > {QUIET_LOAD}: other work shares the memory bus, and a copy "
                  "slowed by it hides how far a kernel is from the memory limit; the targets are judged on a quiet "
                  "machine", file=sys.stderr)
    torch.manual_seed(0)
    m, n = args.rows, args.hidden
    dt = getattr(torch, args.dtype)
    x = torch.randn(m, n, device=dev).to(dt)
    r = torch.randn(m, n, device=dev).to(dt)
    w = (1 + 0.1 * torch.randn(n, device=dev)).to(dt)
    b = (0.1 * torch.randn(n, device=dev)).to(dt)
    dy = torch.randn(m, n, device=dev).to(dt)
    nb = x.numel() * x.element_size()
    print(f"{where}, {m} × {n} {args.dtype}, {args.rounds} interleaved rounds")

    dst = torch.empty_like(x)
    fns = {"copy": lambda: dst.copy_(x), "clone": lambda: x.clone(),
           "rms": lambda: norm(x, RMS, w), "ln": lambda: norm(x, LN, w, b),
           "rms eager": lambda: F.rms_norm(x, (n,), w, 1e-6), "ln eager": lambda: F.layer_norm(x, (n,), w, b, 1e-5)}
    if args.device == "cpu":  # the same kernels with streaming stores (an opt-in): what they would gain, in this run
        fns["rms streaming"] = lambda: streaming_stores(norm, x, RMS, w)
        fns["ln streaming"] = lambda: streaming_stores(norm, x, LN, w, b)
    if not args.no_compile:
        compiled = torch.compile(lambda a, g: F.rms_norm(a, (a.shape[-1],), g, 1e-6), dynamic=False)
        fns["rms compiled"] = lambda: compiled(x, w)
    fns["add"] = lambda: norm(x, RMS, w, residual=r)

    def add_eager():
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-6), h

    fns["add eager"] = add_eager
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()

    def fb_ns():
        xg.grad = wg.grad = None
        norm(xg, RMS, wg).backward(dy)

    def fb_eager():
        xg.grad = wg.grad = None
        F.rms_norm(xg, (n,), wg, 1e-6).backward(dy)

    fns["fb"], fns["fb eager"] = fb_ns, fb_eager
    times = interleaved(fns, args.rounds, sync)
    med = {k: statistics.median(v) for k, v in times.items()}

    labels = [("copy", "copy into an existing tensor (dst.copy_(x))", 2), ("clone", "copy into a new tensor (x.clone())", 2),
              ("rms", "normscope RMS forward", 2), ("rms streaming", "  the same, streaming stores", 2),
              ("rms eager", "eager F.rms_norm", 2), ("rms compiled", "torch.compile(F.rms_norm)", 2),
              ("ln", "normscope LN forward", 2), ("ln streaming", "  the same, streaming stores", 2),
              ("ln eager", "eager F.layer_norm", 2), ("add", "normscope add + RMS (fused)", 4),
              ("add eager", "eager x + r; F.rms_norm", 4), ("fb", "normscope RMS fwd + bwd", 5),
              ("fb eager", "eager autograd RMS fwd + bwd", 5)]
    print(f"{'':46}{'ms':>9}{'GB/s':>9}   (medians over rounds)")
    for key, name, tensors in labels:
        if key in med:
            print(f"{name:46}{med[key] * 1e3:9.3f}{gbps(tensors * nb, med[key]):9.2f}")

    clone = times["clone"]
    # name → (the ratio per round, the ceiling per round: the peer's time over x.clone()'s for each tensor moved)
    ratios = {
        "RMS forward / x.clone() bandwidth": (per_round(clone, times["rms"]), None),
        "LN forward / x.clone() bandwidth": (per_round(clone, times["ln"]), None),
        "LN forward vs eager F.layer_norm": (per_round(times["ln eager"], times["ln"]),
                                             per_round(times["ln eager"], clone)),
        "RMS forward vs torch.compile(F.rms_norm)": ((per_round(times["rms compiled"], times["rms"]),
                                                     per_round(times["rms compiled"], clone))
                                                    if "rms compiled" in times else (None, None)),
        "fused add + RMS vs unfused eager": (per_round(times["add eager"], times["add"]),
                                             per_round(times["add eager"], [2 * c for c in clone])),
        "RMS fwd + bwd vs eager autograd": (per_round(times["fb eager"], times["fb"]), None),
    }
    print("\nsame-run ratios, each taken within a round: median over rounds (min … max); ceiling: what a kernel as "
          "fast as x.clone() for each tensor it must move would reach")
    for name, (values, ceilings) in ratios.items():
        target = TARGETS[name]
        if values is None:
            print(f"  {name:42} not measured (--no-compile)")
            continue
        value = statistics.median(values)
        line = (f"  {name:42} {value:6.2f} ({min(values):.2f} … {max(values):.2f})  target ≥ {target:<4g} "
                f"{'met' if value >= target else 'NOT met'}")
        if ceilings is not None:
            ceiling = statistics.median(ceilings)
            line += f"  (ceiling {ceiling:.2f}{': out of reach here' if ceiling < target else ''})"
        print(line)

    if "rms streaming" in times:
        print("  streaming stores' gain (an opt-in, NORMSCOPE_STREAMING_STORES=1; not a target): RMS forward "
              + ", LN forward ".join(f"{statistics.median(per_round(times[k], times[k + ' streaming'])):.2f}×"
                                     for k in ("rms", "ln")))
    if args.device == "cuda":
        return 0
    if not args.no_small:
        small_calls(args)
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


def small_calls(args, calls: int = 200) -> None:
    """Microseconds per call of an RMS forward on a few rows (decoding one token, a small batch), where the cost of
    a call (argument checks, tensor views, the kernel launch) outweighs the rows: eager, normscope without autograd
    (no input requires grad, or under no_grad) and with it; ``calls`` back-to-back calls per timing."""
    n = args.hidden
    print(f"\nsmall inputs: µs per call of an RMS forward (hidden {n}, float32; median over {args.rounds} rounds of "
          f"{calls} calls)")
    print(f"{'rows':>6}{'eager':>10}{'normscope':>11}{'(autograd)':>12}{'eager / normscope':>19}")
    for rows in (1, 8, 64, 512):
        t = _small_point(rows, n, args.rounds, calls)
        us = {k: statistics.median(v) / calls * 1e6 for k, v in t.items()}
        ratio = statistics.median(per_round(t["eager"], t["normscope"]))
        print(f"{rows:>6}{us['eager']:>10.1f}{us['normscope']:>11.1f}{us['autograd']:>12.1f}{ratio:>19.2f}")


def _small_point(rows: int, n: int, rounds: int, calls: int) -> dict[str, list[float]]:
    x, w = torch.randn(rows, n), 1 + 0.1 * torch.randn(n)
    xg = x.clone().requires_grad_()

    def many(fn):
        return lambda: [fn() for _ in range(calls)]

    return interleaved({"eager": many(lambda: F.rms_norm(x, (n,), w, 1e-6)),
                        "normscope": many(lambda: norm(x, RMS, w)),
                        "autograd": many(lambda: norm(xg, RMS, w))}, rounds)


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
