"""Normalizations written inline in a larger forward, found by their op pattern in the recorded dataflow.

``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`` inside an attention or a block's forward has no module
boundary and calls no normalization function. It is found from its statistic: a ``rsqrt`` (or a ``sqrt`` that
divides) of a mean of squares — of ``x`` (RMSNorm) or of ``x − mean(x)`` (LayerNorm), ε added or not, a mean
written by hand over a mask included (``Σ(x·m) / Σm``: a time-series scaler's observed positions) — whose
result scales that same ``x``; the site then runs on through casts, a γ multiply and a β add by parameters, to
the last value of ``x``'s shape. A gated norm (Mamba 2: ``rms(x · silu(z))``) is the same pattern on the gated
product, so its contract is read with the gate held fixed.

The site is replayed from the recorded ops (:class:`InlineNorm`): the functions and arguments of the ops between
its input and its output, with the input substituted and the model's parameters (γ, β) as its own parameters,
so ``infer`` probes it as any module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .trace import TRANSPARENT, Ref, Trace, _tensors

_SQUARES = frozenset({"pow", "__pow__", "square"})
_PRODUCTS = frozenset({"mul", "__mul__", "__rmul__"})
_MEANS = frozenset({"mean"})
_ADDS = frozenset({"add", "__add__", "__radd__"})
_SUBS = frozenset({"sub", "__sub__"})
_DIVS = frozenset({"div", "__truediv__"})
_CASTS = frozenset({"to", "float", "type_as", "type", "half", "bfloat16", "double"})
_NAMED_CASTS = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "double": torch.float64}


@dataclasses.dataclass
class InlineSite:
    x: int  # the value normalized (before any cast the norm makes)
    y: int  # the site's output (after γ, β and a cast back)
    ops: list[int]  # the recorded ops from x to y, in order
    call: int | None
    first_op: int
    centred: bool
    # dtypes a cast inside the site asked for that its value already had: a no-op in this forward, so absent from
    # the replay, which then cannot show what the cast does at another dtype (Llama's upcast in a float32 model)
    silent_casts: tuple[str, ...] = ()


class _Flow:
    def __init__(self, trace: Trace):
        self.t = trace
        self.consumers: dict[int, list[int]] = {}
        for op in trace.ops:
            for v in op.inputs:
                self.consumers.setdefault(v, []).append(op.index)

    def producer(self, v: int):
        p = self.t.values[v].producer
        return None if p is None else self.t.ops[p]

    def acts(self, op) -> list[int]:
        return [i for i in op.inputs if not self.t.values[i].param]

    def back(self, v: int) -> int:
        """Through casts back to the value they carry."""
        for _ in range(8):
            op = self.producer(v)
            if op is None or op.name not in _CASTS | TRANSPARENT or len(self.acts(op)) != 1:
                return v
            v = self.acts(op)[0]
        return v

    def uncast(self, v: int) -> int:
        """Through dtype casts only, back to the value they carry (the layout a norm reads, a reshape or a
        transpose, decides which axis it normalizes)."""
        for _ in range(8):
            op = self.producer(v)
            if op is None or op.name not in _CASTS or len(self.acts(op)) != 1:
                return v
            v = self.acts(op)[0]
        return v

    def users(self, v: int) -> list:
        """The ops that read ``v`` and write a value (a no-op cast returns its input and writes none)."""
        return [self.t.ops[i] for i in self.consumers.get(v, []) if self.t.ops[i].outputs]

    def same(self, v: int) -> tuple:
        """What ``v`` computes, up to casts: ``x - mean(x)`` written twice is one thing."""
        v = self.back(v)
        op = self.producer(v)
        if op is not None and op.name in _SUBS and len(op.inputs) == 2:
            return ("centred", self.back(op.inputs[0]), self.back(op.inputs[1]))
        return ("value", v)


def _squared(f: _Flow, v: int) -> int | None:
    """The value whose elementwise square ``v`` is (``x.pow(2)``, ``x * x``, ``x.square()``)."""
    op = f.producer(v)
    if op is None:
        return None
    acts = f.acts(op)
    if op.name in _SQUARES and len(acts) == 1 and op.tensor_args == 1:
        return acts[0]
    if op.name in _PRODUCTS and len(op.inputs) == 2 and op.inputs[0] == op.inputs[1]:
        return op.inputs[0]
    return None


#: ops whose output reads only their input's shape (``torch.ones_like(x)``: an all-observed mask)
_SHAPE_ONLY = frozenset({"ones_like", "zeros_like", "full_like", "empty_like", "new_ones", "new_zeros", "new_full",
                         "new_empty"})


def _depends(f: _Flow, v: int, on: int, limit: int = 256) -> bool:
    """Whether value ``v`` was computed from the values of ``on`` (not only from its shape)."""
    todo, seen = [v], set()
    while todo and len(seen) < limit:
        u = todo.pop()
        if u == on:
            return True
        if u in seen:
            continue
        seen.add(u)
        op = f.producer(u)
        if op is not None and op.name not in _SHAPE_ONLY:
            todo.extend(op.inputs)
    return False


def _unmasked(f: _Flow, v: int) -> int:
    """``x`` where ``v = x · m`` for a mask ``m`` (an activation not computed from ``x``), else ``v``."""
    op = f.producer(v)
    if op is not None and op.name in _PRODUCTS and len(op.inputs) == 2 and len(f.acts(op)) == 2:
        for x, m in (op.inputs, op.inputs[::-1]):
            if not _depends(f, m, f.back(x)):
                return f.back(x)
    return v


def _averaged(f: _Flow, v: int) -> int | None:
    """The value ``v`` is a mean of: ``mean(a)``, or — written by hand over a mask — ``sum(a · m) / n`` with a count
    ``n`` not computed from ``a`` (a time-series scaler's observed positions); None otherwise."""
    op = f.producer(v)
    if op is None:
        return None
    if op.name in _MEANS and len(f.acts(op)) == 1:
        return f.back(f.acts(op)[0])
    if op.name in _DIVS and len(op.inputs) == 2 and len(f.acts(op)) == 2:
        total, count = op.inputs
        summed = f.producer(f.back(total))
        if summed is not None and summed.name == "sum" and len(f.acts(summed)) == 1:
            a = _unmasked(f, f.back(f.acts(summed)[0]))
            if not _depends(f, count, a):
                return a
    return None


def _statistic(f: _Flow, r: int) -> tuple[int, bool, int] | None:
    """For the input of a rsqrt/sqrt: (the value squared up to casts and layout ops, whether it is centred, the value
    the statistic reads: the one squared, or the centred one's minuend). A mean is ``mean`` or a masked sum over a
    count (:func:`_averaged`), and the value squared may carry the mask (``((x − μ) · m)²``)."""
    v = f.back(r)
    op = f.producer(v)
    if op is not None and op.name in _ADDS and len(f.acts(op)) == 1 and op.tensor_args == 1:
        v = f.back(f.acts(op)[0])  # + ε, a Python number
    averaged = _averaged(f, v)
    if averaged is None:
        return None
    squared = _squared(f, averaged)
    if squared is None:
        return None
    q = f.back(squared)
    for centred in dict.fromkeys((q, _unmasked(f, q))):  # a masked variance squares (x − μ) · m
        sub = f.producer(centred)
        if sub is not None and sub.name in _SUBS and len(sub.inputs) == 2:
            a, m = sub.inputs
            mean = _averaged(f, f.back(m))
            if mean is not None and f.back(mean) == f.back(a):
                return centred, True, a
    return q, False, squared


def _inputs(f: _Flow, v: int) -> tuple[int, ...]:
    """Where a site whose statistic reads ``v`` may take its input, first to last: through layout ops and casts (a
    grouped norm views its input into groups and its output back), then through casts only (a norm of rows that a
    reshape or a transpose made: the layout decides the axis normalized)."""
    return tuple(dict.fromkeys((f.back(v), f.uncast(v))))


def _scales(f: _Flow, root_op, q: int) -> int | None:
    """x̂: the output of the op that scales ``q`` (or a cast of it) by the root's result."""
    out = root_op.outputs[0]
    for op in f.users(out):
        if len(op.outputs) != 1 or len(op.inputs) != 2:
            continue
        other = op.inputs[0] if op.inputs[1] == out else op.inputs[1]
        if f.same(other) != f.same(q):
            continue
        if root_op.name == "rsqrt" and op.name in _PRODUCTS:
            return op.outputs[0]
        if root_op.name == "sqrt" and op.name in _DIVS and op.inputs[1] == out:
            return op.outputs[0]
    return None


def _affine_tail(f: _Flow, v: int, shape: tuple[int, ...]) -> int:
    """On from x̂ through casts, a γ multiply and a β add by parameters, while the shape stays."""
    for _ in range(6):
        ops = f.users(v)
        if len(ops) != 1 or len(ops[0].outputs) != 1:
            return v
        op = ops[0]
        nxt = op.outputs[0]
        if f.t.values[nxt].shape != shape:
            return v
        params = [i for i in op.inputs if f.t.values[i].param]
        if op.name in _CASTS | TRANSPARENT and len(f.acts(op)) == 1:
            v = nxt
        elif op.name in _PRODUCTS | _ADDS and len(op.inputs) == 2 and len(params) == 1:
            v = nxt
        else:
            return v
    return v


def _between(f: _Flow, x: int, y: int) -> list[int] | None:
    """The ops computed from ``x`` that ``y`` depends on, in order; None when one writes in place or has no
    replay."""
    reach = {x}
    ops = []
    for op in f.t.ops[f.t.values[x].producer + 1 if f.t.values[x].producer is not None else 0:]:
        if any(i in reach for i in op.inputs):
            reach.update(op.outputs)
            ops.append(op)
        if y in op.outputs:
            break
    need = {y}
    kept = []
    for op in reversed(ops):
        if any(o in need for o in op.outputs):
            if op.template is None:
                return None
            kept.append(op.index)
            need.update(op.inputs)
    return sorted(kept)


def find_inline(trace: Trace, skip_calls: set[int]) -> list[InlineSite]:
    """Every inline normalization of the forward outside the calls in ``skip_calls`` and the calls they make
    (the module sites' own implementations)."""
    f = _Flow(trace)
    out: list[InlineSite] = []
    taken: set[int] = set()
    for op in trace.ops:
        if op.name not in ("rsqrt", "sqrt") or len(op.outputs) != 1 or len(f.acts(op)) != 1:
            continue
        if op.index in taken or trace.ancestors(op.call) & skip_calls or op.norm is not None:
            continue
        stat = _statistic(f, f.acts(op)[0])
        if stat is None:
            continue
        q, centred, read = stat
        xhat = _scales(f, op, q)
        if xhat is None:
            continue
        for x in _inputs(f, read):  # the first whose shape the site's output comes back to
            shape = trace.values[x].shape
            y = _affine_tail(f, xhat, shape)
            if trace.values[y].shape == shape:
                break
        else:
            continue
        ops = _between(f, x, y)
        if not ops:
            continue
        taken.update(ops)
        out.append(InlineSite(x, y, ops, op.call, ops[0], centred, _silent_casts(trace, x, ops)))
    return out


def _silent_casts(trace: Trace, x: int, ops: list[int]) -> tuple[str, ...]:
    """The dtypes of the site's values that a cast among its ops returned unchanged (the recorder keeps such an op
    without an output: the value it returned is the one it read)."""
    values = {x} | {v for i in ops for v in trace.ops[i].outputs}
    found = []
    for op in trace.ops[ops[0]:ops[-1] + 1]:
        if op.name in _CASTS and not op.outputs and op.inputs and op.inputs[0] in values:
            found.append(str(trace.values[op.inputs[0]].dtype).replace("torch.", ""))
    return tuple(sorted(set(found)))


class InlineNorm(torch.nn.Module):
    """An inline normalization replayed: the recorded ops from its input to its output, the input substituted,
    the model's parameters it reads held as its own (``p0``, ``p1``, … — γ and β for ``infer``)."""

    def __init__(self, trace: Trace, site: InlineSite):
        super().__init__()
        self.x, self.y = site.x, site.y
        self.silent_casts = site.silent_casts
        self.x_dtype = trace.values[site.x].dtype  # a cast to it is a cast back to the input's dtype
        self.steps: list[tuple[Any, Any, Any, tuple[int, ...]]] = []
        self.names: dict[int, str] = {}
        produced = {site.x}
        for i in site.ops:
            op = trace.ops[i]
            func, args, kwargs = op.template
            for v in op.inputs:
                if v in produced or v in self.names:
                    continue
                t = trace.tensor(v)
                if t is None:
                    raise ValueError(f"value {v} is gone")
                name = f"p{len(self.names)}"
                self.names[v] = name
                if trace.values[v].param:
                    self.register_parameter(name, torch.nn.Parameter(t.detach().clone(), requires_grad=False))
                else:
                    self.register_buffer(name, t.detach().clone())
            self.steps.append((func, args, kwargs, op.outputs))
            produced.update(op.outputs)

    def _cast_back(self, func, args, kwargs, dtype: torch.dtype):
        """A recorded cast to the recorded input's dtype (``y.to(x.dtype)``, recorded as its value) as a cast to the
        replayed input's dtype: probed at another dtype, the site casts back to that one, as its code does. Only a
        16-bit input's: a cast to float32 is an upcast for precision whatever the input was."""
        if dtype == self.x_dtype or self.x_dtype not in (torch.float16, torch.bfloat16):
            return func, args, kwargs
        if _NAMED_CASTS.get(func.__name__) == self.x_dtype:
            return torch.Tensor.to, (args[0], dtype), {}
        args = tuple(dtype if a is self.x_dtype else a for a in args)
        kwargs = {k: (dtype if v is self.x_dtype else v) for k, v in kwargs.items()}
        return func, args, kwargs

    def kind_key(self) -> tuple:
        """The replay's structure with the trace's value numbers renumbered from the input: two sites running the
        same ops on the same shapes (one per layer) have one key, whatever values the trace gave them."""
        number: dict[int, int] = {self.x: 0}

        def local(v: int) -> int:
            return number.setdefault(v, len(number))

        def shape(obj, depth: int = 0):
            if isinstance(obj, Ref):
                return ("ref", local(obj.value))
            if depth < 2 and isinstance(obj, list | tuple):
                return tuple(shape(o, depth + 1) for o in obj)
            if depth < 2 and isinstance(obj, dict):
                return tuple(sorted((k, shape(v, depth + 1)) for k, v in obj.items()))
            return repr(obj)

        steps = tuple((getattr(func, "__qualname__", repr(func)), shape(args), shape(kwargs),
                       tuple(local(v) for v in outputs)) for func, args, kwargs, outputs in self.steps)
        return steps, local(self.y), str(self.x_dtype), tuple(self.silent_casts)

    def _arg(self, obj, env: dict[int, torch.Tensor], depth: int = 0):
        if isinstance(obj, Ref):
            return env[obj.value] if obj.value in env else getattr(self, self.names[obj.value])
        if depth < 2 and isinstance(obj, list | tuple):
            return type(obj)(self._arg(o, env, depth + 1) for o in obj)
        if depth < 2 and isinstance(obj, dict):
            return {k: self._arg(v, env, depth + 1) for k, v in obj.items()}
        return obj

    def forward(self, x):
        env = {self.x: x}
        for func, args, kwargs, outputs in self.steps:
            args, kwargs = self._arg(args, env), self._arg(kwargs, env)
            if getattr(func, "__name__", "") in _CASTS:
                func, args, kwargs = self._cast_back(func, args, kwargs, x.dtype)
            out = func(*args, **kwargs)
            for v, t in zip(outputs, _tensors(out, []), strict=False):
                env[v] = t
        return env[self.y]
