"""Fault injection for ``diff``, as data: architectures the installed transformers builds from small configs ×
fault kinds × sites chosen by structure. Each :class:`Case` builds a reference, a candidate with one fault (or
none) and the inputs; ``tests/test_diff_accounting.py`` holds every case to one property.

Sites are found from the module tree, never by name: a leaf with parameters in the middle of the execution, a
norm (a module the scan knows as one), a module whose children are all leaves (attention, an MLP), a block (a
module that holds such modules). Faults:

- ``leaf_scale``: a leaf's output × (1 + δ);
- ``own_output``: a non-leaf module's output × (1 + δ) — its own code, after its children;
- ``own_feed``: a non-leaf module hands its first child-bound input × (1 + δ) — its own code, before its children;
- ``norm_eps``: a norm's ε set to 0.1;
- ``norm_gamma``: one channel of a norm's γ × 1.5;
- ``backward``: a leaf's backward × 100, its forward exact (judged with ``grad=True``);
- ``own_backward``: a non-leaf module's own backward × 100 (after its children), its forward exact;
- ``clean``, ``clean_bf16``, ``clean_autocast``, ``clean_onnx``: no fault, the candidate a copy at float32, the
  reference at bfloat16 (``candidate_dtype``), the reference under ``torch.autocast(bfloat16)``, the reference
  exported to ONNX (``torch.onnx.export(..., dynamo=False)``) and run by onnxruntime.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch

DELTA = 0.05

# (model type, config class name, config kwargs, model class name, input kind)
ARCHITECTURES: dict[str, tuple[str, dict, str, str]] = {
    "llama": ("LlamaConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
              "LlamaForCausalLM", "ids"),
    "qwen3": ("Qwen3Config", dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=64), "Qwen3ForCausalLM", "ids"),
    "gpt2": ("GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64), "GPT2LMHeadModel",
             "ids"),
    "bert": ("BertConfig", dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=64), "BertModel", "ids"),
    "t5": ("T5Config", dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
           "T5Model", "seq2seq"),
    "vit": ("ViTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=16, patch_size=4, num_channels=3), "ViTModel", "pixels"),
    "mamba": ("MambaConfig", dict(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                  conv_kernel=4), "MambaForCausalLM", "ids"),
    "mixtral": ("MixtralConfig", dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64), "MixtralForCausalLM",
                "ids"),
}

FORWARD_FAULTS = ("leaf_scale", "own_output", "own_feed", "norm_eps", "norm_gamma")
CLEAN = ("clean", "clean_bf16", "clean_autocast", "clean_onnx")


@functools.cache
def _built(arch: str) -> torch.nn.Module:
    import transformers

    cfg_name, kw, model_name, _ = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).eval()
    with torch.no_grad():  # norms' γ/β away from 1/0, so a γ channel's fault and the contract are visible
        for m in model.modules():
            if _is_norm(m):
                for p in m.parameters(recurse=False):
                    p.add_(torch.randn_like(p) * 0.1)
    return model


def reference(arch: str) -> torch.nn.Module:
    return _built(arch)


def inputs(arch: str) -> dict[str, torch.Tensor]:
    kind = ARCHITECTURES[arch][3]
    g = torch.Generator().manual_seed(1)
    if kind == "pixels":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(1, 96, (2, 10), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(1, 96, (2, 6), generator=g)}
    return {"input_ids": ids}


@functools.cache
def _onnx(arch: str) -> bytes:
    """The reference exported to ONNX with its inputs as keyword arguments, as bytes."""
    import inspect
    import io
    import warnings

    model, kw = reference(arch), onnx_inputs(arch)
    names = list(kw)
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

    class Positional(torch.nn.Module):  # the exporter takes positional inputs
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, *xs):
            out = self.m(**dict(zip(names, xs, strict=True)), **extra)
            return out[0] if isinstance(out, tuple) else next(iter(out.values()))

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Positional().eval(), tuple(kw.values()), buf, input_names=names, dynamo=False,
                          opset_version=17)
    return buf.getvalue()


def onnx_inputs(arch: str) -> dict[str, torch.Tensor]:
    """The inputs of an ONNX case: a decoder's with its attention mask given (without one, transformers builds
    the causal mask with an operator the TorchScript exporter does not know)."""
    kw = inputs(arch)
    return {**kw, "attention_mask": torch.ones_like(kw["input_ids"])} if "input_ids" in kw else kw


#: architectures the TorchScript exporter exports and onnxruntime runs (Mamba: a Tile whose repeats are not 1-D
#: int64; Mixtral: its router counts experts with aten::histc, which the exporter does not know)
ONNX_ARCHITECTURES = ("llama", "qwen3", "gpt2", "bert", "t5", "vit")


def _is_norm(m: torch.nn.Module) -> bool:
    from normscope.sites.classes import known_class

    return known_class(m)


def _containers() -> tuple[type, ...]:
    return (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def executed(model: torch.nn.Module, kw: dict) -> list[str]:
    """The module paths in the order their calls complete (children first), each once."""
    paths = {id(m): p for p, m in model.named_modules()}
    order: list[str] = []

    def hook(m, a, out):
        p = paths.get(id(m))
        if p is not None and p not in order:
            order.append(p)

    h = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        with torch.no_grad():
            model(**kw)
    finally:
        h.remove()
    return order


POSITIONS = ("mid", "first", "last")


@functools.cache
def sites(arch: str, position: str = "mid") -> dict[str, str]:
    """One site per structural role, by position in the execution of that role's modules (first, middle, last)."""
    model, kw = reference(arch), inputs(arch)
    mods = dict(model.named_modules())
    order = [p for p in executed(model, kw) if p]

    def leaf(p):
        return next(mods[p].children(), None) is None

    roles = {
        "leaf": [p for p in order if leaf(p) and not _is_norm(mods[p]) and any(True for _ in mods[p].parameters())
                 and not isinstance(mods[p], torch.nn.Embedding)],
        "norm": [p for p in order if _is_norm(mods[p])],
        "inner": [p for p in order if not leaf(p) and not isinstance(mods[p], _containers())
                  and all(next(c.children(), None) is None for c in mods[p].children())],
        "block": [p for p in order if not leaf(p) and not isinstance(mods[p], _containers())
                  and any(next(c.children(), None) is not None and not isinstance(c, _containers())
                          for c in mods[p].children()) and p.count(".") >= 1],
    }
    at = {"first": 0, "mid": None, "last": -1}[position]
    return {role: ps[len(ps) // 2 if at is None else at] for role, ps in roles.items() if ps}


# ---------------------------------------------------------------------------------------------- faults

def _wrap_output(m: torch.nn.Module, factor: float) -> None:
    forward = m.forward

    def scaled(*a, **k):
        out = forward(*a, **k)
        if isinstance(out, torch.Tensor):
            return out * factor
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (out[0] * factor, *out[1:])
        if hasattr(out, "keys") and isinstance(out[next(iter(out.keys()))], torch.Tensor):
            out[next(iter(out.keys()))] = out[next(iter(out.keys()))] * factor
            return out
        raise TypeError(f"cannot scale a {type(out).__name__}")

    m.forward = scaled


def _wrap_feed(m: torch.nn.Module, factor: float) -> None:
    """Scale the first floating tensor the module's code hands its first child: a pre-hook on the child active only
    while the module's own forward runs (the module's code, before its children; the child alone is exact)."""
    first = next(m.children())
    state = {"on": False}
    outer = m.forward

    def outer_forward(*a, **k):
        state["on"] = True
        try:
            return outer(*a, **k)
        finally:
            state["on"] = False

    def fed(module, a, k):
        if not state["on"]:
            return None
        a = list(a)
        for i, v in enumerate(a):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                a[i] = v * factor
                return tuple(a), k
        for key, v in k.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return tuple(a), {**k, key: v * factor}
        return None

    m.forward = outer_forward
    first.register_forward_pre_hook(fed, with_kwargs=True)


class _BackwardScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 100.0


def _wrap_backward(m: torch.nn.Module) -> None:
    """The module's primary output passes a backward ×100 (its forward unchanged)."""
    forward = m.forward

    def scaled(*a, **k):
        out = forward(*a, **k)
        if isinstance(out, tuple):
            return (_BackwardScale.apply(out[0]), *out[1:])
        return _BackwardScale.apply(out)

    m.forward = scaled


def _norm_eps(m: torch.nn.Module) -> None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        if isinstance(getattr(m, attr, None), float):
            setattr(m, attr, 0.1)
            return
    raise TypeError(f"{type(m).__name__} has no ε attribute")


def _norm_gamma(m: torch.nn.Module) -> None:
    w = getattr(m, "weight", None)
    if w is None:
        raise TypeError(f"{type(m).__name__} has no γ")
    with torch.no_grad():
        w.view(-1)[3] *= 1.5


FAULT_ROLE = {"leaf_scale": "leaf", "own_output": "inner", "own_feed": "inner", "norm_eps": "norm",
              "norm_gamma": "norm", "backward": "leaf", "own_backward": "inner"}
GRAD_FAULTS = ("backward", "own_backward")


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str
    fault: str
    role: str | None = None  # the structural role of the injected site (None: a clean case)
    position: str = "mid"  # which module of that role, in execution order

    @property
    def id(self) -> str:
        return f"{self.arch}-{self.fault}" + (f"-{self.role}" if self.role and self.role != FAULT_ROLE.get(
            self.fault) else "") + (f"-{self.position}" if self.position != "mid" else "")

    def site(self) -> str | None:
        return None if self.role is None else sites(self.arch, self.position).get(self.role)

    def build(self) -> tuple[torch.nn.Module, torch.nn.Module | None, dict, dict]:
        """(reference, candidate, inputs, diff keyword arguments)."""
        ref = reference(self.arch)
        kw = inputs(self.arch)
        if self.fault == "clean":
            return ref, copy.deepcopy(ref), kw, {}
        if self.fault == "clean_bf16":
            return ref, None, kw, {"candidate_dtype": "bfloat16"}
        if self.fault == "clean_onnx":
            return ref, _onnx(self.arch), onnx_inputs(self.arch), {}
        if self.fault == "clean_autocast":
            return ref, None, kw, {"autocast": "bfloat16"}
        cand = copy.deepcopy(ref)
        m = dict(cand.named_modules())[self.site()]
        apply: Callable = {
            "leaf_scale": lambda: _wrap_output(m, 1 + DELTA),
            "own_output": lambda: _wrap_output(m, 1 + DELTA),
            "own_feed": lambda: _wrap_feed(m, 1 + DELTA),
            "norm_eps": lambda: _norm_eps(m),
            "norm_gamma": lambda: _norm_gamma(m),
            "backward": lambda: _wrap_backward(m),
            "own_backward": lambda: _wrap_backward(m),
        }[self.fault]
        apply()
        return ref, cand, kw, {"grad": True} if self.fault in GRAD_FAULTS else {}


def all_cases() -> list[Case]:
    """Every case: per architecture its clean copies, then each fault at the middle, first and last module of its
    role (a position that names the same module as another is left out)."""
    out = []
    for arch in ARCHITECTURES:
        out.extend(Case(arch, fault) for fault in CLEAN if fault != "clean_onnx" or arch in ONNX_ARCHITECTURES)
        seen = set()
        for position in POSITIONS:
            found = sites(arch, position)
            for fault, role in [(f, FAULT_ROLE[f]) for f in (*FORWARD_FAULTS, *GRAD_FAULTS)] + \
                    [("own_output", "block"), ("own_feed", "block")]:
                if role in found and (fault, found[role]) not in seen:
                    seen.add((fault, found[role]))
                    out.append(Case(arch, fault, role, position))
    return out
