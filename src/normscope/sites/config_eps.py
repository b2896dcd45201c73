"""The ε a model's config states, which sites take their ε from it, and the mismatches that are findings.

A config states ε values (``rms_norm_eps``, ``layer_norm_eps``, …) but code need not use them everywhere:
ConvNeXt and Swin hard-code ε=1e-6 in their blocks and read the config only for the final norm. Whether a site
follows a key is an experiment, not a name table: the model's class is built a second time on the meta device
(no memory, no weights) from a copy of its config in which that key holds a sentinel value, and every module
holding the sentinel follows the key. A measured ε that differs from the config is a finding only at a site
that follows the config; at a site that does not, it is the code's own ε and is stated as such. When the class
cannot be rebuilt from its config, every mismatch stays a finding (the experiment could not clear it).
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import torch

from ..sources import is_eps_key
from .result import Site


def config_eps(config) -> dict[str, float]:
    """The ε values an HF config states (also in nested sub-configs such as ``text_config``)."""
    if config is None:
        return {}
    try:
        data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    except Exception:
        return {}
    out: dict[str, float] = {}

    def walk(d: dict, prefix: str, depth: int) -> None:
        for k, v in d.items():
            if is_eps_key(k) and isinstance(v, int | float) and not isinstance(v, bool):
                out[prefix + k] = float(v)
            elif isinstance(v, dict) and depth < 3:
                walk(v, f"{prefix}{k}.", depth + 1)
    walk(data, "", 0)
    return out


def _sentinel(value: float) -> float:
    """A value no config or code states: distinct from ``value`` and from every round number."""
    return (value or 1e-6) * 3.1415926 + 2.718281828e-9


def _with(config, key: str, value: float):
    """A deep copy of ``config`` with the (dotted) ``key`` set to ``value``, or None when it has no such field."""
    twin = copy.deepcopy(config)
    owner = twin
    *path, last = key.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    if isinstance(owner, dict):
        owner[last] = value
    elif hasattr(owner, last):
        setattr(owner, last, value)
    else:
        return None
    return twin


def eps_followers(model: torch.nn.Module, stated: dict[str, float]) -> dict[str, set[str]] | None:
    """Module path → the config keys its ε follows, from rebuilding the model's class on the meta device once per
    stated key with that key set to a sentinel; None when the class cannot be rebuilt from its config."""
    config = getattr(model, "config", None)
    if config is None or not stated:
        return None
    out: dict[str, set[str]] = {}
    for key, value in stated.items():
        twin_config = _with(config, key, _sentinel(value))
        if twin_config is None:
            return None
        try:
            with torch.device("meta"):
                twin = type(model)(twin_config)
        except Exception:
            return None
        sentinel = _sentinel(value)
        for path, module in twin.named_modules():
            if any(isinstance(v, float) and math.isclose(v, sentinel, rel_tol=1e-9) for v in vars(module).values()):
                out.setdefault(path, set()).add(key)
    return out


def _module_path(site: Site) -> str:
    """The module a site's ε lives on: the site's own module, or the caller of a functional norm."""
    name = re.sub(r"#\d+$", "", site.name)
    return "" if name == "(model)" else name.split(":")[0]


def site_keys(site: Site, followers: dict[str, set[str]]) -> set[str]:
    """The config keys a site's ε follows (:func:`eps_followers`'s result; empty: the code's own ε)."""
    return followers.get(_module_path(site), set())


def eps_findings(sites: list[Site], stated: dict[str, float], followers: dict[str, set[str]] | None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Findings: an ``eps_mismatch`` per measured ε that differs from what the config states for its sites; notes:
    an ``eps_own`` per ε the code sets itself at sites that do not follow the config. ``followers``: from
    :func:`eps_followers`; None compares every site with every stated value."""
    out: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    if not stated:
        return out, notes
    by_eps: dict[tuple[float, str], list[Site]] = {}
    for s in sites:
        if s.spec is None:
            continue
        keys = None if followers is None else site_keys(s, followers)
        if keys == set():
            if not any(math.isclose(s.spec.eps, v, rel_tol=0.01) for v in stated.values()):
                by_eps.setdefault((s.spec.eps, "own"), []).append(s)
            continue
        meant = {k: v for k, v in stated.items() if keys is None or k in keys}
        if not any(math.isclose(s.spec.eps, v, rel_tol=0.01) for v in meant.values()):
            by_eps.setdefault((s.spec.eps, ",".join(meant)), []).append(s)
    for (eps, keys), bad in by_eps.items():
        names = [s.name for s in bad]
        shown = ", ".join(names[:3]) + (f" … ({len(names)} sites)" if len(names) > 3 else "")
        if keys == "own":
            notes.append({"kind": "eps_own", "sites": names, "measured": eps, "config": stated,
                        "message": f"ε={eps:g} at {shown} is the code's own: rebuilt with each config ε changed, "
                                   "these sites kept theirs"})
            continue
        meant = {k: stated[k] for k in keys.split(",")}
        config = ", ".join(f"{k}={v:g}" for k, v in meant.items())
        out.append({"kind": "eps_mismatch", "sites": names, "measured": eps, "config": meant,
                    "message": f"measured ε={eps:g} at {shown}; the config states {config}"
                               + (" for these sites" if followers is not None else "")})
    return out, notes
