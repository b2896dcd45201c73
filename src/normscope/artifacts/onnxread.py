"""The static contract of an ONNX graph: fused normalization nodes and decomposed subgraphs.

Fused nodes state their contract in attributes (``LayerNormalization(axis, epsilon)``,
``GroupNormalization(num_groups, epsilon)``, …). Decomposed norms are found from their square root:
``Sqrt`` of a mean of squares — of ``x − mean(x)`` (LayerNorm) or of ``x`` (RMSNorm) — divided into the same
(centred) input, with ε added inside the root (``sqrt(var + ε)``), outside it (``std + ε``) or as a clamp
(``max(std, ε)``); a following ``Mul``/``Add`` by initializers is γ/β (``Mul(1 + w)`` is a γ offset).
Sites are named by the node's scope (``/layers.3/attn_norm/Sqrt`` → ``layers.3.attn_norm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..extras import require
from ..loading import file_size
from .model import ContractSite, ModelContract, value_stats
from .names import canonicalize, module_path

MAX_ONNX_BYTES = 2**31  # protobuf's own limit for one message

_FUSED = {
    "LayerNormalization": "layernorm",
    "RMSNormalization": "rmsnorm",
    "SimplifiedLayerNormalization": "rmsnorm",
    "SkipLayerNormalization": "layernorm",
    "SkipSimplifiedLayerNormalization": "rmsnorm",
    "GroupNormalization": "groupnorm",
    "InstanceNormalization": "instancenorm",
    "BatchNormalization": "batchnorm",
}
_DEFAULT_EPS = {"BatchNormalization": 1e-5, "InstanceNormalization": 1e-5, "GroupNormalization": 1e-5,
                "LayerNormalization": 1e-5, "RMSNormalization": 1e-5, "SimplifiedLayerNormalization": 1e-5,
                "SkipLayerNormalization": 1e-12, "SkipSimplifiedLayerNormalization": 1e-12}


def _onnx():
    return require("onnx", "onnx")


_SHAPE_ARITHMETIC = ("Gather", "ReduceProd", "Cast", "Sub", "Add", "Mul", "Div", "Unsqueeze", "Squeeze", "Concat",
                     "Reshape", "Identity")


class _Graph:
    def __init__(self, graph, onnx):
        self.onnx = onnx
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = {}
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)
        self.init = {t.name: t for t in graph.initializer}
        self.rank: dict[str, int] = {}
        self.dims: dict[str, list[int | None]] = {}
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
                self.rank[vi.name] = len(dims)
                self.dims[vi.name] = dims

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant output (None when not constant or stored externally)."""
        helper = self.onnx.numpy_helper
        if name in self.init:
            t = self.init[name]
            if t.data_location == self.onnx.TensorProto.EXTERNAL:
                return None
            return helper.to_array(t)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f)
                if a.name == "value_floats":
                    return np.array(list(a.floats))
        if node is not None and node.op_type in ("Cast", "Identity") and node.input:
            return self.const(node.input[0])
        return None

    def scalar(self, name: str) -> float | None:
        v = self.const(name)
        if v is None or v.size != 1:
            return None
        return float(v.reshape(()))

    def op(self, name: str, *types: str):
        node = self.producer.get(name)
        return node if node is not None and node.op_type in types else None

    def attr(self, node, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return self.onnx.helper.get_attribute_value(a)
        return default

    def reduce_axes(self, node) -> tuple[int, ...] | None:
        axes = self.attr(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            v = self.const(node.input[1])
            axes = None if v is None else v.ravel().tolist()
        if axes is None:
            return None
        return tuple(int(a) for a in axes)

    def shape_only(self, name: str, depth: int = 0) -> bool:
        """Whether a value depends on the graph's data only through shapes (a constant, or Shape/Size and
        arithmetic on them: the row length n an unbiased estimator divides by n − 1 with)."""
        if self.const(name) is not None:
            return True
        node = self.producer.get(name)
        if node is None or depth > 12:
            return False
        if node.op_type in ("Shape", "Size"):
            return True
        if node.op_type in _SHAPE_ARITHMETIC:
            return all(self.shape_only(i, depth + 1) for i in node.input if i)
        return False

    def other(self, node, name: str) -> str | None:
        """The input of a binary node that is not ``name``."""
        a, b = (list(node.input) + ["", ""])[:2]
        return b if a == name else a if b == name else None


def read_onnx(path: str | Path) -> ModelContract:
    """The contract of an ONNX file (the graph only; external weight files are not opened)."""
    onnx = _onnx()
    path = Path(path)
    file_size(path, MAX_ONNX_BYTES, "one ONNX protobuf message",
              "save the weights as external data (onnx.save_model(model, path, save_as_external_data=True))")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-turned-errors and more
        raise InputError(f"{path}: not an ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.graph.node or not model.ir_version:
        raise InputError(f"{path}: not an ONNX model (no graph nodes; is it an ONNX file?)")
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # shapes only sharpen axes; a graph shape inference rejects is still read
        pass
    g = _Graph(model.graph, onnx)
    found: list[tuple[str, ContractSite]] = []
    reads: dict[int, str] = {}  # id(site) → the value it normalizes, before casts
    for node in model.graph.node:
        if node.op_type in _FUSED:
            found.append((_scope(node), _fused(g, node)))
            reads[id(found[-1][1])] = _uncast(g, node.input[0])
        elif node.op_type == "Sqrt":
            decomposed = _decomposed(g, node)
            if decomposed is not None:
                found.append((_scope(node), decomposed[0]))
                reads[id(decomposed[0])] = _uncast(g, decomposed[1])
    names = canonicalize([p for p, _ in found])
    seen: dict[str, int] = {}
    sites = []
    for p, site in found:
        name, layer, role = names[p]
        seen[name] = seen.get(name, 0) + 1
        site.name = name if seen[name] == 1 else f"{name}#{seen[name]}"
        site.layer, site.role = layer, role
        sites.append(site)
    notes = [] if sites else ["no normalization nodes or subgraphs found"]
    matmuls = sum(node.op_type in ("MatMul", "Gemm") for node in model.graph.node)
    if not sites and matmuls:
        notes.append(f"the graph has {matmuls} MatMul/Gemm nodes but no norm site was recognised: a norm written in "
                     "a form this reader does not know would be missed; scan the torch model (normscope scan), or "
                     "infer a suspected subgraph (normscope infer FILE.onnx)")
    out = ModelContract(source=str(path), kind="onnx", sites=sites, notes=notes, weights=True,
                        n_layers=max((s.layer for s in sites if s.layer is not None), default=-1) + 1 or None)
    if out.placement == "pre" and _parallel(sites, reads):
        out.stated_placement = "parallel"
        out.notes.append("placement parallel: in every block the two pre norms read the same value")
    return out


def _uncast(g: _Graph, name: str) -> str:
    """``name`` back through Cast and Identity nodes."""
    for _ in range(8):
        node = g.op(name, "Cast", "Identity")
        if node is None or not node.input:
            return name
        name = node.input[0]
    return name


def _parallel(sites: list[ContractSite], reads: dict[int, str]) -> bool:
    """Whether each block's attention and MLP pre norms read one value (``x + attn(n1(x)) + mlp(n2(x))``)."""
    blocks: dict[int, dict[str, str]] = {}
    for s in sites:
        if s.layer is not None and s.name.endswith((".attn_norm", ".ffn_norm")):
            blocks.setdefault(s.layer, {})[s.name.rsplit(".", 1)[1]] = reads.get(id(s), "")
    return bool(blocks) and all(len(b) == 2 and b["attn_norm"] == b["ffn_norm"] != "" for b in blocks.values())


def _scope(node) -> str:
    name = node.name or (node.output[0] if node.output else node.op_type)
    if "/" in name:
        name = name.rsplit("/", 1)[0] or name
    return module_path(name) or node.op_type


def _negative(axes: tuple[int, ...] | None, rank: int | None) -> tuple[int, ...] | None:
    if axes is None:
        return None
    if any(a >= 0 for a in axes):
        if rank is None:
            return None
        axes = tuple(a - rank if a >= 0 else a for a in axes)
    return tuple(sorted(axes))


def _size(g: _Graph, x: str, axes: tuple[int, ...] | None) -> int | None:
    dims = g.dims.get(x)
    if dims is None or axes is None:
        return None
    n = 1
    for a in axes:
        if not -len(dims) <= a < len(dims) or dims[a] is None:
            return None
        n *= dims[a]
    return n


def _fused(g: _Graph, node) -> ContractSite:
    op = node.op_type
    family = _FUSED[op]
    eps = g.attr(node, "epsilon", _DEFAULT_EPS[op])
    x = node.input[0]
    rank = g.rank.get(x)
    inputs = list(node.input) + [""] * 6
    notes = []
    groups = None
    if op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
        axis = int(g.attr(node, "axis", -1))
        if axis < 0:
            axes = tuple(range(axis, 0))
        else:
            axes = tuple(range(axis - rank, 0)) if rank is not None else None
        scale, bias = inputs[1], inputs[2] if op == "LayerNormalization" else ""
    elif op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
        axes = (-1,)
        scale, bias = inputs[2], inputs[3] if op == "SkipLayerNormalization" else ""
        notes.append("the residual add (skip) is fused into the norm")
    elif op == "BatchNormalization":
        axes = None if rank is None else tuple(a for a in range(rank) if a != 1)
        scale, bias = inputs[1], inputs[2]
        notes.append("running statistics (inference graph)")
    else:  # InstanceNormalization, GroupNormalization: statistics over the spatial axes (and channels per group)
        if rank is None:
            axes = None
        else:
            axes = tuple(range(2, rank)) if op == "InstanceNormalization" else tuple(range(1, rank))
        scale, bias = inputs[1], inputs[2]
        if op == "GroupNormalization":
            groups = int(g.attr(node, "num_groups"))
    w = g.const(scale) if scale else None
    b = g.const(bias) if bias else None
    site = ContractSite(
        name="", source=node.name or op, family=family, eps=float(eps), eps_placement="inside_sqrt", axes=axes,
        size=_size(g, x, axes) if axes else None, gamma=bool(scale), beta=bool(bias),
        gamma_offset=0.0 if scale else None, gamma_stats=value_stats(w), beta_stats=value_stats(b),
        param_shape=tuple(w.shape) if w is not None else None, groups=groups, notes=notes,
    )
    if op in ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"):
        site.beta = False
    if op == "GroupNormalization" and w is not None and groups is not None and w.size == groups:
        site.notes.append("γ/β per group (GroupNormalization before opset 21)")
    return site


def _centred(g: _Graph, name: str) -> tuple[str, tuple[int, ...] | None] | None:
    """(x, axes) when ``name`` is x − ReduceMean(x, axes)."""
    sub = g.op(name, "Sub")
    if sub is None:
        return None
    x, m = sub.input[0], sub.input[1]
    mean = g.op(m, "ReduceMean")
    if mean is None or mean.input[0] != x:
        return None
    return x, g.reduce_axes(mean)


def _square_of(g: _Graph, name: str) -> str | None:
    node = g.op(name, "Pow", "Mul")
    if node is None:
        return None
    if node.op_type == "Pow":
        return node.input[0] if g.scalar(node.input[1]) == 2.0 else None
    return node.input[0] if node.input[0] == node.input[1] else None


def _decomposed(g: _Graph, sqrt) -> tuple[ContractSite, str] | None:
    """A normalization whose denominator is this Sqrt, with the value it normalizes; or None."""
    inner = sqrt.input[0]
    eps, placement = 0.0, "none"
    add = g.op(inner, "Add")
    if add is not None:
        for a, b in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
            c = g.scalar(b)
            if c is not None:
                eps, placement, inner = c, "inside_sqrt", a
                break
        else:
            return None
    inner, rescaled = _unscaled(g, inner)
    mean = g.op(inner, "ReduceMean")
    if mean is None:
        return None
    squared = _square_of(g, mean.input[0])
    if squared is None:
        return None
    axes = g.reduce_axes(mean)
    centred = _centred(g, squared)
    x = centred[0] if centred else squared
    if centred and centred[1] != axes:
        return None
    # the denominator: Sqrt, maybe + ε (outside) or max(·, ε) (clamp)
    denom = sqrt.output[0]
    for node in g.consumers.get(denom, []):
        if placement == "none" and node.op_type in ("Add", "Max", "Clip"):
            other = g.other(node, denom) if node.op_type != "Clip" else (list(node.input) + ["", ""])[1]
            c = g.scalar(other) if other else None
            if c is not None:
                eps, placement = c, "outside_sqrt" if node.op_type == "Add" else "clamp"
                denom = node.output[0]
                break
    out = _normalized(g, denom, x, centred is not None, axes)
    if out is None:
        return None
    y, numerator = out
    if numerator is None:
        return None
    rank = g.rank.get(x)
    neg = _negative(axes, rank)
    site = ContractSite(name="", source=sqrt.name or "Sqrt", family="layernorm" if centred else "rmsnorm",
                        eps=eps, eps_placement=placement, axes=neg, size=_size(g, x, neg))
    _affine(g, y, site, gamma_before=numerator or None)
    site.notes.append("decomposed subgraph")
    if rescaled:
        site.notes.append("the variance is rescaled by a factor from the input's shape (an unbiased estimator, "
                          "÷(d−1), as x.std() exports)")
    return site, x


def _unscaled(g: _Graph, name: str) -> tuple[str, bool]:
    """``name`` without Mul/Div by shape-derived factors (x.std() exports ReduceMean·n/(n − 1)); and whether
    any was taken off."""
    rescaled = False
    for _ in range(4):
        node = g.op(name, "Mul", "Div")
        if node is None:
            break
        a, b = node.input[0], node.input[1]
        if g.shape_only(b):
            name, rescaled = a, True
        elif node.op_type == "Mul" and g.shape_only(a):
            name, rescaled = b, True
        else:
            break
    return name, rescaled


def _is_numerator(g: _Graph, name: str, x: str, centre: bool, axes) -> str | None:
    """"" when ``name`` is the numerator (x, or x − mean(x)); the name of γ when it is γ·numerator (the affine
    factors in either order: ``a_2 * (x − mean) / (std + eps)``); else None."""
    def plain(n: str) -> bool:
        if not centre:
            return n == x
        c = _centred(g, n)
        return c is not None and c[0] == x and c[1] == axes

    if plain(name):
        return ""
    mul = g.op(name, "Mul")
    if mul is not None:
        for a, b in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            w = g.const(a)
            if w is not None and w.size > 1 and plain(b):
                return a
    return None


def _normalized(g: _Graph, denom: str, x: str, centre: bool, axes) -> tuple[str, str | None] | None:
    """The output x̂ = numerator / denom (Div, or Mul by Reciprocal / 1 ÷ denom), and what :func:`_is_numerator`
    says of its numerator."""
    for node in g.consumers.get(denom, []):
        inv = None
        if node.op_type == "Div" and node.input[1] == denom:
            if g.scalar(node.input[0]) != 1.0:
                return node.output[0], _is_numerator(g, node.input[0], x, centre, axes)
            inv = node.output[0]  # 1 / denom, as torch exports rsqrt
        elif node.op_type == "Reciprocal":
            inv = node.output[0]
        if inv is not None:
            for mul in g.consumers.get(inv, []):
                if mul.op_type == "Mul":
                    other = g.other(mul, inv)
                    return mul.output[0], _is_numerator(g, other, x, centre, axes)
    return None


def _through_casts(g: _Graph, y: str) -> str:
    """``y`` followed through the ops that change neither its values' meaning nor their layout for γ: a Cast
    (Llama-family RMSNorms export ``weight * x̂.to(dtype)``, a Cast that is a no-op at float32), an Identity, a
    Reshape to a shape computed from shapes alone."""
    for _ in range(8):
        nxt = g.consumers.get(y, [])
        if len(nxt) != 1 or not nxt[0].output:
            return y
        node = nxt[0]
        if node.op_type in ("Cast", "Identity") or node.op_type == "Reshape" and g.shape_only(node.input[1]):
            y = node.output[0]
            continue
        return y
    return y


def _affine(g: _Graph, y: str, site: ContractSite, gamma_before: str | None = None) -> None:
    """γ (and an offset 1 + w) and β applied to x̂ by Mul/Add with constant operands; ``gamma_before``: γ already
    applied to the numerator, before the division."""
    site.gamma, site.beta, site.gamma_offset = False, False, None
    y = _through_casts(g, y)
    nxt = g.consumers.get(y, [])
    if gamma_before is not None:
        w = g.const(gamma_before)
        site.gamma, site.gamma_offset = True, 0.0
        site.gamma_stats, site.param_shape = value_stats(w), tuple(w.shape)
    elif len(nxt) == 1 and nxt[0].op_type == "Mul":
        mul = nxt[0]
        w_name = g.other(mul, y)
        w = g.const(w_name) if w_name else None
        offset = 0.0
        if w is None and w_name:
            add = g.op(w_name, "Add")
            if add is not None:
                for a, b in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
                    c, v = g.scalar(a), g.const(b)
                    if c is not None and v is not None and v.size > 1:
                        offset, w = c, v
                        break
        if w is not None:
            site.gamma, site.gamma_offset = True, offset
            site.gamma_stats, site.param_shape = value_stats(w), tuple(w.shape)
            y = mul.output[0]
            nxt = g.consumers.get(y, [])
    if len(nxt) == 1 and nxt[0].op_type == "Add":
        b_name = g.other(nxt[0], y)
        b = g.const(b_name) if b_name else None
        if b is not None and b.size > 1:
            site.beta, site.beta_stats = True, value_stats(b)
    if not site.gamma:
        site.gamma_offset = None
