"""A large architecture read at reduced depth: the layers that differ, once each, then extended to the full depth.

A model whose forward reads values (it does not run on the meta device) and is too large to build with random
weights is built with fewer layers of the same width: the configuration's layer counts are cut to the shortest
prefix of each block list that holds every distinct kind of layer the full model has (and its per-layer lists
follow), so sliding and full attention, dense and MoE, Mamba and attention layers all appear once. A layer's
kind is its structure — each module's class, parameter shapes and plain settings (the layer's own index set
aside) — read from the full model on the meta device. The reduced model must have the same kinds in the same
order as the full model's prefix, else it is refused. The norm sites the scan of the reduced model finds in a
layer are then given to every layer of the full model of that kind. Layer indices a configuration lists for what
runs after a layer (Qwen3-VL's deep-stack mergers) move onto layers added after the prefix where the cut would drop
them, so their norms are met; their sites keep their names and contracts, in the reduced forward's order.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

#: plain settings that hold a layer's own position rather than its kind
_INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx", "idx")


@dataclasses.dataclass
class BlockList:
    """One list of layers: its module path, and the kind of each of its layers."""

    path: str
    kinds: list[Any]
    positions: frozenset[str] = frozenset()  # the integer settings that count along the list (a layer's index)

    def prefix(self) -> int:
        """How many layers from the front hold every kind the list has."""
        need, seen = set(self.kinds), set()
        for i, kind in enumerate(self.kinds):
            seen.add(kind)
            if seen == need:
                return i + 1
        return len(self.kinds)

    def representative(self, i: int, k: int) -> int:
        """The layer among the first ``k`` of the same kind as layer ``i``."""
        return i if i < k else self.kinds.index(self.kinds[i])


def block_lists(model: torch.nn.Module, like: list[BlockList] | None = None) -> list[BlockList]:
    """The model's lists of layers: each ``ModuleList`` of two or more modules with parameters, outside any other
    (or a reduced model's lists at the paths of the full model's ``like``, of any length, their kinds read with
    the same settings set aside as positions)."""
    if like is not None:
        return [BlockList(b.path, *_kinds(list(model.get_submodule(b.path)), b.positions)) for b in like]
    found: list[BlockList] = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if any(path.startswith(b.path + ".") for b in found):
            continue
        if not all(any(True for _ in m.parameters()) for m in module):
            continue
        found.append(BlockList(path, *_kinds(list(module))))
    return found


def _kinds(layers: list[torch.nn.Module], positions: frozenset[str] | None = None) -> tuple[list[Any], frozenset[str]]:
    settings = [_settings(layer) for layer in layers]
    if positions is None:  # an integer setting that counts along the list is a position, whatever its name
        positions = frozenset(key for key in (settings[0] if settings else ())
                              if all(s.get(key) in (i, i + 1) for i, s in enumerate(settings))
                              and len({s.get(key) for s in settings}) > 1)
    kinds = []
    for layer, s in zip(layers, settings, strict=True):
        structure = tuple((name, type(m).__name__, tuple((p, tuple(t.shape)) for p, t in m.named_parameters(
            recurse=False))) for name, m in layer.named_modules())
        kinds.append((structure, tuple(sorted((k, v) for k, v in s.items() if k not in positions))))
    return kinds, positions


def _settings(layer: torch.nn.Module) -> dict[str, Any]:
    out = {}
    for name, m in layer.named_modules():
        for key, value in vars(m).items():
            if key.startswith("_") or key in _INDEX_NAMES or key == "training":
                continue
            if value is None or isinstance(value, bool | int | float | str):
                out[f"{name}:{key}"] = value
    return out


def reduced_config(config, lists: list[BlockList], move_indices: bool = False):
    """A copy of the transformers ``config`` (and its sub-configs) with each layer count that a block list has cut
    to that list's :meth:`BlockList.prefix`, its per-layer lists cut with it; None when nothing is cut.

    ``move_indices``: lists of layer indices the cut would drop (the layers after which Qwen3-VL's deep-stack
    mergers run) keep every entry — the dropped ones move onto layers added after the prefix — so what runs at
    those layers is met. Where the indices decide the layers' kinds, the reduced model's layers then differ from
    the full model's prefix and the caller tries the plain cut."""
    want: dict[int, int] = {}  # a full layer count → the count to build
    for bl in lists:
        n = len(bl.kinds)
        want[n] = max(want.get(n, 0), bl.prefix(), min(n, 2))  # two at least: a block repeats to be seen as one
    out = copy.deepcopy(config)
    cut = _cut(out, {n: k for n, k in want.items() if k < n}, move_indices)
    return out if cut else None


