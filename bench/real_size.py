"""scan and diff at real size: a Llama-shaped model of 1.1 B parameters (TinyLlama's shape: 22 layers, 2048 wide,
5632 MLP, 32 heads, 4 KV heads, 32000 tokens), random weights.

Each measurement runs in a fresh process, so its peak resident memory is its own: the model's size, what the
command adds on top (diff: the bfloat16 candidate, cast tensor by tensor from the reference, never a second
float32 copy), and the seconds of CPU. A scan of the model on the meta device (shapes only: what `contract`
does for an architecture outside its table) is measured beside it.

    python bench/real_size.py              # all three, ~2 min and ~12 GiB at most
    python bench/real_size.py --layers 4   # a smaller model of the same width
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

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
else:
    result = normscope.scan(model, progress=False)
    outcome = f"{len(result.sites)} sites, placement {result.placement}"
print(json.dumps({"what": what, "params_gib": size, "rss_before": before, "rss_peak": rss(),
                  "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "outcome": outcome}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--only", choices=("scan", "diff", "meta"), action="append")
    args = ap.parse_args()
    for what in args.only or ("scan", "diff", "meta"):
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
