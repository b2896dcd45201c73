"""``diff`` says pass only when it looked and every site holds: a candidate that raises is a divergence at the
site that raised, a teacher-forced module never writes the reference's own tensors, a reused leaf output is
never shared between two callers, a module whose own code diverges between its children is named, and what could
not be compared (a comparison that raised, too few sites aligned, the reference not finite) is inconclusive —
``Diff.verdict``, the JSON and exit code 6 — never "no divergence". Each case failed before its fix."""

from __future__ import annotations

import argparse
import copy
import json
import sys

import pytest
import torch
from rich.console import Console
from torch import nn

from normscope.divergence import Diff, command, diff
from normscope.divergence import metrics as diff_metrics

W = 16
X = torch.randn(2, 5, W, generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self, act=nn.GELU, reuse: bool = False):
        super().__init__()
        self.ln, self.fc, self.act, self.reuse = nn.LayerNorm(W), nn.Linear(W, W), act(), reuse

    def forward(self, x):
        h = self.ln(x)
        y = x + self.fc(self.act(h))
        return y + h if self.reuse else y  # reuse: h is read again after act saw it


class Model(nn.Module):
    def __init__(self, act=nn.GELU, reuse: bool = False, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(act, reuse) for _ in range(blocks))
        self.out = nn.Linear(W, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def model(**kw) -> Model:
    torch.manual_seed(0)
    return Model(**kw).eval()


def test_a_candidate_that_raises_in_a_block_is_its_divergence():
    ref = model()
    cand = copy.deepcopy(ref)

    def broken(x):
        raise RuntimeError("fused block kernel: unsupported shape")

    cand.blocks[2].forward = broken
    d = diff(ref, cand, {"x": X}, progress=False)
    assert d.first_divergence == "blocks.2" and d.verdict == "fail" and not d.ok
    assert d.site("blocks.2").status == "raised" and "unsupported shape" in d.divergence["reason"]
    assert d.summary().startswith("first divergence at blocks.2")


def test_teacher_forcing_never_writes_the_references_tensors():
    """The candidate's ReLU works in place on a tensor its block reads again: its own output is right, the block's
    is not. The reference's forward must not see that write (before: "no divergence", true output gap 0.64)."""
    ref = model(act=nn.ReLU, reuse=True, blocks=2)
    cand = model(act=lambda: nn.ReLU(inplace=True), reuse=True, blocks=2)
    cand.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref(X)
        gap = float((want - cand(X)).norm() / want.norm())
    assert gap > 0.3
    d = diff(ref, cand, {"x": X}, progress=False)
    with torch.no_grad():
        assert torch.equal(ref(X), want)  # the reference computes what it did before the comparison
    assert d.first_divergence == "blocks.0" and d.verdict == "fail"
    s = d.site("blocks.0")
    assert s.status == "diverged" and "between its children" in d.divergence["reason"]
    # the ReLU that writes its input is not replayed: the block's run computes it, and says so
    assert s.children_run == ["blocks.0.act"] and "blocks.0.act" in d.divergence["reason"]
    assert all(d.site(n).status == "within" for n in ("blocks.0.act", "blocks.0.fc"))


class Twice(nn.Module):
    """One leaf called twice on one input, one of its outputs then written in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, h):
        a, b = self.fc(h), self.fc(h)
        a.add_(1.0)
        return a - b


class TwiceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.mix, self.out = nn.LayerNorm(W), Twice(), nn.Linear(W, 4)

    def forward(self, x):
        return self.out(self.mix(self.ln(x)))


def test_a_reused_leaf_output_is_never_shared():
    """The model against its own float32 copy: a reused output handed to two callers would make ``a - b`` zero
    (before: a false divergence at ``mix``)."""
    torch.manual_seed(3)
    d = diff(TwiceModel().eval(), None, {"x": X}, candidate_dtype="float32", progress=False)
    assert d.verdict == "pass" and d.first_divergence is None, d.summary()
    assert d.site("mix").status == "within"


def _sequential_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def _sequential_convnet() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    with torch.no_grad():
        for bn in (m[1], m[4]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(1e-4, 2e-3)  # small: ε matters
    return m.eval()


def test_leaves_that_a_layer_list_repeats_are_judged():
    """``nn.Sequential(Linear, GELU, Linear)`` repeats Linear, which reads as a list of blocks; a block's own error is
    its sites', but a leaf holds none. The second Linear ×1.5 (the output off by 32 %) was a PASS with exit 0, and a
    conv net's second BatchNorm with ε 1e-3 for 1e-5 was inconclusive; both are found at their site."""
    bad = _sequential_mlp()
    with torch.no_grad():
        bad[2].weight.mul_(1.5)
    d = diff(_sequential_mlp(), bad, {"input": torch.randn(2, 8)}, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "2", d.summary()
    assert diff(_sequential_mlp(), _sequential_mlp(), {"input": torch.randn(2, 8)}, progress=False).verdict == "pass"
    bad = _sequential_convnet()
    bad[4].eps = 1e-3
    d = diff(_sequential_convnet(), bad, {"input": torch.randn(2, 3, 8, 8)}, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "4", d.summary()
    assert any("found ε=0.001" in line for line in d.divergence["differences"]), d.divergence


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _in_bfloat16(block: nn.Module) -> None:
    """The block run in bfloat16 inside a float32 model: its input cast down, its output cast back."""
    forward = block.to(torch.bfloat16).forward
    block.forward = lambda x: forward(x.to(torch.bfloat16)).float()


def test_a_module_the_candidate_runs_at_another_dtype_is_teacher_forced_at_that_dtype():
    """One block of a float32 candidate runs in bfloat16: its modules were teacher-forced with the reference's float32
    input, raised (mixed dtypes), and the diff was inconclusive. They get the input at the dtype they ran at: the
    block's first module departs from the float32 reference, where the precision changed."""
    cand = _Stack().eval()
    _in_bfloat16(cand.layers[1])
    d = diff(_Stack().eval(), cand, {"x": torch.randn(4, 8, 16)}, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "layers.1.ln", (d.summary(), d.inconclusive)
    assert d.candidate == "_Stack, partly bfloat16" and d.candidate_dtype == "float32"  # the header names it


def test_a_comparison_that_raises_is_inconclusive(monkeypatch):
    errors = diff_metrics.errors
    calls = [0]

    def flaky(a, b):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("comparison broke")
        return errors(a, b)

    monkeypatch.setattr(diff_metrics, "errors", flaky)
    ref = model()
    d = diff(ref, copy.deepcopy(ref), {"x": X}, progress=False)
    assert d.verdict == "inconclusive" and not d.ok and not d.conclusive and d.first_divergence is None
    assert "comparison raised" in d.inconclusive[0] and "comparison broke" in d.inconclusive[0]
    assert d.summary().startswith("inconclusive")


class Other(nn.Module):
    """Another architecture with the reference's input and output shapes: nothing of it aligns."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(W, 3 * W), nn.Linear(3 * W, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_a_candidate_that_does_not_align_is_inconclusive_not_a_pass():
    """Another architecture is not aligned by execution order (before: its modules were paired with unrelated ones
    and the verdict was a FAIL at the first); the verdict names where the structures part."""
    d = diff(model(), Other().eval(), {"x": X}, progress=False)
    assert d.verdict == "inconclusive" and d.first_divergence is None, d.summary()
    text = " ".join(d.inconclusive)
    assert "do not align" in text and "blocks.0.ln.weight [16]" in text and "a.weight [48, 16]" in text


def _diff_parser(tmp_path, monkeypatch, name: str, source: str) -> argparse.ArgumentParser:
    """A parser with ``diff`` on it, and a module ``name`` of factories (``source``) importable as a CLI target."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser


def test_cli_exit_codes_and_json(tmp_path, monkeypatch, capsys):
    """Exit 0 pass, 5 fail, 6 inconclusive; the JSON carries the verdict and the reasons."""
    parser = _diff_parser(tmp_path, monkeypatch, "verdict_models",
                          "import torch, copy\n"
                          "from test_diff_verdicts import model, Other\n"
                          "def ref():\n    return model()\n"
                          "def other():\n    return Other().eval()\n")
    base = ["diff", "verdict_models:ref"]
    cases = [(["--candidate-dtype", "float32"], 0, "pass"), (["verdict_models:other"], 6, "inconclusive")]
    for extra, code, verdict in cases:
        args = parser.parse_args([*base, *extra, "--inputs", "2,5,16", "--json"])
        assert command.run(args, Console()) == code, extra
        data = json.loads(capsys.readouterr().out)
        assert data["verdict"] == verdict
        back = Diff.from_dict(data)
        assert back.verdict == verdict and back.inconclusive == data["inconclusive"]
    args = parser.parse_args([*base, "verdict_models:other", "--inputs", "2,5,16"])
    assert command.run(args, Console(width=200)) == 6
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out and "what would decide it" in out
    sys.modules.pop("verdict_models", None)


class Rotary(nn.Module):
    """A module with two outputs, as rotary embeddings have: (cos, sin)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv", 1.0 / (10000 ** (torch.arange(0, W, 2).float() / W)))

    def forward(self, x):
        f = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), self.inv)
        emb = torch.cat([f, f], -1)
        return emb.cos(), emb.sin()


class RotaryModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.rotary, self.fc = nn.LayerNorm(W), Rotary(), nn.Linear(W, W)

    def forward(self, x):
        h = self.ln(x)
        cos, sin = self.rotary(h)
        return self.fc(h * cos + h.flip(-1) * sin)


def test_an_onnx_scope_with_several_outputs_is_matched_by_shape_and_value():
    """torch's first output (cos) against the ONNX scope's last value (sin) was a false divergence on every
    rotary embedding exported to ONNX."""
    import io

    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = RotaryModel().eval()
    buf = io.BytesIO()
    torch.onnx.export(m, (X,), buf, input_names=["x"], dynamo=False)
    d = diff(m, buf.getvalue(), {"x": X}, progress=False)
    assert d.verdict == "pass", d.summary()
    s = d.site("rotary")
    assert s.status == "within" and s.own["normalized"] < 1e-6 and s.propagated["normalized"] < 1e-6


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = RotaryModel()

    def forward(self, x):
        return self.inner(x)


def test_onnx_scopes_that_drop_a_wrapper_level_still_align():
    """An exporter that drops the model's top level from the node scopes (`/ln/…` for `inner.ln`, as OPT's export
    drops `OPTModel`): the sites align by suffix instead of going unmatched."""
    import io

    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    m = Wrapper().eval()
    buf = io.BytesIO()
    torch.onnx.export(m, (X,), buf, input_names=["x"], dynamo=False)
    proto = onnx.load_from_string(buf.getvalue())
    for node in proto.graph.node:
        node.name = node.name.replace("/inner/", "/", 1)
    assert any(n.name.startswith("/ln/") for n in proto.graph.node)
    d = diff(m, proto, {"x": X}, progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    assert {s.name for s in d.sites if s.status == "within"} >= {"inner.ln", "inner.rotary", "inner.fc"}


def test_the_same_model_at_a_lower_dtype_says_what_is_known():
    """Against its own copy at bf16 a site other than a norm is the reference's own operation at bf16: its bound
    cannot fail, so the summary says so, and ranks the sites by the error each adds instead."""
    d = diff(model(), None, {"x": X}, candidate_dtype="bfloat16", progress=False)
    assert d.verdict == "pass"
    text = d.summary()
    assert "norm sites within their contracts" in text and "faithful by construction" in text
    added = d.stats["error_added"]
    assert added and text.endswith("its input's error)") and added[0]["site"] in text
    assert [a["own_roundoffs"] for a in added] == sorted((a["own_roundoffs"] for a in added), reverse=True)
    assert all(a["dtype"] == "bfloat16" and a["amplification"] > 0 for a in added)
    assert "self_candidate" not in diff(model(), copy.deepcopy(model()), {"x": X}, progress=False).stats


class Partial(nn.Module):
    """Keeps the reference's first block (same names) and computes the rest itself, functionally, the output's bias
    off by 5."""

    def __init__(self, ref: Model):
        super().__init__()
        self.blocks = nn.ModuleList([copy.deepcopy(ref.blocks[0])])
        self.rest = nn.ParameterList([p.detach().clone() for b in ref.blocks[1:] for p in
                                      (b.ln.weight, b.ln.bias, b.fc.weight, b.fc.bias)])
        self.rest.append(ref.out.weight.detach().clone())
        self.rest.append(ref.out.bias.detach().clone() + 5)

    def forward(self, x):
        f = torch.nn.functional
        x = self.blocks[0](x)
        p = list(self.rest)
        for i in range(0, len(p) - 2, 4):
            x = x + f.linear(f.gelu(f.layer_norm(x, (W,), p[i], p[i + 1])), p[i + 2], p[i + 3])
        return f.linear(x, p[-2], p[-1])


def test_a_partly_matched_candidate_fails_where_its_unmatched_code_is():
    """Before: "PASS — 1 sites' own errors within the bound (4 sites compared)" with the output 17.8 off. The
    model's own run, its matched child replayed, computes the rest as the candidate does: a FAIL at the model,
    naming what it computed without a judgement of its own."""
    ref = model()
    cand = Partial(ref).eval()
    d = diff(ref, cand, {"x": X}, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "(model)", d.summary()
    reason = d.divergence["reason"]
    assert "own code, between its children" in reason and "without a judgement of their own" in reason
    assert d.site("blocks.0").status == "within"


def test_a_fault_between_a_modules_children_is_named_at_that_module():
    """An attention-like module whose scale between its projections is ×1.1 (its children are exact): before, the
    verdict was a pass with the output 1–3 % off."""

    class Att(nn.Module):
        def __init__(self, scale=1.0):
            super().__init__()
            self.q, self.k, self.o = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
            self.scale = scale

        def forward(self, x):
            a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) * self.scale / W ** 0.5, -1)
            return x + self.o(a @ x)

    torch.manual_seed(0)
    ref = nn.Sequential(Att(), nn.LayerNorm(W)).eval()
    cand = copy.deepcopy(ref)
    cand[0].scale = 1.1
    d = diff(ref, cand, X, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "0", d.summary()
    assert "between its children" in d.divergence["reason"]
    assert all(d.site(f"0.{c}").status == "within" for c in "qko")


class _Times100(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 100 * g


class _BadBackward(nn.Linear):
    def forward(self, x):
        return _Times100.apply(super().forward(x))


def test_grad_fails_at_a_leaf_whose_backward_is_wrong_inside_a_sequential():
    """A leaf in an nn.Sequential (read as a layer list) was not judged for its own gradient: a ×100 backward
    passed."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Linear(W, 4)).eval()
    cand = nn.Sequential(nn.Linear(W, W), nn.Tanh(), _BadBackward(W, W), nn.Linear(W, 4)).eval()
    cand.load_state_dict(ref.state_dict())
    d = diff(ref, cand, X, grad=True, progress=False)
    assert d.first_divergence is None and d.grad_first_divergence == "2" and d.verdict == "fail", d.summary()


def test_grad_with_nothing_compared_is_inconclusive_and_an_integer_output_is_an_input_error():
    from normscope.errors import InputError

    ref = model()
    frozen = copy.deepcopy(ref).requires_grad_(False)
    d = diff(frozen, copy.deepcopy(frozen), {"x": X}, grad=True, progress=False)
    assert d.verdict == "inconclusive" and any(r.startswith("gradients:") for r in d.inconclusive), d.summary()

    class Argmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(W, 4)

        def forward(self, x):
            return self.fc(x).argmax(-1)

    with pytest.raises(InputError, match="--loss"):
        diff(Argmax(), copy.deepcopy(Argmax()), {"x": X}, grad=True, progress=False)


def test_cli_loss_names_an_output(tmp_path, monkeypatch, capsys):
    from normscope.errors import InputError

    parser = _diff_parser(tmp_path, monkeypatch, "loss_models",
                          "from test_diff_verdicts import model\ndef ref():\n    return model()\n")
    base = ["diff", "loss_models:ref", "--candidate-dtype", "float32", "--inputs", "2,5,16", "--json"]
    assert command.run(parser.parse_args([*base, "--grad", "--loss", "0"]), Console()) == 0
    capsys.readouterr()
    with pytest.raises(InputError, match="no floating tensor of that name"):
        command.run(parser.parse_args([*base, "--grad", "--loss", "logits"]), Console())
    with pytest.raises(InputError, match="add --grad"):
        command.run(parser.parse_args([*base, "--loss", "0"]), Console())


class _BiasCache(nn.Module):
    """Keeps attention-bias-like tensors in a plain dict, filled on its first call (not a parameter or buffer)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.bias_cache = nn.Linear(W, W), nn.LayerNorm(W), {}

    def forward(self, x):
        t = x.shape[-2]
        if t not in self.bias_cache:
            self.bias_cache[t] = torch.linspace(-1, 1, t * W, dtype=x.dtype).reshape(t, W)
        return self.ln(self.fc(x) + self.bias_cache[t])


def test_state_kept_outside_parameters_is_cast_in_diffs_own_copy():
    """Before: the bfloat16 private copy kept the float32 cache, raised on the mixed dtypes, and diff blamed the
    model ("first divergence at ln: the candidate's forward raised")."""
    torch.manual_seed(0)
    m = _BiasCache().eval()
    m(X)  # the cache is filled, as in a model that already ran
    d = diff(m, None, X, candidate_dtype="bfloat16", progress=False)
    assert d.verdict == "pass", d.summary()
    assert any("bias_cache[5]" in n for n in d.notes)
    assert m.bias_cache[5].dtype == torch.float32  # the user's model keeps its own


class _TwoOut(nn.Module):
    def __init__(self, k=1.0):
        super().__init__()
        self.fc, self.k = nn.Linear(W, W), k

    def forward(self, x):
        h = self.fc(x)
        return h, torch.softmax(h * self.k, -1)


class _TwoOutModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.two, self.out = _TwoOut(), nn.Linear(W, 4)

    def forward(self, x):
        h, w = self.two(x)
        return self.out(h), w


def test_a_modules_second_output_is_judged_too():
    """A module whose primary output is exact and whose second output (attention-like weights) is not: before, only
    the primary output was compared, and the verdict was a pass."""
    torch.manual_seed(0)
    ref = _TwoOutModel().eval()
    cand = copy.deepcopy(ref)
    cand.two.k = 1.5
    d = diff(ref, cand, X, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "two", d.summary()
    assert "its output '1'" in d.divergence["reason"] and d.site("two").outputs["1"] > 0.1
    assert d.site("(model)").outputs == {"1": 0.0}


class _OwnBackwardFault(nn.Module):
    """Its projections are exact; its own code between them has a backward ×100 (a custom autograd function)."""

    def __init__(self, bad: bool = False):
        super().__init__()
        self.q, self.o, self.bad = nn.Linear(W, W), nn.Linear(W, W), bad

    def forward(self, x):
        h = torch.tanh(self.q(x))
        return x + self.o(_Times100.apply(h) if self.bad else h)


def test_grad_fails_at_a_module_whose_own_backward_between_its_children_is_wrong():
    """A module's own backward is judged with its children's backward replayed from the reference: a fault between
    its children is named at the module, its children within."""
    torch.manual_seed(0)
    ref = nn.Sequential(_OwnBackwardFault(), nn.LayerNorm(W), nn.Linear(W, 4)).eval()
    cand = nn.Sequential(_OwnBackwardFault(bad=True), nn.LayerNorm(W), nn.Linear(W, 4)).eval()
    cand.load_state_dict(ref.state_dict())
    d = diff(ref, cand, X, grad=True, progress=False)
    assert d.first_divergence is None and d.grad_first_divergence == "0" and d.verdict == "fail", d.summary()
    assert "own backward, between its children" in d.grad_divergence["reason"]
    assert all(s.status == "within" for s in d.grad_sites if s.name in ("0.q", "0.o"))


def test_cli_plot_path_is_checked_before_the_diff_runs(tmp_path, monkeypatch):
    """Before: the whole diff ran, then a missing folder ended in a FileNotFoundError (exit 70), and a folder
    given as the path was written as DIR.png."""
    from normscope.errors import InputError

    parser = _diff_parser(tmp_path, monkeypatch, "plot_models",
                          "from test_diff_verdicts import model\ndef ref():\n    return model()\n")
    base = ["diff", "plot_models:ref", "--candidate-dtype", "float32", "--inputs", "2,5,16"]
    for plot, match in ((str(tmp_path / "missing" / "x.png"), "does not exist"), (str(tmp_path), "is a folder"),
                        (str(tmp_path / "x.txt"), "must end in")):
        with pytest.raises(InputError, match=match):
            command.run(parser.parse_args([*base, "--plot", plot]), Console())
