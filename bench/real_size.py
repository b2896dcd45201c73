"""scan and diff at real size: a Llama-shaped model of 1.1 B parameters (TinyLlama's shape: 22 layers, 2048 wide,
5632 MLP, 32 heads, 4 KV heads, 32000 tokens), random weights.

Each measurement runs in a fresh process, so its peak resident memory is its own: the model's size, what the
command adds on top (diff: the bfloat16 candidate, cast tensor by tensor from the reference, never a second
float32 copy), and the seconds of CPU. A scan of the model on the meta device (shapes only: what `contract`
does for an architecture outside its table) is measured beside it.

    python bench/real_size.py              # all three, ~2 min and ~12 GiB at most
    python bench/real_size.py --layers 4   # a smaller model of the same width
    python bench/real_size.py --gguf Q4_K_M --gguf Q8_0   # against its quantized GGUFs as llama.cpp runs them

A reference larger than memory (``--larger-than-memory``): a Llama-shaped model 4096 wide (14336 MLP, 32 heads, 8 KV
heads, 32000 tokens) with as many layers as make its float32 weights at least 1.5× this machine's memory, random
weights written once as safetensors shards (to --dir, kept for the next run; skipped when the disk lacks room), then
``normscope diff DIR --candidate-dtype bfloat16`` in a fresh process (the reference streamed from the files, its
bfloat16 copy read from them too, cast). Printed: its peak resident memory against the model's float32 size
(target ≤ 25 %), and its time against reading the files twice (target ≤ 3×). The page cache is dropped before each
timing where this process may (root), else the note says it was not.

    python bench/real_size.py --larger-than-memory [--dir /path/with/40GB/free]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch, transformers
transformers.logging.set_verbosity_error()
import normscope
what, layers = sys.argv[1], int(sys.argv[2])
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5)
torch.manual_seed(0)
if what == "meta":
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
else:
    model = transformers.LlamaForCausalLM(cfg).eval()
size = sum(p.numel() * 4 for p in model.parameters()) / 2**30
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
before = rss()
cpu, wall = time.process_time(), time.perf_counter()
if what == "diff":
    result = normscope.diff(model, candidate_dtype="bfloat16", progress=False)
    outcome = result.verdict
elif what.startswith("gguf:"):  # written and quantized by llama.cpp first (timed apart), then the diff alone
    import tempfile
    from pathlib import Path
    from normscope.artifacts.gguf_write import quantize_gguf, write_gguf
    folder = Path(tempfile.mkdtemp(prefix="normscope-bench-gguf-"))
    f32 = write_gguf(model, folder / "f32.gguf")
    path = quantize_gguf(f32, folder / "q.gguf", what.split(":", 1)[1])
    f32.unlink()
    prepared = time.perf_counter() - wall
    before, cpu, wall = rss(), time.process_time(), time.perf_counter()
    ids = {"input_ids": torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1))}
    result = normscope.diff(model, str(path), ids, progress=False)
    judged = [s for s in result.sites if s.beyond_twin is not None]
    leaf = [s.twin for s in judged if s.kind == "leaf"]
    outcome = (f"{result.verdict}, {len(judged)} sites judged against the twin, beyond it at most "
               f"{max(s.beyond_twin / s.bound for s in judged):.3g} of the bound; quantization explains "
               f"{min(leaf):.3g}-{max(leaf):.3g} of a projection; logits "
               f"{result.site('(model)').propagated['normalized']:.3g}; written and quantized in {prepared:.0f} s; "
               f"{path.stat().st_size / 2**30:.2f} GiB file")
    path.unlink()
    folder.rmdir()
else:
    result = normscope.scan(model, progress=False)
    outcome = f"{len(result.sites)} sites, placement {result.placement}"
print(json.dumps({"what": what, "params_gib": size, "rss_before": before, "rss_peak": rss(),
                  "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "outcome": outcome}))
"""


BIG = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
       "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
GIB = 2**30


def _memory_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("this bench reads the machine's memory from /proc/meminfo (Linux)")


