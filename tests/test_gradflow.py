"""Norm placement as building blocks (normscope.nn.blocks) and gradflow: gradient norms per parameter and per block.

The models are 2-layer TinyLMs of width 32, built once per module; torch runs on one thread here (a tiny model
on a busy 2-core machine is ~10× faster so), restored afterwards.
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from command_runner import run_command
from rich.console import Console

from normscope.errors import InputError
from normscope.gradient_flow import SCHEMA, GradFlow, blocks_of, command, gradflow
from normscope.gradient_flow.core import figure
from normscope.nn import Block, Norm, TinyLM, deepnorm_constants
from normscope.sites import scan
from normscope.spec import NormSpec

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lm(placement: str = "pre", **kw) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(64, 32, 2, 4, placement, **kw)


def loss_fn(m):
    return m.loss(IDS)


# ---------------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "reordered", "deepnorm", "parallel"])
def test_block_computes_its_placement(placement):
    """Each block equals its placement's formula written out with the block's own sublayers and norms."""
    torch.manual_seed(1)
    b = Block(32, 4, placement, "torch_layernorm", n_layers=6)
    with torch.no_grad():  # non-trivial γ/β so that a norm applied at the wrong place changes the output
        for m in b.modules():
            if isinstance(m, Norm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 5, 32)
    a, f = b.attn, b.mlp
    if placement == "pre":
        h = x + a(b.norm1(x))
        want = h + f(b.norm2(h))
    elif placement == "post":
        h = b.norm1(x + a(x))
        want = b.norm2(h + f(h))
    elif placement == "sandwich":
        h = x + b.norm1_out(a(b.norm1(x)))
        want = h + b.norm2_out(f(b.norm2(h)))
    elif placement == "reordered":
        h = x + b.norm1(a(x))
        want = h + b.norm2(f(h))
    elif placement == "deepnorm":
        alpha = (2 * 6) ** 0.25
        h = b.norm1(alpha * x + a(x))
        want = b.norm2(alpha * h + f(h))
    else:
        h = b.norm(x)
        want = x + a(h) + f(h)
    torch.testing.assert_close(b(x), want, rtol=0, atol=0)


def test_deepnorm_constants_follow_the_paper():
    """Wang et al. 2022 (DeepNet), Table 1: decoder-only α = (2M)^¼, β = (8M)^-¼; encoder-decoder encoder
    α = 0.81 (N⁴M)^1/16, β = 0.87 (N⁴M)^-1/16, decoder α = (3M)^¼, β = (12M)^-¼. Values worked by hand."""
    c = deepnorm_constants(6)
    assert c["alpha"] == pytest.approx(1.861209718, rel=1e-9)  # 12^0.25
    assert c["beta"] == pytest.approx(0.379917843, rel=1e-9)  # 48^-0.25
    c = deepnorm_constants(100)
    assert c["alpha"] == pytest.approx(200 ** 0.25) and c["beta"] == pytest.approx(800 ** -0.25)
    e = deepnorm_constants(18, 18, "encoder-decoder")
    assert e["encoder_alpha"] == pytest.approx(0.81 * 18 ** (5 / 16), rel=1e-12)  # (N⁴M)^1/16 = 18^(5/16)
    assert e["encoder_alpha"] == pytest.approx(1.998746, rel=1e-6)  # exp(0.3125 ln 18) = 2.46759, × 0.81
    assert e["encoder_beta"] == pytest.approx(0.87 / 18 ** (5 / 16), rel=1e-12)
    assert e["decoder_alpha"] == pytest.approx(54 ** 0.25) and e["decoder_beta"] == pytest.approx(216 ** -0.25)
    with pytest.raises(InputError, match="m_layers"):
        deepnorm_constants(6, architecture="encoder-decoder")
    with pytest.raises(InputError, match="architecture"):
        deepnorm_constants(6, architecture="decoder-only")


def test_deepnorm_block_uses_alpha_and_beta_init():
    """α for 24 layers on the residual, β as the Xavier gain of v/out/FFN weights, gain 1 on q/k."""
    torch.manual_seed(0)
    b = Block(128, 4, "deepnorm", n_layers=24)
    c = deepnorm_constants(24)
    assert (b.alpha, b.beta) == (pytest.approx(c["alpha"]), pytest.approx(c["beta"]))
    xavier = math.sqrt(2 / (128 + 128))
    # 16384 entries: the sample std is within ~1% of the target; β ≈ 0.26 is far outside that
    assert b.attn.v_proj.weight.std().item() == pytest.approx(c["beta"] * xavier, rel=0.04)
    assert b.attn.out_proj.weight.std().item() == pytest.approx(c["beta"] * xavier, rel=0.04)
    assert b.mlp.w2.weight.std().item() == pytest.approx(c["beta"] * math.sqrt(2 / (512 + 128)), rel=0.04)
    assert b.attn.q_proj.weight.std().item() == pytest.approx(xavier, rel=0.04)
    pre = Block(128, 4, "pre")
    assert pre.attn.v_proj.weight.std().item() == pytest.approx(xavier, rel=0.04)


def test_block_bad_input():
    with pytest.raises(InputError, match="placement must be one of"):
        Block(32, 4, "postln")
    with pytest.raises(InputError, match="divisible"):
        Block(30, 4)
    with pytest.raises(InputError, match="NormSpec or a preset"):
        Block(32, 4, norm=torch.nn.LayerNorm(32))
    with pytest.raises(InputError, match="n_layers"):
        Block(32, 4, "deepnorm")


def test_tiny_lm_norms_and_final_norm():
    rms = lm("pre", norm="llama_rmsnorm", qk_norm="llama_rmsnorm")
    assert isinstance(rms.final_norm, Norm) and rms.final_norm.spec == NormSpec.preset("llama_rmsnorm")
    assert rms.blocks[0].attn.q_norm.weight.shape == (8,)  # per head: 32 / 4
    assert lm("post").final_norm is None and lm("deepnorm").final_norm is None
    assert rms(IDS).shape == (2, 9, 64)
    with pytest.raises(InputError, match="token ids"):
        rms(IDS.float())


# ---------------------------------------------------------------------------------------------- scan
@pytest.fixture(scope="module")
def scans():
    cache = {}

    def get(placement):
        if placement not in cache:
            qk = "llama_rmsnorm" if placement == "pre" else None
            cache[placement] = scan(lm(placement, qk_norm=qk), IDS, dtypes=["float32"], progress=False)
        return cache[placement]
    return get


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "reordered", "parallel"])
def test_scan_reports_the_placement_built(scans, placement):
    s = scans(placement)
    assert s.placement == placement
    assert [b["placement"] for b in s.blocks] == [placement, placement]
    assert [b["layer"] for b in s.blocks] == [0, 1]
    roles = {site.name: site.role for site in s.sites}
    final = {"post": None}.get(placement, "final")
    assert roles.get("final_norm") == final
    if placement == "pre":
        assert roles["blocks.0.attn.q_norm"] == roles["blocks.1.attn.k_norm"] == "qk"


def test_scan_reports_deepnorm(scans):
    # N(α·x + f(x)): the stream is scaled before the add; scan finds the add, its α and the post norms
    s = scans("deepnorm")
    assert s.placement == "deepnorm"
    assert [b["placement"] for b in s.blocks] == ["deepnorm", "deepnorm"]
    alpha = deepnorm_constants(2)["alpha"]
    assert all(abs(u["residual_scale"] - alpha) < 1e-12 for b in s.blocks for u in b["updates"])
    roles = {site.name: site.role for site in s.sites}
    assert roles["blocks.0.norm1"] == roles["blocks.1.norm2"] == "post"


# ---------------------------------------------------------------------------------------------- gradflow
def _plain(model):
    """Gradient norms from a plain backward on a copy, with the block inputs' gradients kept."""
    m = copy.deepcopy(model).train()
    x = m.embed(IDS[:, :-1]) + m.pos(torch.arange(IDS.shape[1] - 1))
    inputs = []
    for b in m.blocks:
        x.retain_grad()
        inputs.append(x)
        x = b(x)
    if m.final_norm is not None:
        x = m.final_norm(x)
    logits = m.head(x)
    F.cross_entropy(logits.reshape(-1, 64), IDS[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad.double().norm().item() for n, p in m.named_parameters()}
    return grads, [v.grad.double().norm().item() for v in inputs], [v.detach().double().pow(2).mean().sqrt().item()
                                                                   for v in inputs]


@pytest.mark.parametrize("placement", ["post", "sandwich"])
def test_gradient_norms_match_a_plain_backward(placement):
    model = lm(placement)
    flow = gradflow(model, loss_fn)
    grads, stream, rms = _plain(model)
    assert flow.grad_norms.keys() == grads.keys()
    for n, g in grads.items():
        assert flow.grad_norms[n] == pytest.approx(g, rel=1e-12, abs=1e-15), n
    assert [r["block"] for r in flow.layers] == ["blocks.0", "blocks.1"]
    for k, row in enumerate(flow.layers):
        assert row["stream_grad"] == pytest.approx(stream[k], rel=1e-12)
        assert row["input_rms"] == pytest.approx(rms[k], rel=1e-12)
        attn = math.sqrt(sum(g * g for n, g in grads.items() if n.startswith(f"blocks.{k}.attn.")))
        mlp = math.sqrt(sum(g * g for n, g in grads.items() if n.startswith(f"blocks.{k}.mlp.")))
        norm = math.sqrt(sum(g * g for n, g in grads.items() if n.startswith(f"blocks.{k}.norm")))
        assert (row["attention"], row["mlp"], row["norm"]) == (pytest.approx(attn, rel=1e-12),
                                                               pytest.approx(mlp, rel=1e-12),
                                                               pytest.approx(norm, rel=1e-12))
        assert row["parts"]["mlp"] == pytest.approx(mlp, rel=1e-12)
    # the sandwich's four norms per block are all in the norm column
    if placement == "sandwich":
        assert set(flow.layers[0]["parts"]) == {"attn", "mlp", "norm1", "norm1_out", "norm2", "norm2_out"}


def test_model_left_exactly_as_it_was():
    model = lm("pre")
    model.eval()
    model.blocks[1].train()  # a mixed mode must come back mixed
    model.embed.weight.requires_grad_(False)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 7.0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    calls = []
    handle = model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    hooks = {id(m): (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
             for m in model.modules()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    objects = {n: p for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    before = copy.deepcopy(opt.state_dict())

    flow = gradflow(model, loss_fn, steps=3, optimizer=opt)

    assert flow.after is not None and flow.after.step == 3 and len(flow.losses) == 3
    assert flow.after.grad_norms != flow.grad_norms  # the steps did change the model it measured
    assert calls  # the user's hook ran during the measurement, and is still the only one
    for n, p in model.named_parameters():
        assert p is objects[n] and torch.equal(p, params[n]), n
        assert p.grad is grads[n], n
        if p.requires_grad:
            assert torch.all(p.grad == 7.0), n
    assert model.embed.weight.grad is None and not model.embed.weight.requires_grad
    assert "embed.weight" not in flow.grad_norms
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert {id(m): (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for m in model.modules()} == hooks
    assert opt.state_dict() == before
    handle.remove()


def test_steps_train_and_the_optimizer_factory():
    model = lm("pre")
    flow = gradflow(model, loss_fn, steps=5, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    assert flow.optimizer == "Adam"
    assert flow.after.loss < flow.losses[0] - 0.3, (flow.losses, flow.after.loss)
    assert flow.snapshots[0].loss == pytest.approx(flow.losses[0])  # same model, same batch, same mode


def test_blocks_of_takes_outermost_repeated_blocks():
    model = lm("pre")
    assert [n for n, _ in blocks_of(model)] == ["blocks.0", "blocks.1"]
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    flow = gradflow(flat, lambda m: m(torch.ones(2, 4)).pow(2).sum())
    assert [r["block"] for r in flow.layers] == ["0", "1"]
    assert flow.layers[0]["total"] == pytest.approx(math.hypot(flow.grad_norms["0.weight"],
                                                               flow.grad_norms["0.bias"]))
    assert flow.layers[0]["attention"] is None


def test_bad_input_is_refused_and_the_model_untouched():
    model = lm("pre")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(InputError, match="scalar tensor"):
        gradflow(model, lambda m: m(IDS).mean(-1))
    with pytest.raises(InputError, match="no autograd graph"):
        gradflow(model, lambda m: m.loss(IDS).detach())
    with pytest.raises(InputError, match="steps"):
        gradflow(model, loss_fn, steps=-1)
    with pytest.raises(InputError, match="optimizer"):
        gradflow(model, loss_fn, steps=1, optimizer="adam")
    with pytest.raises(InputError, match="not the model's"):
        gradflow(model, loss_fn, steps=1, optimizer=torch.optim.SGD(lm("post").parameters(), lr=1))
    assert all(torch.equal(p, params[n]) and p.grad is None for n, p in model.named_parameters())
    assert model.training


def test_json_round_trip_and_plot(tmp_path):
    flow = gradflow(lm("post"), loss_fn, steps=1, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    d = json.loads(flow.to_json())
    assert d["schema"] == SCHEMA == "normscope.gradflow/1"
    assert [s["step"] for s in d["snapshots"]] == [0, 1]
    back = GradFlow.from_json(flow.to_json())
    assert back == flow
    flow.snapshots[0].layers[0]["stream_grad"] = math.nan  # non-finite values survive the round trip
    back = GradFlow.from_json(flow.to_json())
    assert math.isnan(back.layers[0]["stream_grad"])
    with pytest.raises(InputError, match="schema"):
        GradFlow.from_json(json.dumps({"schema": "normscope.scan/1"}))
    png = flow.plot(tmp_path / "flow.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    fig = figure({"flow": flow})
    fig.canvas.draw()
    for ax in fig.axes:  # a layer axis has whole-number ticks only
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def _cli(argv, capsys):
    return run_command(command, argv, capsys)


def test_command(capsys, tmp_path):
    kw = '{"vocab_size": 64, "d": 32, "n_layers": 2, "placement": "post"}'
    code, out, _ = _cli(["gradflow", "normscope.nn.blocks:TinyLM", "--kwargs", kw, "--tokens", "2,8", "--json",
                         "--steps", "1", "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["schema"] == SCHEMA and len(d["snapshots"]) == 2 and d["optimizer"] == "Adam"
    assert [r["block"] for r in d["snapshots"][0]["layers"]] == ["blocks.0", "blocks.1"]
    # random ids at init: about log 64, and above it (a random model's logits are not all equal); the model is built
    # from seed 0, so this does not move with what ran before in the process (it did, from 4.1 to 5.1)
    assert math.log(64) <= d["snapshots"][0]["loss"] <= 1.5 * math.log(64)
    code, again, _ = _cli(["gradflow", "normscope.nn.blocks:TinyLM", "--kwargs", kw, "--tokens", "2,8", "--json",
                           "--steps", "1"], capsys)
    assert json.loads(again)["snapshots"][0]["loss"] == d["snapshots"][0]["loss"]
    assert "next-token cross-entropy" in d["notes"][0]
    assert (tmp_path / "p.png").stat().st_size > 5000
    code, out, _ = _cli(["gradflow", "normscope.nn.blocks:TinyLM", "--kwargs", kw, "--tokens", "2,8"], capsys)
    assert code == 0 and "blocks.1" in out and "stream_grad" in out
    code, _, err = _cli(["gradflow", "normscope.nn.blocks:Block", "--args", "[32, 4]", "--tokens", "2,8"], capsys)
    assert code == 2 and "vocab_size" in err
    code, out, _ = _cli(["gradflow", "normscope.nn.blocks:Block", "--args", "[32, 4]", "--shape", "2,5,32"], capsys)
    assert code == 0 and "mean square" in out


def test_command_at_80_columns_and_from_a_config(capsys, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2).to_json_file(str(tmp_path / "config.json"))
    parser = argparse.ArgumentParser(prog="normscope")
    command.add_parser(parser.add_subparsers(dest="command"))
    monkeypatch.chdir(tmp_path)  # a relative path: a long temporary folder's name is one word no table can wrap
    args = parser.parse_args(["gradflow", "config.json", "--layers", "0", "--steps", "1"])
    import io

    buf = io.StringIO()
    assert args.run(args, Console(file=buf, width=80, force_terminal=False, highlight=False)) == 0
    out = buf.getvalue()
    assert max(map(len, out.splitlines())) <= 80, out
    for k in range(3):  # every block in both snapshots, its name whole
        assert out.count(f"model.layers.{k}\n") == 2, out
    assert "the model's loss on input_ids" in out and out.count("step ") == 2


def test_loss_named_as_taken():
    transformers = pytest.importorskip("transformers")
    from normscope.gradient_flow.command import loss_for

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=4, intermediate_size=64)).eval()
    fn, describe = loss_for(bert, None, None)
    assert "the model's loss" in describe()  # before a call: what was asked
    loss = fn(bert)
    assert describe().startswith("mean square of the output (BertModel returns no loss)"), describe()
    with torch.no_grad():
        plain = float(bert(**_hf_ids(bert)).last_hidden_state.pow(2).mean())
    assert float(loss.detach()) == pytest.approx(plain, rel=1e-5)
    fn, describe = loss_for(bert, "2,6", None)
    fn(bert)
    assert "no logits over the 64-token vocabulary" in describe()


def _hf_ids(model):
    from normscope.model import default_inputs

    return default_inputs(model)


def test_unwritable_plot_path_is_refused_before_measuring(capsys, tmp_path):
    kw = '{"vocab_size": 64, "d": 32, "n_layers": 2}'
    for plot, words in [(tmp_path / "none" / "p.png", "does not exist"), (tmp_path, "is a folder"),
                        (tmp_path / "p.xyz", "must end in one of")]:
        code, out, err = _cli(["gradflow", "normscope.nn.blocks:TinyLM", "--kwargs", kw, "--tokens", "2,8",
                               "--plot", str(plot)], capsys)
        assert code == 2 and words in err and out == "", (plot, err)
    assert list(tmp_path.iterdir()) == []
