"""The static contract of a Hugging Face model: its ``config.json`` and, where present, its safetensors.

The architecture (``model_type``) decides which norms each block has, their family and γ offset — the
modelling code of each architecture states them; the config states ε and the sizes. γ statistics come from
``*.safetensors`` files beside the config, opened memory-mapped and read one norm weight at a time.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..errors import InputError
from ..extras import require
from ..sources import EPS_KEYS, MAX_WIDTH, check_config, config_int, read_config
from .model import ContractSite, ModelContract, value_stats
from .names import canonicalize, match_paths, module_path, split_block


@dataclasses.dataclass(frozen=True)
class Arch:
    family: str
    eps_key: str
    blocks: str  # module path of the block list, e.g. "model.layers"
    block_norms: tuple[str, ...]
    top: tuple[str, ...]
    beta: bool
    gamma_offset: float = 0.0
    qk: tuple[str, str] | None = None
    qk_over: str = "head"  # "head": head_dim; "proj": the whole projection; "per_head": γ per head
    qk_flag: str | None = None  # config key that switches the qk norms on


_LLAMA = Arch("rmsnorm", "rms_norm_eps", "model.layers", ("input_layernorm", "post_attention_layernorm"),
              ("model.norm",), beta=False)
_SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
ARCHITECTURES: dict[str, Arch] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": dataclasses.replace(_LLAMA, qk=("self_attn.q_norm", "self_attn.k_norm")),
    "gemma": dataclasses.replace(_LLAMA, gamma_offset=1.0),
    "gemma2": dataclasses.replace(_LLAMA, block_norms=_SANDWICH, gamma_offset=1.0),
    "gemma3_text": dataclasses.replace(_LLAMA, block_norms=_SANDWICH, gamma_offset=1.0,
                                       qk=("self_attn.q_norm", "self_attn.k_norm")),
    "olmo2": dataclasses.replace(_LLAMA, block_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
                                 qk=("self_attn.q_norm", "self_attn.k_norm"), qk_over="proj"),
    "gpt2": Arch("layernorm", "layer_norm_epsilon", "transformer.h", ("ln_1", "ln_2"), ("transformer.ln_f",),
                 beta=True),
    "bert": Arch("layernorm", "layer_norm_eps", "encoder.layer", ("attention.output.LayerNorm", "output.LayerNorm"),
                 ("embeddings.LayerNorm",), beta=True),
    "phi": Arch("layernorm", "layer_norm_eps", "model.layers", ("input_layernorm",), ("model.final_layernorm",),
                beta=True, qk=("self_attn.q_layernorm", "self_attn.k_layernorm"), qk_flag="qk_layernorm"),
    "cohere": Arch("layernorm", "layer_norm_eps", "model.layers", ("input_layernorm",), ("model.norm",), beta=False,
                   qk=("self_attn.q_norm", "self_attn.k_norm"), qk_over="per_head", qk_flag="use_qk_norm"),
}


def read_hf(path: str | Path) -> ModelContract:
    """The contract of an HF ``config.json`` or model directory (with γ statistics from safetensors)."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_path.is_file():
        raise InputError(f"{path}: a model directory needs a config.json")
    config = read_config(config_path, model_type=False)
    if config.get("model_type") == "gemma3" and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # the table reads Gemma 3's text model; any other composite, its structure
        config.setdefault("model_type", "gemma3_text")
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        if not isinstance(model_type, str):
            raise InputError(f"{config_path}: no model_type: the architecture decides which norms a model has")
        return _from_structure(config, config_path, path)

    present = [k for k in EPS_KEYS if k in config]
    if arch.eps_key not in config:
        other = f" (it has {', '.join(present)}, which {model_type} does not read)" if present else ""
        raise InputError(f"{config_path}: no {arch.eps_key}, the ε of {model_type}'s norms{other}; transformers "
                         "would silently use its default — add the value the model was trained with")
    eps = config[arch.eps_key]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0 or eps == float("inf"):
        raise InputError(f"{config_path}: {arch.eps_key} must be a finite number ≥ 0; got {eps!r}")

    check_config(config, config_path)
    n_layers = config_int(config, ("num_hidden_layers", "n_layer"), config_path)
    hidden = config_int(config, ("hidden_size", "n_embd"), config_path)
    heads = config_int(config, ("num_attention_heads", "n_head"), config_path)
    head_dim = config.get("head_dim") or hidden // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 0 < head_dim <= MAX_WIDTH:
        raise InputError(f"{config_path}: head_dim must be a positive integer; got {head_dim!r}")
    kv_heads = config_int(config, ("num_key_value_heads",), config_path, default=heads)

    paths: list[tuple[str, int, tuple[int, ...]]] = []  # module path, normalized size, γ shape
    for i in range(n_layers):
        for sub in arch.block_norms:
            paths.append((f"{arch.blocks}.{i}.{sub}", hidden, (hidden,)))
        if arch.qk and (arch.qk_flag is None or config.get(arch.qk_flag)):
            for sub, n in zip(arch.qk, (heads, kv_heads), strict=True):
                if arch.qk_over == "proj":
                    shape = (n * head_dim,)
                elif arch.qk_over == "per_head":
                    shape = (n, head_dim)
                else:
                    shape = (head_dim,)
                paths.append((f"{arch.blocks}.{i}.{sub}", shape[-1], shape))
    for top in arch.top:
        paths.append((top, hidden, (hidden,)))
    names = canonicalize([p for p, _, _ in paths])
    sites = []
    for p, size, shape in paths:
        name, layer, role = names[p]
        sites.append(ContractSite(
            name=name, source=p, layer=layer, role=role, family=arch.family, eps=float(eps),
            eps_placement="inside_sqrt", axes=(-1,), size=size, gamma=True, beta=arch.beta,
            gamma_offset=arch.gamma_offset, param_shape=shape,
        ))
    out = ModelContract(source=str(path), kind="hf-config", sites=sites, architecture=model_type, eps=float(eps),
                        eps_key=arch.eps_key, n_layers=n_layers)
    other = [k for k in present if k != arch.eps_key and config[k] != eps]
    if other:
        out.notes.append(f"the config also states {', '.join(f'{k}={config[k]}' for k in other)}, which "
                         f"{model_type} does not read")
    weights = sorted(config_path.parent.glob("*.safetensors"))
    if weights:
        _add_gamma_statistics(out, weights)
        out.kind = "hf-model"
    return out


