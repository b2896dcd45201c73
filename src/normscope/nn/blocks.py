"""Transformer blocks by norm placement, and a tiny decoder LM built from them (requires torch).

``Block(d, heads, placement=...)`` where placement is one of

- ``pre``: ``x + f(N(x))`` (GPT-2, LLaMA);
- ``post``: ``N(x + f(x))`` (the original Transformer, BERT);
- ``sandwich``: ``x + N'(f(N(x)))`` (CogView, Gemma 2/3);
- ``reordered``: ``x + N(f(x))`` (OLMo 2: the norm on the sublayer output, none on its input);
- ``deepnorm``: ``N(α·x + f(x))`` with the sublayers' value/output/FFN weights initialised with gain β
  (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers"; :func:`deepnorm_constants`);
- ``parallel``: ``x + attn(N(x)) + mlp(N(x))`` (GPT-J, PaLM: one norm, both sublayers read the same stream).

``norm`` is a :class:`~normscope.spec.NormSpec` or a preset name, executed by :class:`normscope.nn.Norm`;
``qk_norm`` (optional, same forms) normalises queries and keys per head over the head dimension.
:class:`TinyLM` stacks blocks between a token+position embedding and a linear head, with a final norm where
the design has one (every placement but ``post`` and ``deepnorm``, whose blocks end in a norm).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from ..report.numbers import sig
from ..spec import NormSpec
from .modules import Norm

PLACEMENTS = ("pre", "post", "sandwich", "reordered", "deepnorm", "parallel")
# the placements whose blocks end in a norm, so the LM needs no final norm
_ENDS_IN_NORM = frozenset({"post", "deepnorm"})


def norm_spec(norm: NormSpec | str, what: str = "norm") -> NormSpec:
    """A NormSpec from a NormSpec or a preset name."""
    if isinstance(norm, NormSpec):
        return norm
    if isinstance(norm, str):
        return NormSpec.preset(norm)
    raise InputError(f"{what} must be a NormSpec or a preset name such as 'torch_layernorm' or 'llama_rmsnorm'; "
                     f"got a {type(norm).__name__}")


def make_norm(spec: NormSpec, d: int) -> Norm:
    """``Norm(spec)`` with per-feature parameters of size ``d`` (none if the spec has no γ/β)."""
    shape = (d,) * len(spec.param_axes) if (spec.gamma or spec.beta) else ()
    return Norm(spec, shape)


def deepnorm_constants(n_layers: int, m_layers: int | None = None, architecture: str = "decoder") -> dict[str, float]:
    """α (residual scale) and β (initialisation gain) of DeepNorm, Wang et al. 2022, Table 1 / Figure 2.

    ``architecture``: ``"decoder"`` (decoder-only, M = ``n_layers`` layers): α = (2M)^¼, β = (8M)^-¼;
    ``"encoder"`` (encoder-only, N layers): the same with N; ``"encoder-decoder"`` (N encoder, M decoder layers):
    encoder α = 0.81 (N⁴M)^1/16, β = 0.87 (N⁴M)^-1/16, decoder α = (3M)^¼, β = (12M)^-¼ (returned as
    ``encoder_alpha``, ``encoder_beta``, ``decoder_alpha``, ``decoder_beta``).
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise InputError(f"n_layers must be a positive integer; got {n_layers!r}")
    if architecture in ("decoder", "encoder"):
        return {"alpha": (2 * n_layers) ** 0.25, "beta": (8 * n_layers) ** -0.25}
    if architecture == "encoder-decoder":
        if not isinstance(m_layers, int) or m_layers < 1:
            raise InputError("an encoder-decoder needs m_layers, the number of decoder layers (a positive integer)")
        n, m = n_layers, m_layers
        return {"encoder_alpha": 0.81 * (n ** 4 * m) ** (1 / 16), "encoder_beta": 0.87 * (n ** 4 * m) ** (-1 / 16),
                "decoder_alpha": (3 * m) ** 0.25, "decoder_beta": (12 * m) ** -0.25}
    raise InputError(f"architecture must be 'decoder', 'encoder' or 'encoder-decoder'; got {architecture!r}")


