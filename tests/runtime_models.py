"""Tiny random-weight Hugging Face causal LMs for the runtime diffs (MLX, llama.cpp): 2 layers, 64 wide, norms
with trained-looking γ (their initial value perturbed), and the token ids they run on."""

from __future__ import annotations

import dataclasses

import torch

SIZE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


@dataclasses.dataclass(frozen=True)
class QuantizedCase:
    """One generated case of the quantized-candidate property: an architecture, a quantization scheme (``4bit``,
    ``int8``…), a fault kind (``clean``: none). Each test module builds its own (``build``)."""

    family: str
    scheme: str
    fault: str

    @property
    def id(self) -> str:
        return f"{self.family}-{self.scheme}-{self.fault}"

    def build(self):
        """The reference, its quantized candidate with the fault put in, the clean quantized candidate, and the
        faulted module's path (None when clean)."""
        raise NotImplementedError

    def check(self, logits):
        """The property on this case: a clean candidate is a PASS; a fault that moves the logits (``logits(model,
        ids)``, float64 NumPy) away from the clean candidate's is a FAIL naming its module or an ancestor. Returns
        the diff."""
        import numpy as np

        from normscope import diff

        model, cand, clean, site = self.build()
        ids = token_ids()
        d = diff(model, cand, ids, progress=False)
        text = f"{self.id}: {d.summary()} | {d.inconclusive}"
        if site is None:
            assert d.verdict == "pass", text
            return d
        a, b = logits(cand, ids), logits(clean, ids)
        moved = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        assert moved > 1e-4, f"the fault does not move the logits ({moved:.3g}): not a case"
        assert d.verdict == "fail", f"moved {moved:.3g}; {text}"
        named = d.first_divergence.split("#")[0]
        assert named == site or site.startswith(named + "."), f"injected at {site}; {text}"
        return d


def skip_without_mlx() -> None:
    """At a test module's top: skip it where the ``mlx`` extra (MLX's CPU build and mlx-lm) or transformers is
    missing; Hugging Face offline and quiet."""
    import os

    import pytest

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("mlx.core", reason="the mlx extra is not installed: pip install 'normscope[mlx]'")
    pytest.importorskip("mlx_lm", reason="the mlx extra is not installed: pip install 'normscope[mlx]'")
    transformers.logging.set_verbosity_error()


def tiny_causal_lm(family: str):
    """``family``: llama, qwen3 or gemma3 (one sliding and one global layer, as mlx-lm reads the pattern)."""
    import transformers

    configs = {
        "llama": lambda: transformers.LlamaConfig(**SIZE, rms_norm_eps=1e-5),
        "qwen3": lambda: transformers.Qwen3Config(**SIZE, head_dim=16),
        "gemma3": lambda: transformers.Gemma3TextConfig(**SIZE, head_dim=16, sliding_window=8,
                                                        sliding_window_pattern=2,
                                                        layer_types=["sliding_attention", "full_attention"]),
    }
    return built(configs[family]())


def built(config, biases: bool = False):
    """A causal LM from ``config`` with random weights (seed 0, eager attention), its norms' γ/β perturbed so a
    fault in one channel is visible; ``biases``: its biases drawn too (they are zero at initialisation)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif biases and name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def token_ids() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))}


def effective_gamma_times(model, path: str, channel: int, factor: float):
    """A copy of ``model`` whose norm ``path`` has the effective γ of one channel × ``factor`` (Gemma's norms apply
    1 + w, so w is set to make 1 + w so)."""
    import copy

    edited = copy.deepcopy(model)
    norm = dict(edited.named_modules())[path]
    with torch.no_grad():
        if "Gemma" in type(norm).__name__:
            norm.weight[channel] = factor * (1 + norm.weight[channel]) - 1
        else:
            norm.weight[channel] *= factor
    return edited


def quantized_by_the_gguf_package(f32, path, kinds: dict[str, str], default: str) -> str:
    """``f32`` rewritten with each matrix quantized by the ``gguf`` package: ``kinds`` (tensor name → type) where
    given, else ``default``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(f32))
    w = gguf.GGUFWriter(str(path), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, kinds.get(t.name, default))
            w.add_tensor(t.name, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
