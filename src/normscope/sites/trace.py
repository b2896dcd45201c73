"""One forward of a model, recorded as dataflow.

Every torch function the forward calls (seen through a ``TorchFunctionMode``) becomes an :class:`Op` that
reads and writes *values*; a value is one version of one tensor object (an in-place op makes a new version
of the same object). Module calls are seen through process-wide forward hooks (nothing is registered on the
model itself) and become :class:`ModuleCall` records with their input and output values. For the calls that
could be norm sites — one tensor in, a tensor of the same shape out — and for functional norm calls, the
activations are copied at the time of the call, before anything can overwrite them in place.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Ops that mix features, tokens or channels: what a sublayer does and a normalization never does.
MIXING = frozenset({
    "linear", "bilinear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv",
    "mv", "einsum", "tensordot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention", "multi_head_attention_forward", "_convolution",
    # pooling over neighbouring positions mixes tokens too (PoolFormer's and EfficientFormer's token mixer,
    # pool(x) − x, has no other mixing op)
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "lp_pool1d", "lp_pool2d", "lp_pool3d",
})
ADDS = frozenset({"add", "__add__", "__radd__", "__iadd__", "add_"})
# Ops that keep the values (layout, dtype, evaluation-mode dropout): a value seen through them is the same value.
TRANSPARENT = frozenset({
    "view", "reshape", "view_as", "reshape_as", "contiguous", "to", "type", "type_as", "float", "double", "half",
    "bfloat16", "clone", "detach", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "dropout",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "identity",
})
SCALINGS = frozenset({"mul", "__mul__", "__rmul__"})  # x·c: a residual stream scaled before its add (DeepNorm)
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "softmin"})
EMBEDDING = frozenset({"embedding", "embedding_bag"})

# The functional normalizations, with their positional parameter names.
NORM_FUNCTIONS: dict[Any, tuple[str, tuple[str, ...]]] = {
    F.layer_norm: ("layer_norm", ("input", "normalized_shape", "weight", "bias", "eps")),
    F.group_norm: ("group_norm", ("input", "num_groups", "weight", "bias", "eps")),
    F.batch_norm: ("batch_norm", ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
                                  "eps")),
    F.instance_norm: ("instance_norm", ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats",
                                        "momentum", "eps")),
    torch.layer_norm: ("layer_norm", ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")),
    torch.group_norm: ("group_norm", ("input", "num_groups", "weight", "bias", "eps", "cudnn_enabled")),
}
if hasattr(F, "rms_norm"):
    NORM_FUNCTIONS[F.rms_norm] = ("rms_norm", ("input", "normalized_shape", "weight", "eps"))
if hasattr(torch, "rms_norm"):
    NORM_FUNCTIONS[torch.rms_norm] = ("rms_norm", ("input", "normalized_shape", "weight", "eps"))


@dataclasses.dataclass
class Value:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    producer: int | None  # the op that wrote it; None for inputs, parameters and tensors made elsewhere
    param: bool  # a parameter or buffer of the model


@dataclasses.dataclass
class Op:
    index: int
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    call: int | None  # the innermost module call running it
    mixing: bool
    tensor_args: int  # how many tensor arguments the op had (before flattening lists)
    norm: dict[str, Any] | None = None  # functional normalizations: the bound arguments (tensors copied)
    scalar: float | None = None  # a product of one tensor and a Python number: the number (DeepNorm's α·x)
    # (func, args, kwargs, {id(tensor argument): its value}) as called; None for an op written in place (no replay)
    raw: tuple | None = dataclasses.field(default=None, repr=False)
    _template: tuple | None = dataclasses.field(default=None, repr=False)

    @property
    def template(self) -> tuple | None:
        """(func, args, kwargs) with each tensor argument a :class:`Ref` to its value: a replay (made when first
        asked, until :meth:`Trace.release`: an inline site's few ops are replayed, a forward's thousands are not)."""
        if self._template is None and self.raw is not None:
            func, args, kwargs, ids = self.raw
            try:
                self._template = (func, _template(args, ids), _template(kwargs, ids))
            except KeyError:  # a list or dict argument the forward has filled since: no longer the call it was
                self.raw = None
        return self._template


@dataclasses.dataclass
class ModuleCall:
    index: int
    path: str
    module: Any
    number: int  # the how-many-th call of this module (0 for the first)
    parent: int | None
    depth: int
    first_op: int
    last_op: int = -1
    input: int | None = None  # the value of the only positional tensor argument, when there is exactly one
    inputs: tuple[int, ...] = ()  # the values of the positional tensor arguments, in order
    kw_inputs: dict[str, int] = dataclasses.field(default_factory=dict)  # the tensor keyword arguments' values
    output: int | None = None  # the value of the output, when it is one tensor
    tensor_args: int = 0
    tensor_kwargs: int = 0
    mixing: bool = False  # a mixing op ran inside this call (or inside a call it made)
    x: torch.Tensor | None = None  # copies of input and output for calls shaped like a normalization
    y: torch.Tensor | None = None
    #: a large call shaped like a normalization judged by behaviour when it returned, and found no normalization:
    #: what that judgement measured (its copies are not kept)
    judged: float | None = None


@dataclasses.dataclass(frozen=True)
class Ref:
    """A tensor argument of a recorded op, by the value it held."""

    value: int


def _template(obj, values: dict[int, int], depth: int = 0):
    """``obj`` with each tensor replaced by its :class:`Ref` (the same nesting :func:`_tensors` reads)."""
    if isinstance(obj, torch.Tensor):
        return Ref(values[id(obj)])
    if depth < 2 and isinstance(obj, list | tuple):
        return type(obj)(_template(o, values, depth + 1) for o in obj)
    if depth < 2 and isinstance(obj, dict):
        return {k: _template(v, values, depth + 1) for k, v in obj.items()}
    return obj


def _tensors(obj, out: list, depth: int = 0) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 2 and isinstance(obj, _SEQUENCES):
        for o in obj:
            _tensors(o, out, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out, depth + 1)
    return out


#: calls that read a property or a Python value: no dataflow
_UNRECORDED = frozenset({"__get__", "__set__", "__bool__", "__len__", "__repr__", "__format__", "dim", "size", "numel",
                         "is_floating_point", "__hash__", "item", "tolist"})
_SEQUENCES = (list, tuple)
_OUTPUTS = (torch.Tensor, list, tuple)


def _in_place(name: str) -> bool:
    if name.startswith("__i") and name.endswith("__"):
        return True
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


#: ops a tensor stays held after its last use: an inline norm's statistics, and its output, lie within this many ops
#: of its square root
HELD_OPS = 64
#: …or fewer, down to :data:`RECENT_OPS`, while the tensors held beyond the forward's use exceed this (bytes): a
#: convolutional decoder at audio length makes a 30 MiB tensor at almost every op
HELD_BYTES = 64 << 20
RECENT_OPS = 8
#: calls shaped like a normalization whose input is at least this large (bytes) are judged when they return
JUDGED_BYTES = 1 << 20
#: ops after a square root whose values are held to the end: the normalized output, scaled and shifted
AFTER_ROOT = 16
#: tensors whose memory is this small (bytes) are held to the end whatever their age (constants and scalars)
SMALL = 16384
#: producer steps walked back from a square root to the values its statistics read
WALK = 32


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _small(t: torch.Tensor) -> bool:
    """Whether ``t`` holds little memory: a view of a large tensor holds all of it."""
    try:
        return t.untyped_storage().nbytes() <= SMALL
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (a subclass)
        return t.numel() * t.element_size() <= SMALL


class Trace:
    """The record of one forward: values, ops and module calls, in execution order.

    A tensor's value is held while the forward uses it and for :data:`HELD_OPS` ops after; then only while the
    forward itself keeps the tensor (a weak reference), so the trace costs the memory of the forward's own tensors,
    not of every tensor it made. What an inline normalization needs afterwards is held to the end: at each square
    root, the values its statistics were computed from (walked back through their producers, up to the first op
    that mixes features or positions) and what the next
    :data:`AFTER_ROOT` ops read and write, with the replays of the ops around it; so are small tensors and
    parameters.
    """

    def __init__(self, model: torch.nn.Module, judge: Callable[[ModuleCall], float | None] | None = None):
        self.judge = judge  # see record()
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.param_ids = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self.calls: list[ModuleCall] = []
        self._current: dict[int, int] = {}  # id(tensor) → current value, while the tensor lives
        self._refs: dict[int, weakref.ref] = {}  # id(tensor) → a weak reference whose death frees the id
        self._held: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()  # by last use
        self._held_bytes = 0
        self._used: dict[int, int] = {}  # value → the op count at its last use
        self._kept: dict[int, torch.Tensor] = {}  # values held to the end (until release)
        self._weak: dict[int, weakref.ref] = {}  # values no longer held: their tensors while the forward keeps them
        self._replays: collections.deque[Op] = collections.deque()  # recent ops whose arguments are still held
        self._keep_until = -1  # ops up to this count keep what they read and write, and their replays
        self._stack: list[int] = []
        self._numbers: dict[int, int] = {}
        self.paused = False

    # ------------------------------------------------------------------ values
    def value(self, t: torch.Tensor, producer: int | None = None, new: bool = False) -> int:
        key = id(t)
        if not new and key in self._current:
            v = self._current[key]
            self._hold(v, t)
            return v
        v = Value(len(self.values), tuple(t.shape), t.dtype, producer, key in self.param_ids)
        self.values.append(v)
        if key not in self._refs:
            self._refs[key] = weakref.ref(t, self._forget(key))
        self._current[key] = v.index
        self._hold(v.index, t)
        return v.index

    def _forget(self, key: int):
        def dead(_ref) -> None:  # the id may now be reused by another tensor: it no longer names this one's value
            self._current.pop(key, None)
            self._refs.pop(key, None)
        return dead

    def _hold(self, v: int, t: torch.Tensor) -> None:
        if v in self._kept:
            return
        if len(self.ops) <= self._keep_until or _small(t) or self.values[v].param:
            self._keep(v, t)
            return
        if v in self._held:
            self._held.move_to_end(v)
        else:
            self._held[v] = t
            self._held_bytes += _bytes(t)
        self._used[v] = len(self.ops)
        self._weak.pop(v, None)

    def _keep(self, v: int, t: torch.Tensor) -> None:
        """Hold ``v``'s tensor to the end."""
        self._kept[v] = t
        if self._held.pop(v, None) is not None:
            self._held_bytes -= _bytes(t)

    def _held_tensor(self, v: int) -> torch.Tensor | None:
        t = self._kept.get(v)
        if t is None:
            t = self._held.get(v)
        if t is None and v in self._weak:
            t = self._weak[v]()
        return t

    def _age(self) -> None:
        """Let go of the values no op has used for :data:`HELD_OPS` ops (fewer while they hold more than
        :data:`HELD_BYTES`), and of the arguments of ops as old."""
        limit, recent = len(self.ops) - HELD_OPS, len(self.ops) - RECENT_OPS
        while self._held:
            v, t = next(iter(self._held.items()))
            if self._used[v] > limit:
                if self._held_bytes <= HELD_BYTES or self._used[v] > recent:
                    break
                limit = self._used[v]
            del self._held[v]
            self._held_bytes -= _bytes(t)
            self._weak[v] = weakref.ref(t)
        while self._replays and self._replays[0].index < limit:
            self._replays.popleft().raw = None

    def _keep_around(self, op: Op) -> None:
        """A square root: hold to the end the values its statistics were computed from, the replays of the ops
        before it that still have their arguments, and what the next :data:`AFTER_ROOT` ops read and write."""
        for recent in self._replays:
            _ = recent.template  # made now, from arguments still held
        seen: set[int] = set()
        frontier = list(op.inputs)
        for _ in range(WALK):
            nxt = []
            for v in frontier:
                if v in seen:
                    continue
                seen.add(v)
                t = self._held_tensor(v)
                if t is not None:
                    self._keep(v, t)
                producer = self.values[v].producer
                if producer is not None and not self.ops[producer].mixing:  # statistics mix nothing
                    nxt.extend(self.ops[producer].inputs)
            frontier = nxt
            if not frontier:
                break
        self._keep_until = len(self.ops) + AFTER_ROOT

    # ------------------------------------------------------------------ module hooks
    def pre_hook(self, module, args):
        if self.paused or id(module) not in self.paths:
            return None
        self.paused = True
        try:
            n = self._numbers.get(id(module), 0)
            self._numbers[id(module)] = n + 1
            parent = self._stack[-1] if self._stack else None
            c = ModuleCall(len(self.calls), self.paths[id(module)], module, n, parent, len(self._stack),
                           first_op=len(self.ops))
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            c.tensor_args = len(tensors)
            c.inputs = tuple(self.value(t) for t in tensors)
            if len(tensors) == 1 and len(args) >= 1 and isinstance(args[0], torch.Tensor):
                c.input = self.value(args[0])
                c.x = args[0].detach().clone()
            self.calls.append(c)
            self._stack.append(c.index)
        finally:
            self.paused = False
        return None

    def post_hook(self, module, args, kwargs, output=None):
        if self.paused or id(module) not in self.paths or not self._stack:
            return None
        c = self.calls[self._stack[-1]]
        if c.module is not module:
            return None
        self._stack.pop()
        self.paused = True
        try:
            c.last_op = len(self.ops) - 1
            c.tensor_kwargs = len(_tensors(kwargs, []))
            c.kw_inputs = {k: self.value(v) for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor)}
            if isinstance(output, torch.Tensor):
                c.output = self.value(output)
                if (c.x is not None and not c.mixing and c.tensor_kwargs == 0 and c.output != c.input
                        and tuple(output.shape) == tuple(c.x.shape) and output.is_floating_point()):
                    if self._judged_none(c):  # judged before its output is copied: one copy fewer at a time
                        c.x = None
                    else:
                        c.y = output.detach().clone()
                else:
                    c.x = None
            else:
                c.x = None
        finally:
            self.paused = False
        return None

    def _judged_none(self, c: ModuleCall) -> bool:
        """Whether a large call shaped like a normalization, with values, is judged now (see :func:`record`) to be
        none (what the judgement measured goes in ``c.judged``)."""
        if self.judge is None or c.x.is_meta or _bytes(c.x) < JUDGED_BYTES:
            return False
        c.judged = self.judge(c)
        return c.judged is not None

    # ------------------------------------------------------------------ torch functions
    def record(self, func, args, kwargs):
        name = getattr(func, "__name__", "") or ""
        if self.paused or name in _UNRECORDED:
            return func(*args, **kwargs)
        self.paused = True
        try:
            ins = _tensors(args, []) + _tensors(kwargs, [])
            in_values = tuple(self.value(t) for t in ins)
            norm = None
            if func in NORM_FUNCTIONS:
                fname, names = NORM_FUNCTIONS[func]
                bound = dict(zip(names, args, strict=False))
                bound.update(kwargs)
                norm = {"function": fname,
                        "args": {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in bound.items()}}
        finally:
            self.paused = False
        out = func(*args, **kwargs)
        self.paused = True
        try:
            outs = _tensors(out, []) if isinstance(out, _OUTPUTS) else []
            in_place = _in_place(name) and bool(args) and isinstance(args[0], torch.Tensor)
            if not outs and not in_place:
                return out
            op = Op(len(self.ops), name, in_values, (), self._stack[-1] if self._stack else None, name in MIXING,
                    sum(isinstance(a, torch.Tensor) for a in args) + sum(isinstance(a, torch.Tensor)
                                                                         for a in kwargs.values()), norm)
            if not in_place:
                ids = {id(t): v for t, v in zip(ins, in_values, strict=True)}
                op.raw = (func, args, kwargs, ids)
            written = []
            if in_place:
                written.append(self.value(args[0], op.index, new=True))
            ids_in = {id(t) for t in ins}
            for t in outs:
                if in_place and t is args[0]:
                    continue
                if id(t) in ids_in:  # an op that returned its input (no-op .to(), eval dropout): the same value
                    continue
                written.append(self.value(t, op.index, new=True))
            op.outputs = tuple(written)
            if norm is not None and isinstance(out, torch.Tensor):
                norm["y"] = out.detach().clone()
            if name in SCALINGS and len(ins) == 1:
                numbers = [a for a in (*args, *kwargs.values()) if isinstance(a, int | float) and not isinstance(a, bool)]
                if len(numbers) == 1:
                    op.scalar = float(numbers[0])
            self.ops.append(op)
            if op.raw is not None:
                if len(self.ops) <= self._keep_until:
                    _ = op.template  # replayable to the end
                self._replays.append(op)
            if name in ("rsqrt", "sqrt"):
                self._keep_around(op)
            self._age()
            if op.mixing:
                for ci in self._stack:
                    self.calls[ci].mixing = True
            return out
        finally:
            self.paused = False

    def ancestors(self, call: int | None) -> set[int]:
        """A module call and every call it runs inside (empty for None: outside every module)."""
        out = set()
        while call is not None:
            out.add(call)
            call = self.calls[call].parent
        return out

    def tensor(self, v: int) -> torch.Tensor | None:
        """The tensor that held value ``v``, while it still holds it (not written in place since) and until
        :meth:`release`; None otherwise."""
        t = self._held_tensor(v)
        return t if t is not None and self._current.get(id(t)) == v else None

    def release(self) -> None:
        """Drop the references that kept the forward's tensors alive (the copies of norm-shaped calls stay, and the
        replay templates already made; the others are no longer made)."""
        self._current.clear()
        self._refs.clear()
        self._held.clear()
        self._held_bytes = 0
        self._kept.clear()
        self._weak.clear()
        self._replays.clear()
        for op in self.ops:
            op.raw = None


class _Mode(TorchFunctionMode):
    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.trace.record(func, args, kwargs or {})


def record(model: torch.nn.Module, call, judge: Callable[[ModuleCall], float | None] | None = None
           ) -> tuple[Trace, Any]:
    """Run ``call()`` (one forward of ``model``) under the recorder; returns the trace and the output. ``judge``
    (the test by behaviour: what it measured where a call is no normalization, None where it is one or cannot
    tell) is asked of each call of at least :data:`JUDGED_BYTES` shaped like a normalization when it returns: the
    copies of its input and output are kept only where it answers None (a decoder at audio length has dozens of
    activations shaped like a norm, 30 MiB each)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    trace = Trace(model, judge)
    handles = [register_module_forward_pre_hook(trace.pre_hook),
               register_module_forward_hook(trace.post_hook, with_kwargs=True, always_call=True)]
    try:
        with _Mode(trace):
            out = call()
    except BaseException:
        # the traceback keeps this frame, and with it the trace, while the caller handles the failure (often by
        # running the forward again): what it held is let go now
        trace.release()
        trace.calls.clear()
        trace.ops.clear()
        raise
    finally:
        for h in handles:
            h.remove()
        trace.paused = False
    return trace, out