def _cut(config, want: dict[int, int], move_indices: bool = False) -> bool:
    cut = False
    fields = vars(config)
    for value in list(fields.values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            cut |= _cut(value, want, move_indices)
    counts = {key: value for key, value in fields.items() if _is_depth(key)
              and isinstance(value, int) and not isinstance(value, bool) and value in want}
    for key, n in counts.items():
        k = want[n]
        if move_indices:
            k = _move_indices(fields, config, n, k)
        for other, value in list(fields.items()):
            if isinstance(value, list) and len(value) == n:
                setattr(config, other, value[:k])
        setattr(config, key, k)
        cut = True
    return cut


def _is_depth(key: str) -> bool:
    """Whether a config field names a number of layers: ``num_hidden_layers``, ``depth``, Perceiver's
    ``num_self_attends_per_block`` (the built model's lists then show whether the cut held). Not every ``*_blocks``:
    many count something else (sparse attention's top-k blocks, a decoder's residual blocks per level)."""
    return "layer" in key or "attends" in key or key == "depth"


def _move_indices(fields: dict[str, Any], config, n: int, k: int) -> int:
    """Move the entries ≥ ``k`` of the config's lists of layer indices (increasing, each < ``n``, fewer than ``n``)
    onto layers ``k``, ``k + 1``, …; the new layer count."""
    lists = {key: value for key, value in fields.items() if isinstance(value, list | tuple) and 0 < len(value) < n
             and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in value)
             and list(value) == sorted(set(value))}
    dropped = sorted({v for value in lists.values() for v in value if v >= k})
    if not dropped:
        return k
    moved = {v: k + i for i, v in enumerate(dropped)}
    for key, value in lists.items():
        setattr(config, key, type(value)(moved.get(v, v) for v in value))
    return k + len(dropped)


#: config fields holding how many routed experts an MoE layer has, and how many each token goes to
_EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k")


def fewer_experts(config, keep: int = 4) -> list[str]:
    """Cut the routed experts of ``config`` and its sub-configs (in place) to ``keep``, or to as many as a token
    goes to where that is more; what was cut, for the note. The norms sit outside the experts, so their contract
    does not depend on how many there are; the caller checks that the layers keep their kinds."""
    notes = []
    fields = vars(config)
    for value in list(fields.values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            notes += fewer_experts(value, keep)
    per_token = max((v for k in _EXPERTS_PER_TOKEN if isinstance(v := fields.get(k), int)
                     and not isinstance(v, bool)), default=1)
    k = max(keep, per_token)
    for key in _EXPERT_COUNTS:
        n = fields.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > k:
            setattr(config, key, k)
            notes.append(f"{k} of {n} experts")
    return notes


def same_pattern(full: list[BlockList], other: list[BlockList]) -> bool:
    """Whether two models' layer lists group their layers into kinds the same way (layer ``i`` and ``j`` of a list
    are of one kind in both or in neither): a model with fewer experts has other shapes, the same pattern."""
    if [f.path for f in full] != [o.path for o in other]:
        return False
    return all(len(f.kinds) == len(o.kinds) and [f.kinds.index(k) for k in f.kinds] == [o.kinds.index(k)
                                                                                       for k in o.kinds]
               for f, o in zip(full, other, strict=True))


def outside(model: torch.nn.Module, lists: list[BlockList]) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameters outside its layer lists, with their shapes: what a cut of the lists leaves alone."""
    heads = tuple(f"{b.path}." for b in lists)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters() if not name.startswith(heads)]


def same_prefix(full: list[BlockList], reduced: list[BlockList]) -> str | None:
    """None when each reduced list is the full one's prefix, kind by kind; else what differs."""
    for f, r in zip(full, reduced, strict=True):
        if f.kinds[:len(r.kinds)] != r.kinds or set(r.kinds) != set(f.kinds):
            return f"its layers in {f.path} are not the full model's first {len(r.kinds)}"
    return None


def extend(sites: list, full: list[BlockList], reduced: list[BlockList]) -> list:
    """The reduced model's scan sites given to every layer of the full model: the sites of layer ``j`` of a list
    are copied, renamed and renumbered, to each later layer of ``j``'s kind, in layer order after the list's last
    site in the scan; the other sites stay where they are."""
    out = list(sites)
    for f, r in zip(full, reduced, strict=True):
        k = len(r.kinds)
        head = f"{f.path}." if f.path else ""
        of_layer: dict[int, list[tuple[object, str]]] = {}
        last = None
        for n, site in enumerate(out):
            j = _index(site.name, head)
            if j is not None and j < k:
                of_layer.setdefault(j, []).append((site, site.name[len(f"{head}{j}"):]))
                last = n
        if last is None:
            continue
        copies = [dataclasses.replace(site, name=f"{head}{i}{rest}", layer=i)
                  for i in range(k, len(f.kinds)) for site, rest in of_layer.get(f.representative(i, k), [])]
        out[last + 1:last + 1] = copies
    return out


def _index(name: str, head: str) -> int | None:
    """The layer index of a site named under ``head`` (``model.layers.`` → 3 for ``model.layers.3.norm``)."""
    if not name.startswith(head):
        return None
    index = name[len(head):].split(".", 1)[0].split(":", 1)[0].split("#", 1)[0]
    return int(index) if index.isdigit() else None