class Attention(nn.Module):
    """Causal multi-head self-attention with q/k/v/out projections and an optional per-head QK norm."""

    def __init__(self, d: int, heads: int, qk_norm: NormSpec | None = None, bias: bool = True):
        super().__init__()
        if d % heads:
            raise InputError(f"width {d} is not divisible by heads {heads}; choose heads that divide the width")
        self.heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)
        self.q_norm = make_norm(qk_norm, self.head_dim) if qk_norm is not None else None
        self.k_norm = make_norm(qk_norm, self.head_dim) if qk_norm is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(v: torch.Tensor) -> torch.Tensor:
            return v.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """``w2(gelu(w1(x)))`` with hidden width ``mlp_ratio · d`` (``w2`` is the FFN's second weight, Xiong's W2)."""

    def __init__(self, d: int, mlp_ratio: float = 4.0, bias: bool = True):
        super().__init__()
        hidden = int(round(mlp_ratio * d))
        if hidden < 1:
            raise InputError(f"mlp_ratio {mlp_ratio} gives an empty hidden layer for width {d}")
        self.w1 = nn.Linear(d, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """One Transformer block (attention, then MLP) with its norms where ``placement`` puts them.

    Norm modules: ``norm1``/``norm2`` (before attention/MLP for pre, sandwich and on the sums for post, deepnorm;
    on the sublayer outputs for reordered), ``norm1_out``/``norm2_out`` (sandwich's output norms), ``norm``
    (parallel). ``deepnorm`` uses ``alpha`` (the residual scale) and initialises with ``beta``; both default to
    the decoder-only constants for ``n_layers`` layers (:func:`deepnorm_constants`).
    """

    def __init__(self, d: int, heads: int, placement: str = "pre", norm: NormSpec | str = "torch_layernorm", *,
                 qk_norm: NormSpec | str | None = None, mlp_ratio: float = 4.0, bias: bool = True,
                 n_layers: int | None = None, alpha: float | None = None, beta: float | None = None):
        super().__init__()
        if placement not in PLACEMENTS:
            raise InputError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
        if not isinstance(d, int) or not isinstance(heads, int) or d < 1 or heads < 1:
            raise InputError(f"width and heads must be positive integers; got {d!r}, {heads!r}")
        spec = norm_spec(norm)
        qk = norm_spec(qk_norm, "qk_norm") if qk_norm is not None else None
        self.placement = placement
        self.attn = Attention(d, heads, qk, bias)
        self.mlp = MLP(d, mlp_ratio, bias)
        if placement == "parallel":
            self.norm = make_norm(spec, d)
        else:
            self.norm1, self.norm2 = make_norm(spec, d), make_norm(spec, d)
        if placement == "sandwich":
            self.norm1_out, self.norm2_out = make_norm(spec, d), make_norm(spec, d)
        self.alpha = 1.0
        self.beta = 1.0
        if placement == "deepnorm":
            if alpha is None or beta is None:
                if n_layers is None:
                    raise InputError("deepnorm needs n_layers (the depth α and β are computed for) or both alpha "
                                     "and beta")
                c = deepnorm_constants(n_layers)
                alpha = c["alpha"] if alpha is None else alpha
                beta = c["beta"] if beta is None else beta
            self.alpha, self.beta = float(alpha), float(beta)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-normal linear weights, zero biases; deepnorm scales v/out/FFN by β and keeps q/k at gain 1."""
        for name, lin in (("q", self.attn.q_proj), ("k", self.attn.k_proj), ("v", self.attn.v_proj),
                          ("out", self.attn.out_proj), ("ffn", self.mlp.w1), ("ffn", self.mlp.w2)):
            gain = self.beta if self.placement == "deepnorm" and name in ("v", "out", "ffn") else 1.0
            nn.init.xavier_normal_(lin.weight, gain=gain)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def extra_repr(self) -> str:
        extra = f", alpha={sig(self.alpha, 4)}, beta={sig(self.beta, 4)}" if self.placement == "deepnorm" else ""
        return f"placement={self.placement}{extra}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.placement
        if p == "pre":
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        if p == "post":
            x = self.norm1(x + self.attn(x))
            return self.norm2(x + self.mlp(x))
        if p == "sandwich":
            x = x + self.norm1_out(self.attn(self.norm1(x)))
            return x + self.norm2_out(self.mlp(self.norm2(x)))
        if p == "reordered":
            x = x + self.norm1(self.attn(x))
            return x + self.norm2(self.mlp(x))
        if p == "deepnorm":
            x = self.norm1(x * self.alpha + self.attn(x))
            return self.norm2(x * self.alpha + self.mlp(x))
        h = self.norm(x)  # parallel
        return x + self.attn(h) + self.mlp(h)


class TinyLM(nn.Module):
    """A decoder-only LM: token and learned position embeddings, ``n_layers`` blocks, a final norm where the
    placement has none at the end of its blocks, and a linear head. ``forward(ids)`` returns the logits;
    :meth:`loss` is the next-token cross-entropy."""

    def __init__(self, vocab_size: int = 64, d: int = 32, n_layers: int = 2, heads: int = 4,
                 placement: str = "pre", norm: NormSpec | str = "torch_layernorm", *,
                 qk_norm: NormSpec | str | None = None, mlp_ratio: float = 4.0, max_len: int = 128,
                 bias: bool = True, alpha: float | None = None, beta: float | None = None):
        super().__init__()
        if not isinstance(n_layers, int) or n_layers < 1:
            raise InputError(f"n_layers must be a positive integer; got {n_layers!r}")
        if not isinstance(vocab_size, int) or vocab_size < 2:
            raise InputError(f"vocab_size must be an integer ≥ 2; got {vocab_size!r}")
        self.vocab_size, self.max_len, self.placement = vocab_size, max_len, placement
        self.embed = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(
            Block(d, heads, placement, norm, qk_norm=qk_norm, mlp_ratio=mlp_ratio, bias=bias, n_layers=n_layers,
                  alpha=alpha, beta=beta) for _ in range(n_layers))
        self.final_norm = None if placement in _ENDS_IN_NORM else make_norm(norm_spec(norm), d)
        self.head = nn.Linear(d, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.pos.weight, std=1.0)
        nn.init.normal_(self.head.weight, std=1 / math.sqrt(d))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2:
            raise InputError(f"TinyLM takes token ids of shape (batch, time) as int64; got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.max_len:
            raise InputError(f"sequence length {t} exceeds max_len {self.max_len}; build the model with a larger "
                             "max_len")
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.head(x)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``ids`` (each position predicts the next)."""
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