def _big_tensors(layer: int | None) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of one layer (``layer``), or of the embeddings, final norm and head (None)."""
    h, f, kv = BIG["hidden_size"], BIG["intermediate_size"], BIG["num_key_value_heads"] * 128
    if layer is None:
        return {"model.embed_tokens.weight": (BIG["vocab_size"], h), "model.norm.weight": (h,),
                "lm_head.weight": (BIG["vocab_size"], h)}
    p = f"model.layers.{layer}."
    return {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}


def _nbytes(shapes) -> int:
    return sum(math.prod(s) * 4 for s in shapes.values())


def _write_big(folder: Path, layers: int) -> None:
    """Random float32 weights (N(0, 0.02), norms' γ near one), one safetensors shard per layer, and its index."""
    import torch
    import transformers
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(num_hidden_layers=layers, **BIG).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    parts = [None, *range(layers)]
    started = time.perf_counter()
    for i, layer in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        tensors = {k: (1 + 0.1 * torch.rand(s, generator=g)) if len(s) == 1 else torch.empty(s).normal_(0, 0.02, generator=g)
                   for k, s in _big_tensors(layer).items()}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        print(f"  wrote {i + 1}/{len(parts)} shards ({time.perf_counter() - started:.0f} s)", end="\r", flush=True)
    print()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "WRITTEN").write_text(str(layers))


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def _read_files(folder: Path) -> float:
    buf = bytearray(64 << 20)
    started = time.perf_counter()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as h:
            while h.readinto(buf):
                pass
    return time.perf_counter() - started


def larger_than_memory(folder: Path) -> None:
    memory = _memory_total()
    layer_bytes, rest = _nbytes(_big_tensors(0)), _nbytes(_big_tensors(None))
    layers = math.ceil((1.5 * memory - rest) / layer_bytes)
    size = rest + layers * layer_bytes
    print(f"machine memory {memory / GIB:.1f} GiB; model: Llama-shaped, {layers} layers, "
          f"{size / 4 / 1e9:.2f} B parameters, {size / GIB:.1f} GiB float32 ({size / memory:.2f}× the memory)")
    written = folder / "WRITTEN"
    if not (written.is_file() and written.read_text() == str(layers)):
        free = shutil.disk_usage(folder.parent if not folder.exists() else folder).free
        if free < size + GIB:
            print(f"skipped: {folder} has {free / GIB:.1f} GiB free; the model needs {size / GIB:.1f} GiB (--dir)")
            return
        print(f"writing the weights to {folder} (once)")
        _write_big(folder, layers)
    dropped = _drop_caches()
    read_twice = _read_files(folder) + (_drop_caches() and 0) + _read_files(folder)
    print(f"reading the files twice: {read_twice:.1f} s ({2 * size / GIB / read_twice:.2f} GiB/s)"
          + ("" if dropped else " — page cache not dropped (not root): reads may be faster than the disk"))
    _drop_caches()
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "normscope", "diff", str(folder), "--candidate-dtype", "bfloat16",
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.communicate()
    wall = time.perf_counter() - started
    # the child's own peak resident memory (communicate() reaped it; its usage is in the children's total, and this
    # process ran no other child)
    import resource

    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if child.returncode not in (0, 5, 6):
        print(f"diff failed (exit {child.returncode}):\n{err[-3000:]}")
        return
    result = json.loads(out)
    streamed = result.get("stats", {}).get("streamed", {})
    print(f"diff: verdict {result['verdict']}, {len(result['sites'])} sites, {wall:.1f} s wall")
    print(f"  peak resident memory {peak / GIB:.2f} GiB = {peak / size:.1%} of the float32 model (target ≤ 25 %)")
    print(f"  time {wall:.1f} s = {wall / read_twice:.2f}× reading the files twice (target ≤ 3×)")
    if streamed:
        print(f"  streamed: {streamed['bytes_read'] / GIB:.1f} GiB read in {streamed['reads']} reads, at most "
              f"{streamed['peak_resident_bytes'] / GIB:.2f} GiB of weights resident")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--only", choices=("scan", "diff", "meta"), action="append")
    ap.add_argument("--gguf", metavar="TYPE", action="append",
                    help="diff the model against itself written as a GGUF and quantized by llama.cpp to TYPE "
                         "(Q8_0, Q4_K_M…; the llamacpp extra); repeatable")
    ap.add_argument("--larger-than-memory", action="store_true",
                    help="diff a model of 1.5× the machine's memory, streamed from its files (see above)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "normscope-larger-than-memory"),
                    help="where --larger-than-memory writes (and keeps) its weights")
    args = ap.parse_args()
    if args.larger_than_memory:
        larger_than_memory(Path(args.dir))
        return
    todo = [f"gguf:{k}" for k in args.gguf or ()] + list(args.only or (() if args.gguf else ("scan", "diff", "meta")))
    for what in todo:
        out = subprocess.run([sys.executable, "-c", CHILD, what, str(args.layers)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{what}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{what:5s} model {r['params_gib']:.2f} GiB fp32 | RSS before {r['rss_before']:.2f} GiB, peak "
              f"{r['rss_peak']:.2f} GiB (+{r['rss_peak'] - r['rss_before']:.2f}) | CPU {r['cpu_s']:.1f} s, wall "
              f"{r['wall_s']:.1f} s | {r['outcome']}")


if __name__ == "__main__":
    main()
