"""Overhead of ``normscope.trace`` on a training step, as same-run ratios traced / untraced.

A 6-layer, 256-wide pre-norm decoder (8 heads, MLP 4×, vocabulary 4096, SDPA causal attention), batch 8 × 128,
AdamW, on the CPU. Targets: ≤ 5 % at ``every=1``, ≤ 1 % at ``every=10``. For comparison, a naive forward-hook
cache (every module's output cloned, as an activation cache does) in the same run. The configurations are
interleaved in blocks of 10 steps over several rounds (in an order that rotates from round to round), and each
is summarised by the median of its per-block mean step time; each block's ratio is taken against the untraced
block of its own round, so drift of a shared machine's load hits both sides alike. The finest same-run
comparison comes last: one tracer with ``every=2``, so recorded and unrecorded steps alternate, each recorded
step timed against the mean of the two unrecorded steps around it (``--pairs`` of them). On a loaded machine,
``--threads 1 --clock thread`` measures the CPU time of the training thread instead of wall time, which other
processes do not inflate.
``--model gpt2`` runs the same measurement on a Hugging Face GPT-2 of the same size (6 layers, 256 wide, 8 heads,
eager attention, its default dropout): attention through an eager softmax instead of SDPA.
``--width`` and ``--batch`` change the model's width and the batch (the targets are stated at 256 and 8): the
tracer's statistics read every activation, gradient and parameter once or twice, work that grows with width × tokens
and with the parameters, while a step's arithmetic grows with width² × tokens, so its share falls as models and
batches grow.
``--fixed`` measures only the cost per recorded step that does not grow with the model (the issue's fixed cost):
the decoder at width 8, vocabulary 64, 16 tokens, batch 1, where the statistics' reads are negligible, with the
floors of the design measured beside it.
Run: .venv/bin/python bench/trace.py [--model decoder|gpt2] [--rounds 8] [--pairs 30] [--threads 1 --clock thread]
     [--width 256] [--batch 8] [--fixed]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from normscope.tracing import diagnose, read_run, trace

V, D, H, L, B, T = 4096, 256, 8, 6, 8, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(D, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H, bos_token_id=V - 1, eos_token_id=V - 1)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


class Logits(nn.Module):
    """A model whose output has ``.logits`` (Hugging Face) as plain logits."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(input_ids=idx).logits


class HookCache:
    """The naive alternative: every module's output kept (detached clone) by forward hooks."""

    def __init__(self, model):
        self.model, self.cache, self.handles = model, {}, []

    def __enter__(self):
        for name, m in self.model.named_modules():
            self.handles.append(m.register_forward_hook(
                lambda mod, args, out, name=name: self.cache.__setitem__(name, out.detach().clone())
                if isinstance(out, torch.Tensor) else None))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.cache.clear()


