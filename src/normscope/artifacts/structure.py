"""The static contract of any architecture transformers knows, from its structure rather than a table.

The model is built from its config on the meta device (shapes, no memory, no weights) and scanned: one forward
on shapes gives the norm sites, their roles and the placement from the dataflow; each distinct kind of norm
module is inferred once on a materialized copy (drawn parameters, the ε its code set from the config). The
contract is then what that code does with this config — GPT-NeoX, Falcon, Starcoder2, Nemotron and every other
architecture transformers builds, with nothing written per architecture.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import InputError, NormscopeError
from ..extras import require
from .model import ModelContract

#: a model whose forward does not run on shapes alone (it reads a value: DeBERTa-v2's relative positions) is
#: built with random weights on the CPU instead, up to this many parameters (1 GiB in float32)
REAL_BUILD_PARAMS = 1 << 28


def build_on_meta(config: dict[str, Any], config_path: Path, device: str = "meta"):
    """The base model of ``config`` (a config.json's dict) on the meta device (or ``device``)."""
    transformers = require("transformers", "hf")
    import torch

    model_type = config.get("model_type")
    fields = {k: v for k, v in config.items() if k != "model_type"}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        try:
            cfg = transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError) as exc:
            raise InputError(f"{config_path}: model_type {model_type!r} is not an architecture the installed "
                             f"transformers ({transformers.__version__}) knows ({exc})") from None
        with torch.device(device):
            return transformers.AutoModel.from_config(cfg)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{config_path}: transformers could not build {model_type!r} from this config "
                         f"({type(exc).__name__}: {exc})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def read_structure(config: dict[str, Any], config_path: Path, source: str) -> ModelContract:
    """The contract of ``config`` from its architecture's structure (see the module's docstring)."""
    from ..sites import scan

    model = build_on_meta(config, config_path)
    how = "on the meta device (one forward on shapes, each kind of norm inferred once)"
    try:
        result = scan(model, None, dtypes="float32", progress=False)
    except NormscopeError as exc:
        size = sum(p.numel() for p in model.parameters())
        if size > REAL_BUILD_PARAMS:
            raise InputError(f"{config_path}: the {config.get('model_type')!r} architecture does not run on the meta "
                             f"device ({exc}), and at {size:,} parameters it is too large to build with random "
                             "weights here; scan a checkpoint instead (normscope contract --live MODEL)") from None
        import torch

        with torch.random.fork_rng(devices=[]):  # the weights drawn from seed 0; the caller's RNG left as it was
            torch.manual_seed(0)
            model = build_on_meta(config, config_path, device="cpu")
        how = (f"with random weights on the CPU ({size:,} parameters: its forward reads values, so it does not run "
               "on the meta device)")
        try:
            result = scan(model, None, dtypes="float32", progress=False)
        except NormscopeError as exc2:
            raise InputError(f"{config_path}: the {config.get('model_type')!r} architecture could not be scanned "
                             f"({exc2})") from None
    if not result.sites:
        raise InputError(f"{config_path}: the {config.get('model_type')!r} architecture has no normalization "
                         "site that a forward on shapes meets")
    out = ModelContract.from_scan(result, source=source).without_weights()  # drawn here: a config states none
    out.kind = "hf-config"
    out.architecture = config.get("model_type")
    out.stated_placement = result.placement
    stated = {k: v for k, v in result.config_eps.items() if "." not in k}
    keys = [k for s in result.sites for k in s.eps_keys or () if k in stated]  # the scan's rebuild experiment
    if keys:
        key = max(set(keys), key=keys.count)  # the key most sites read
        out.eps, out.eps_key = float(stated[key]), key
    for site in out.sites:
        if site.eps is not None and out.eps is not None and not math.isclose(site.eps, out.eps, rel_tol=0.01):
            site.notes.append(f"ε={site.eps:g} set by the code, not by {out.eps_key}")
    out.notes.append(f"read from the structure of transformers' {type(model).__name__} built from this config {how}")
    return out
