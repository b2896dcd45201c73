"""What the tracer hooks in a model, found without changing it: the blocks (the repeated elements of a
``ModuleList``/``Sequential``, outermost only, or the modules the user names), the norms (the scan's class
discovery) and the parameter groups (a block's child module; outside the blocks, the module itself)."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import InputError
from ..sites.core import known_class
from ..sites.dataflow import block_modules


@dataclasses.dataclass
class Layout:
    blocks: dict[int, int]  # id(module) -> layer index
    block_names: list[str]
    norms: dict[int, tuple[int | None, str]]  # id(module) -> (layer, name inside the block)
    param_group: dict[int, tuple[int | None, str]]  # id(parameter) -> (layer, group)
    param_order: list[tuple[int | None, str]]  # the groups in the model's parameter order
    params: list[torch.nn.Parameter]
    prefixes: list[tuple[str, int]]  # ("block.name.", layer), longest first

    def locate(self, name: str) -> tuple[int | None, str]:
        """(block index, name inside the block) of a module path; (None, full path) outside the blocks."""
        for pre, i in self.prefixes:
            if (name + ".").startswith(pre):
                return i, name[len(pre):]
        return None, name


def _blocks(model: torch.nn.Module, layers, names: dict[int, str]) -> list[torch.nn.Module]:
    if layers is not None:
        mods = []
        for i, item in enumerate(layers):
            if isinstance(item, str):
                try:
                    item = model.get_submodule(item)
                except AttributeError:
                    raise InputError(f"layers[{i}] = {item!r} names no submodule of the model; pass module "
                                     "names as in model.named_modules() or the modules themselves") from None
            if not isinstance(item, torch.nn.Module) or id(item) not in names:
                raise InputError(f"layers[{i}] is not a submodule of the traced model; pass its modules or names")
            mods.append(item)
        return mods
    found = block_modules(model)
    inner = set()
    for m in model.modules():
        if id(m) in found:
            for sub in m.modules():
                if sub is not m and id(sub) in found:
                    inner.add(id(sub))
    return [m for m in model.modules() if id(m) in found and id(m) not in inner]


def discover(model: torch.nn.Module, layers=None) -> Layout:
    names = {id(m): n for n, m in model.named_modules()}
    mods = _blocks(model, layers, names)
    prefixes = sorted(((names[id(m)] + ".", i) for i, m in enumerate(mods)), key=lambda p: -len(p[0]))
    layout = Layout({id(m): i for i, m in enumerate(mods)}, [names[id(m)] for m in mods], {}, {}, [],
                    list(model.parameters()), prefixes)
    for n, m in model.named_modules():
        if m is not model and known_class(m):
            layout.norms[id(m)] = layout.locate(n)
    for n, p in model.named_parameters():
        layer, rest = layout.locate(n.rsplit(".", 1)[0] if "." in n else n)
        # a block's child module (attn, mlp, ln_1, …); outside the blocks the module itself (the embedding and
        # the final norm are apart even when one parent holds both)
        group = (rest.split(".")[0] if layer is not None else rest) if rest else "params"
        g = (layer, group)
        layout.param_group[id(p)] = g
        if g not in layout.param_order:
            layout.param_order.append(g)
    return layout