def fixed_cost(rounds: int) -> None:
    """The tracer's cost that does not grow with the model: the bench decoder shrunk until its reads are negligible
    (width 8, vocabulary 64, 16 tokens, batch 1), one thread, the training thread's CPU clock; traced and untraced
    steps in interleaved blocks. Beside it, three floors of the design measured in the same run: an empty
    ``TorchFunctionMode`` around the forward (the dispatch every op of a recorded forward pays), the tracer with every
    probe disabled (its hooks and mode still called, a record of the loss written) and ``json.dumps`` of one step's
    record (the text of its numbers)."""
    import json

    from torch.overrides import TorchFunctionMode

    global D, V, T, B
    D, V, T, B = 8, 64, 16, 1
    torch.set_num_threads(1)
    clock = time.thread_time
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    calls = [0]

    class Empty(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls[0] += 1
            return func(*args, **(kwargs or {}))

    def step(tr=None, s=0, mode=None):
        if mode is not None:
            with mode:
                out = model(idx)
        else:
            out = model(idx)
        loss = F.cross_entropy(out.flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tr is not None:
            tr.step(s, loss=loss.item())

    tmp = tempfile.mkdtemp(prefix="normscope-bench-fixed-")
    tr = trace(model, tmp)
    # the same tracer's structure alone: its hooks, its function mode and its record, every probe disabled
    bare = trace(model, tempfile.mkdtemp(prefix="normscope-bench-fixed-bare-"))
    bare.disabled.update(("data", "blocks", "norms", "attention", "residual", "statistics", "grad", "update"))
    for t in (tr, bare):
        t.open()
        t._detach()
    for _ in range(20):
        step()
    tracers = {"traced": tr, "probes off": bare}
    times: dict[str, list[float]] = {"untraced": [], "traced": [], "empty mode": [], "probes off": []}
    # the process's CPU time (every thread: the tracer's writer thread too) and the wall clock, beside the training
    # thread's own
    cpu: dict[str, list[float]] = {k: [] for k in times}
    wall: dict[str, list[float]] = {k: [] for k in times}
    n = 0
    for r in range(rounds):
        k = r % len(times)
        for name in list(times)[k:] + list(times)[:k]:
            t = tracers.get(name)
            if t is not None:
                t._attach()
            t0, c0, w0 = clock(), time.process_time(), time.perf_counter()
            for _ in range(10):
                if t is not None:
                    step(t, n)
                    n += 1
                else:
                    step(mode=Empty() if name == "empty mode" else None)
            if t is not None:
                t.writer.drain()  # the block's records written within its time
            times[name].append((clock() - t0) / 10)
            cpu[name].append((time.process_time() - c0) / 10)
            wall[name].append((time.perf_counter() - w0) / 10)
            if t is not None:
                t._detach()
    tr.close()
    bare.close()
    left = {e["stage"] for r in read_run(bare.run_dir)[1] for e in r["entries"]} - {"loss"}
    if left:  # a probe the list above does not name: the floor would not be the tracer's structure alone
        raise SystemExit(f"the tracer with every probe disabled still recorded {sorted(left)}")
    records = read_run(tmp)[1]
    own = statistics.median(r["tracer_ms"] for r in records[5:]) / 1e3
    rec = {k: v for k, v in records[-1].items()}
    t0 = time.perf_counter()
    for _ in range(200):
        json.dumps(rec, separators=(",", ":"))
    dump = (time.perf_counter() - t0) / 200
    ops = calls[0] // (10 * rounds)
    base = statistics.median(times["untraced"])
    traced = statistics.median(times["traced"])
    empty = statistics.median(times["empty mode"]) - base
    skeleton = statistics.median(times["probes off"]) - base
    print(f"fixed cost: {L}-layer {D}-wide decoder, vocabulary {V}, {T} tokens, batch {B}, 1 thread, thread clock, "
          f"{rounds} rounds of 10-step blocks; load average {os.getloadavg()[0]:.1f}")
    print(f"  untraced {base * 1e3:.2f} ms/step, traced {traced * 1e3:.2f} ms/step: +{(traced - base) * 1e3:.2f} ms "
          f"(ratio {traced / base:.2f})")
    for label, clk in (("process CPU, all threads", cpu), ("wall clock", wall)):
        b, t = statistics.median(clk["untraced"]), statistics.median(clk["traced"])
        print(f"  {label}: untraced {b * 1e3:.2f} ms/step, traced {t * 1e3:.2f} ms/step: +{(t - b) * 1e3:.2f} ms "
              f"(ratio {t / b:.2f})")
    # the fixed cost is what the step pays, the mode's dispatch and the hooks' included: traced − untraced (the
    # reads are negligible at this size); tracer_ms counts only the time inside the probes
    fixed = traced - base
    print(f"  fixed cost per recorded step (traced − untraced, training thread): {fixed * 1e3:.2f} ms  target ≤ 2 ms: "
          f"{'met' if fixed <= 2e-3 else 'MISSED'}")
    print(f"  of which inside the probes (median of tracer_ms): {own * 1e3:.2f} ms")
    print(f"  floors of this design, same run: an empty function mode {empty * 1e3:.2f} ms/step ({ops} ops, "
          f"{empty / max(ops, 1) * 1e6:.1f} µs each); the tracer with every probe disabled (its hooks, its mode, "
          f"a record of the loss) {skeleton * 1e3:.2f} ms/step; json.dumps of one record ({len(rec['entries'])} "
          f"entries) {dump * 1e3:.2f} ms")


def main():
    global D, B
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("decoder", "gpt2"), default="decoder",
                    help="the bench decoder (SDPA) or a Hugging Face GPT-2 of its size (eager softmax)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block (a multiple of 10)")
    ap.add_argument("--pairs", type=int, default=30, help="recorded steps in the alternating every=2 comparison")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of the training thread, insensitive to other load (needs --threads 1)")
    ap.add_argument("--width", type=int, default=D, help=f"model width (default {D}; a multiple of {H} heads)")
    ap.add_argument("--batch", type=int, default=B, help=f"sequences of {T} tokens per step (default {B})")
    ap.add_argument("--fixed", action="store_true",
                    help="only the fixed cost per recorded step, on the decoder shrunk until its reads are negligible")
    args = ap.parse_args()
    if args.fixed:
        fixed_cost(args.rounds * 2)
        return
    if args.width <= 0 or args.width % H or args.batch <= 0:
        ap.error(f"--width must be a positive multiple of {H} and --batch positive")
    D, B = args.width, args.batch
    if args.block % 10:
        ap.error("--block must be a multiple of 10 (each block then holds whole every=10 cycles)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        ap.error("--clock thread counts the calling thread only; use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.manual_seed(0)
    model = Decoder() if args.model == "decoder" else Logits(hf_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, T), generator=g) for _ in range(4)]

    def steps(n, tr=None):
        t0 = clock()
        for s in range(n):
            idx = batches[s % len(batches)]
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if tr is not None:
                tr.step(s, loss=loss.item())
        return (clock() - t0) / n

    tmp = tempfile.mkdtemp(prefix="normscope-bench-trace-")
    steps(3)  # warm-up
    with trace(model, f"{tmp}/warm") as tr:
        steps(2, tr)
    times: dict[str, list[float]] = {"untraced": [], "every=1": [], "every=10": [], "hook cache": []}

    def block(name):
        if name == "untraced":
            return steps(args.block)
        if name == "hook cache":
            with HookCache(model):
                return steps(args.block)
        every = int(name.removeprefix("every="))  # a new tracer records its first step: one in `every`
        with trace(model, f"{tmp}/e{every}", every=every) as tr:
            return steps(args.block, tr)

    names = list(times)
    for r in range(args.rounds):
        # the order rotates from round to round, so no configuration always runs first or after the same one
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(block(name))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
              flush=True)
    load = os.getloadavg()[0]
    what = "decoder" if args.model == "decoder" else "Hugging Face GPT-2 (eager attention)"
    print(f"\n{L}-layer {D}-wide {what}, batch {B}×{T}, vocabulary {V}, AdamW, {torch.get_num_threads()} threads, "
          f"{args.clock} clock; {args.rounds} rounds of {args.block}-step blocks; load average {load:.1f}")
    print("each ratio is a block over the untraced block of the same round; median (min … max) over rounds")
    targets = {"every=1": 0.05, "every=10": 0.01}
    base = times["untraced"]
    print(f"  {'untraced':>10}: {statistics.median(base) * 1e3:7.1f} ms/step")
    for k, v in times.items():
        if k == "untraced":
            continue
        ratios = [a / b for a, b in zip(v, base, strict=True)]
        med = statistics.median(ratios)
        line = (f"  {k:>10}: {statistics.median(v) * 1e3:7.1f} ms/step  ratio {med:.3f}  "
                f"({min(ratios):.3f} … {max(ratios):.3f})")
        if k in targets:
            line += f"  target ≤ {1 + targets[k]:.2f}: {'met' if med - 1 <= targets[k] else 'MISSED'}"
        print(line)
    # the tracer's own time, from its records: immune to the block-to-block noise of a shared machine, but blind
    # to indirect costs (hook calls, the function mode's dispatch of the model's own ops, caches it evicts)
    own = statistics.median(r["tracer_ms"] for r in read_run(f"{tmp}/e1")[1]) / 1e3
    ub = statistics.median(base)
    print(f"  tracer's own time per recorded step (median of its records' tracer_ms): {own * 1e3:.1f} ms = "
          f"{own / ub:.1%} of an untraced step; at every=10: {own / 10 / ub:.1%}")
    # alternating steps: every recorded step between two unrecorded neighbours of the same run
    per_step = []
    with trace(model, f"{tmp}/e2", every=2) as tr:
        for s in range(2 * args.pairs + 3):
            t0 = clock()
            idx = batches[s % len(batches)]
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tr.step(s, loss=loss.item())
            per_step.append(clock() - t0)
    pair = [per_step[s] / ((per_step[s - 1] + per_step[s + 1]) / 2) for s in range(2, len(per_step) - 1, 2)]
    own2 = statistics.median(r["tracer_ms"] for r in read_run(f"{tmp}/e2")[1]) / 1e3
    med = statistics.median(pair)
    print(f"  alternating steps (every=2, {len(pair)} recorded steps, each over its two unrecorded neighbours): "
          f"ratio {med:.3f} (quartiles {statistics.quantiles(pair, n=4)[0]:.3f} … "
          f"{statistics.quantiles(pair, n=4)[2]:.3f})  target ≤ 1.05: {'met' if med - 1 <= 0.05 else 'MISSED'}; "
          f"own time {own2 * 1e3:.1f} ms")
    d = diagnose(f"{tmp}/e1")
    print(f"\ntrace of the every=1 run: {len(d.steps)} records "
          f"(header lines from {args.rounds} tracer sessions), incidents: {len(d.incidents)}")
    assert not math.isnan(statistics.median(base))


if __name__ == "__main__":
    main()
