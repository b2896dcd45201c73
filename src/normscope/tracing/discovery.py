"""What the tracer hooks in a model, found without changing it: the blocks (the repeated elements of a
``ModuleList``/``Sequential``, outermost only, or the modules the user names), the repeated elements nested inside
a block (a stage's residual blocks: ResNet, ConvNeXt, Swin), the norms (the scan's class discovery) and the
parameter groups (a block's child module; outside the blocks, the module itself)."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from ..errors import InputError
from ..sites.classes import known_class
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
    scale_offsets: dict[int, float] = dataclasses.field(default_factory=dict)  # id(norm) -> c: it scales by c + w
    # id(module) -> (layer, its name inside the block): the repeated elements of a list inside a block
    nested: dict[int, tuple[int, str]] = dataclasses.field(default_factory=dict)

    def locate(self, name: str) -> tuple[int | None, str]:
        """(block index, name inside the block) of a module path; (None, full path) outside the blocks."""
        for pre, i in self.prefixes:
            if (name + ".").startswith(pre):
                return i, name[len(pre):]
        return None, name


def _blocks(model: torch.nn.Module, layers, names: dict[int, str], found: dict[int, int]) -> list[torch.nn.Module]:
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
    inner = set()
    for m in model.modules():
        if id(m) in found:
            for sub in m.modules():
                if sub is not m and id(sub) in found:
                    inner.add(id(sub))
    return [m for m in model.modules() if id(m) in found and id(m) not in inner]


def _nested(mods: list[torch.nn.Module], found: dict[int, int]) -> dict[int, tuple[int, str]]:
    """The repeated elements of the lists inside each block, by (layer, name inside the block). Whether one is a
    residual block of its own is seen in the forward (an add of its own input); each such call is then the stream's
    scope for the adds inside it, since the stage around it may change the stream before it (a downsampling
    layer, a ReLU after each add) or between its elements."""
    chosen = {id(m) for m in mods}
    out: dict[int, tuple[int, str]] = {}
    for i, block in enumerate(mods):
        for name, sub in block.named_modules():
            if sub is not block and id(sub) in found and id(sub) not in chosen:
                out.setdefault(id(sub), (i, name))
    return out


def discover(model: torch.nn.Module, layers=None) -> Layout:
    names = {id(m): n for n, m in model.named_modules()}
    found = block_modules(model)  # the candidates: the blocks (unless named) and the elements nested in them
    mods = _blocks(model, layers, names, found)
    prefixes = sorted(((names[id(m)] + ".", i) for i, m in enumerate(mods)), key=lambda p: -len(p[0]))
    layout = Layout({id(m): i for i, m in enumerate(mods)}, [names[id(m)] for m in mods], {}, {}, [],
                    list(model.parameters()), prefixes, nested=_nested(mods, found))
    for n, m in model.named_modules():
        if m is not model and known_class(m):
            layout.norms[id(m)] = layout.locate(n)
            c = scale_offset(m)
            if c:
                layout.scale_offsets[id(m)] = c
    lists = {n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList | torch.nn.ModuleDict)}
    for n, p in model.named_parameters():
        layer, rest = layout.locate(n.rsplit(".", 1)[0] if "." in n else n)
        # a block's child module (attn, mlp, ln_1, …), one level further where that child is a list of modules
        # (T5's block.layer: self-attention, cross-attention, feed-forward); outside the blocks the module itself
        # (the embedding and the final norm are apart even when one parent holds both)
        group = (_child(rest, layout.block_names[layer], lists) if layer is not None else rest) if rest else "params"
        g = (layer, group)
        layout.param_group[id(p)] = g
        if g not in layout.param_order:
            layout.param_order.append(g)
    return layout


def _child(rest: str, block: str, lists: set[str]) -> str:
    """The parameter group inside a block: its child module's name, or ``child.i`` where the child is a list."""
    parts = rest.split(".")
    if len(parts) > 1 and f"{block}.{parts[0]}" in lists:
        return ".".join(parts[:2])
    return parts[0]


def scale_offset(norm: torch.nn.Module) -> float:
    """The constant c of a norm that scales its normalized input by c + w rather than by its weight w (Gemma's
    RMSNorm: 1 + w, its weight initialised at 0), measured on a private float32 copy: with w = 0 and w = 1, the
    output of ±a·u (u a row of ±1, a large enough that ε is negligible) gives the effective scale
    (y₊ − y₋) / 2a·u at every position, c₀ and c₀ + c₁; c = c₀ / c₁ when both are the same at every position.
    0 for the usual c = 0, and for any module this experiment does not fit (a weight that is not one scale per
    feature of the last axis, running statistics, a failing call): its weight is then taken as the scale."""
    w = getattr(norm, "weight", None)
    if (not isinstance(w, torch.nn.Parameter) or type(w.data) is not torch.Tensor or w.dim() != 1 or w.numel() < 2
            or any(True for _ in norm.buffers()) or w.device.type == "meta"):
        return 0.0
    try:
        twin = copy.deepcopy(norm).float().cpu()
        d, a = w.numel(), 1e3
        u = torch.ones(d)
        u[1::2] = -1.0
        if d % 2:
            u[-1] = 0.0  # the row stays centred: a LayerNorm's mean is 0, its variance (d - 1) / d
        x = torch.stack([a * u, -a * u])
        live = u != 0
        scales = []
        with torch.no_grad():
            for value in (0.0, 1.0):
                twin.weight.fill_(value)
                y = twin(x)
                if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                    return 0.0
                scales.append(((y[0] - y[1])[live] / (2 * u[live])).double())  # the scale × the normalizer's
        c0, c1 = scales[0], scales[1] - scales[0]
        if not (bool(torch.isfinite(c0).all()) and bool(torch.isfinite(c1).all())) or float(c1.abs().min()) <= 0:
            return 0.0
        ratio = c0 / c1
        c = float(ratio.mean())
        if float((ratio - c).abs().max()) > 1e-3 * max(1.0, abs(c)) or abs(c) < 1e-3:
            return 0.0
        return c if not math.isclose(c, round(c), abs_tol=1e-3) else float(round(c))
    except Exception:  # a module this experiment does not fit: its weight is its scale, as before
        return 0.0