def _from_structure(config: dict, config_path: Path, path: Path) -> ModelContract:
    """An architecture outside the table: read from the structure transformers builds (artifacts.structure)."""
    from .structure import read_structure

    check_config(config, config_path, measured_eps=True)  # the structure read measures each norm's ε
    out = read_structure(config, config_path, str(path))
    if out.eps_key is not None and out.eps_key not in config:
        raise InputError(f"{config_path}: no {out.eps_key}, the ε {config['model_type']}'s norms read; transformers "
                         "would silently use its default — add the value the model was trained with")
    weights = sorted(config_path.parent.glob("*.safetensors"))
    if weights:
        _add_gamma_statistics(out, weights)
        out.kind = "hf-model"
    return out


_GAMMA_PARAMS = ("weight", "scale", "gamma")  # what a norm module calls its γ, most common first
_BETA_PARAMS = ("bias", "beta")


def _add_gamma_statistics(contract: ModelContract, files: list[Path]) -> None:
    """Each site's γ (and β) statistics from the checkpoint's tensors, one tensor at a time.

    A site's weights are found by structure first: its module path (``source``) in the checkpoint, as it is or
    under the one prefix a wrapper class adds or drops (:func:`~.names.match_paths`); a site still without them is
    looked up by canonical name, where exactly one of the checkpoint's modules has that name. A site with a γ
    whose weight is found neither way is left without statistics and named in a note: :func:`~.diff.compare`
    counts it unverified, never a match (``contract.weights`` says this artifact holds weights)."""
    safe_open = require("safetensors", "hf").safe_open
    tensors: dict[str, tuple[Path, str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = (f, key)
        except Exception as exc:  # the Rust reader raises its own error types on malformed headers
            raise InputError(f"{f}: not a readable safetensors file ({exc})") from None
    contract.weights = True
    params_of: dict[str, dict[str, str]] = {}  # module path → {parameter name: tensor key}
    for key in tensors:
        mp = module_path(key)
        param = key[len(mp) + 1:] if key.startswith(mp + ".") else ""
        params_of.setdefault(mp, {})[param] = key
    with_gamma = sorted(mp for mp, ps in params_of.items() if any(k in ps for k in _GAMMA_PARAMS))
    module_of = _site_modules(contract.sites)
    found = match_paths([m for m in module_of.values() if m is not None], with_gamma)
    claimed = set(found.values())
    rest = [mp for mp in with_gamma if mp not in claimed]
    by_name: dict[str, list[str]] = {}
    for mp, (name, _, _) in canonicalize(rest).items():
        by_name.setdefault(name, []).append(mp)
    missing = []
    for site in contract.sites:
        mp = found.get(module_of[site.name]) if module_of[site.name] is not None else None
        if mp is None and len(by_name.get(site.name, [])) == 1 and by_name[site.name][0] not in claimed:
            mp = by_name[site.name][0]  # by canonical name, where one module has it
        if mp is None:
            if site.gamma is not False:
                missing.append(site.name)
            continue
        params = params_of[mp]
        f, key = tensors[next(params[k] for k in _GAMMA_PARAMS if k in params)]
        with safe_open(str(f), framework="pt") as handle:
            w = handle.get_tensor(key).double().numpy()
        functional = ":" in site.source  # γ from the module it ran in: only a weight of the normalized size
        if functional and site.size is not None and (not w.shape or w.shape[-1] != site.size):
            if site.gamma is not False:
                missing.append(site.name)
            continue
        claimed.add(mp)
        site.gamma_stats = value_stats(w)
        site.source = mp
        if site.param_shape is not None and tuple(w.shape) != site.param_shape:
            site.notes.append(f"γ has shape {list(w.shape)}, the config implies {list(site.param_shape)}")
        site.param_shape = tuple(w.shape)
        bias = next((params[k] for k in _BETA_PARAMS if k in params), None)
        if functional and not site.beta:
            bias = None  # the module's bias is not a β the norm was seen to add
        site.beta = bias is not None
        if bias is not None:
            f, key = tensors[bias]
            with safe_open(str(f), framework="pt") as handle:
                site.beta_stats = value_stats(handle.get_tensor(key).double().numpy())
    if missing:
        contract.notes.append(f"no weight found for {len(missing)} norm site(s): {', '.join(missing[:4])}"
                              + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                              + "; their γ is unverified in a comparison")
    stray = [mp for mp in with_gamma if mp not in claimed and _looks_like_norm(mp)]
    if stray:
        contract.notes.append(f"norm-like weights outside the architecture's sites: {', '.join(stray[:4])}"
                              + (f" and {len(stray) - 4} more" if len(stray) > 4 else ""))


def _site_modules(sites: list[ContractSite]) -> dict[str, str | None]:
    """Site name → the module path its γ lives under: a module site's own path (without a later call's ``#n``);
    for a functional or inline norm (``layers.0.linear_attn.norm:inline#0``) the module it ran in, whose own weight
    is its γ only when no other such norm ran there; None where nothing says which module holds it."""
    out: dict[str, str | None] = {}
    for s in sites:
        if s.source.startswith("("):
            out[s.name] = None
        else:
            out[s.name] = re.sub(r"#\d+$", "", s.source.split(":", 1)[0])
    shared: dict[str, int] = {}
    for s in sites:
        if ":" in s.source and out[s.name] is not None:
            shared[out[s.name]] = shared.get(out[s.name], 0) + 1
    for s in sites:
        if ":" in s.source and shared.get(out[s.name] or "", 0) > 1:
            out[s.name] = None
    return out


def _looks_like_norm(name: str) -> bool:
    last = split_block(name)[1].rsplit(".", 1)[-1].lower()
    return "norm" in last or last.startswith("ln")
