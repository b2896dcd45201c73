"""Roles and placements from the dataflow of one recorded forward — never from names.

Three ancestor sets per value, as bitsets over value indices: ``anc`` (every value it was computed from),
``anc_t`` (those reached without crossing a mixing op: linear, matmul, convolution, attention) and ``anc_m``
(those reached through at least one mixing op).

A *residual add* is ``o = s + f`` of two activations of the same shape where the stream ``s`` reaches the
branch ``f`` through a mixing op (``s ∈ anc_m(f)``: the branch is a sublayer applied to the stream), or where
``s`` is itself a residual sum whose own stream reaches ``f`` that way (``(x + attn(x)) + mlp(x)``, the
parallel form). The stream may be scaled by a constant before the add (``α·x + f(x)``, DeepNorm): the stream is
then ``x`` and the add records its scale α. Then, for a norm with input x and output y:

- ``qk``: y reaches the query or key operand of attention (scaled_dot_product_attention, or a matmul whose
  product feeds a softmax) without a mixing op in between;
- the first residual add whose branch depends on y but whose stream does not is the norm's *update*:
  ``branch`` when y reaches that branch without a mixing op (and x came from the stream through one);
  ``pre`` when y reaches it through a sublayer and x is the stream the result is added onto;
- ``embedding``: x comes from an embedding lookup with no mixing op before it;
- ``post``: x is a residual sum and y becomes the stream of a later residual add (or ends a block);
- ``final``: outside the blocks, after the residual adds, and not added back to any stream;
- ``weight``: x is a parameter (through layout ops): weight standardization (BiT's convolutions), not an
  activation's norm;
- ``other``: anything else (a norm inside a sublayer, on values, …).

A model may carry several residual *streams* (an encoder's and a decoder's, a vision tower's and a text
tower's): an add continues the stream of an earlier add when its stream value was computed from that add's sum
without a mixing op (a post norm on the way included); a decoder reads the encoder's output only through mixing
ops (cross-attention's key and value projections), so it starts a stream of its own. A norm belongs to the
stream it reads from (or, for an embedding norm, the one its output starts) and its role is judged against that
stream's adds only: an encoder's norms are not judged through the decoder's cross-attention.

Blocks are the repeated elements of a ``ModuleList``/``Sequential`` that run residual adds; a block is
``parallel`` when two of its sublayer outputs read the same stream value, else its updates are classified
``pre`` (pre norm only), ``reordered`` (branch norm only), ``sandwich`` (both), ``post`` (a norm on the sum),
``deepnorm`` (a norm on the sum of a stream scaled by α ≠ 1), ``none`` (no norm), and a block whose updates
differ is ``mixed``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .classes import holds_norm
from .trace import ADDS, EMBEDDING, SCALINGS, SOFTMAX, TRANSPARENT, Trace

ROLES = ("pre", "post", "branch", "qk", "final", "embedding", "weight", "other")
PLACEMENTS = ("pre", "post", "sandwich", "reordered", "deepnorm", "parallel", "mixed", "none")
_ATTENTION_MATMULS = frozenset({"matmul", "__matmul__", "bmm", "einsum", "baddbmm"})


@dataclasses.dataclass
class Residual:
    op: int
    stream: int
    branch: int
    out: int
    chained: bool  # the branch reads an earlier stream of the chain, not this add's stream (parallel form)
    call: int | None
    block: int | None = None  # the block call it runs in
    scale: float = 1.0  # the constant the stream was multiplied by before the add (DeepNorm's α)
    family: int = 0  # the residual stream the add belongs to (0, 1, … in order of each stream's first add)
    source: int | None = None  # a projection shortcut's block input, which both operands are computed from

    @property
    def origin(self) -> int:
        """The value the branch was computed from: the stream itself, or the block input a projection shortcut
        and its branch both read."""
        return self.stream if self.source is None else self.source


@dataclasses.dataclass
class Role:
    role: str
    why: str
    update: int | None = None  # index into Dataflow.residuals of the add the norm's output feeds
    after: int | None = None  # index of the residual add whose sum is the norm's input (post)


def block_modules(model: torch.nn.Module) -> dict[int, int]:
    """id(module) → index, for the repeated elements of ModuleLists and Sequentials (candidate blocks), and in such
    a list an element of a class of its own that holds a normalization as every repeated one does: a hybrid's
    layers of two kinds, one of them once (Jamba's one attention layer among its state-space layers)."""
    out: dict[int, int] = {}
    for container in model.modules():
        if not isinstance(container, torch.nn.ModuleList | torch.nn.Sequential):
            continue
        # a list of lists (Funnel's blocks of layers) is never called itself: the inner lists' elements are the
        # candidates, numbered in order across them
        kids = []
        for n, m in container.named_children():
            if not n.isdigit():
                continue
            if isinstance(m, torch.nn.ModuleList):
                kids += [m2 for n2, m2 in m.named_children() if n2.isdigit()]
            elif not isinstance(m, torch.nn.ModuleDict):
                kids.append(m)
        classes: dict[type, int] = {}
        for m in kids:
            classes[type(m)] = classes.get(type(m), 0) + 1
        repeated = [m for m in kids if classes[type(m)] >= 2]
        # a class seen once joins only where every repeated element holds a norm (asked only when there is one)
        normed = bool(repeated) and len(repeated) < len(kids) and all(holds_norm(m) for m in repeated)
        for i, m in enumerate(kids):
            if classes[type(m)] >= 2 or (normed and holds_norm(m)):
                out.setdefault(id(m), i)
    return out


class Dataflow:
    def __init__(self, trace: Trace, blocks: dict[int, int]):
        self.t = trace
        n = len(trace.values)
        anc, anc_t, anc_m = [0] * n, [0] * n, [0] * n
        for v in trace.values:
            if v.producer is None:
                anc[v.index] = anc_t[v.index] = 1 << v.index
        for op in trace.ops:
            a = at = am = 0
            for i in op.inputs:
                a |= anc[i]
                at |= anc_t[i]
                am |= anc_m[i]
            for o in op.outputs:
                bit = 1 << o
                anc[o] = a | bit
                if op.mixing:
                    anc_m[o], anc_t[o] = a, bit
                else:
                    anc_m[o], anc_t[o] = am, at | bit
        self.anc, self.anc_t, self.anc_m = anc, anc_t, anc_m
        self.embedding_bits = 0
        for op in trace.ops:
            if op.name in EMBEDDING:
                for o in op.outputs:
                    self.embedding_bits |= 1 << o
        self._blocks(blocks)
        self._residuals()
        self._qk()

    # ------------------------------------------------------------------ structure
    def _blocks(self, blocks: dict[int, int]) -> None:
        """Block calls: the repeated elements of containers (layer = index in the container) and the calls of a
        module that runs more than once in the forward, a block shared across depths as ALBERT's (layer = the
        call's order among the calls of its class's repeated modules; the outermost such module is the block)."""
        calls = self.t.calls
        times: dict[int, int] = {}
        for c in calls:
            times[id(c.module)] = times.get(id(c.module), 0) + 1
        shared = {key for key, n in times.items() if n >= 2}
        self.call_block: list[int | None] = []
        self.block_index: dict[int, int] = {}
        depth: dict[type, int] = {}
        in_shared: list[bool] = []  # the call runs inside a shared block's call (its parts are not blocks)
        for c in calls:
            key = id(c.module)
            inside = c.parent is not None and in_shared[c.parent]
            is_shared = key in shared and not inside and any(True for _ in c.module.children())
            in_shared.append(inside or is_shared)
            if is_shared:
                self.call_block.append(c.index)
                self.block_index[c.index] = depth.get(type(c.module), 0)
                depth[type(c.module)] = self.block_index[c.index] + 1
            elif key in blocks:
                self.call_block.append(c.index)
                self.block_index[c.index] = blocks[key]
            else:
                self.call_block.append(self.call_block[c.parent] if c.parent is not None else None)

    def activation(self, v: int) -> bool:
        return not self.t.values[v].param

    def base(self, v: int) -> int:
        """Follow layout, dtype and evaluation-dropout ops back to the value they carry."""
        seen = 0
        while seen < 64:
            p = self.t.values[v].producer
            if p is None:
                return v
            op = self.t.ops[p]
            acts = [i for i in op.inputs if self.activation(i)]
            if op.name not in TRANSPARENT or len(acts) != 1:
                return v
            v = acts[0]
            seen += 1
        return v

    def _same_shape_pair(self, op) -> tuple[int, int] | None:
        if op.name not in ADDS or len(op.inputs) != 2 or len(op.outputs) != 1:
            return None
        a, b = op.inputs
        vals = self.t.values
        if not (self.activation(a) and self.activation(b)):
            return None
        if not (vals[a].shape == vals[b].shape == vals[op.outputs[0]].shape):
            return None
        return a, b

    def unscaled(self, v: int) -> tuple[int, float]:
        """``x`` and ``c`` when ``v = x·c`` for a Python number ``c``, or for a parameter (a learned scale of the
        stream: Doge's ``input_residual * residual + h``; ``c`` is then the parameter's mean, 1 on the meta device);
        else ``v`` and 1."""
        p = self.t.values[v].producer
        if p is not None:
            op = self.t.ops[p]
            acts = [i for i in op.inputs if self.activation(i)]
            if op.name in SCALINGS and op.scalar is not None and len(acts) == 1:
                return acts[0], op.scalar
            params = [i for i in op.inputs if not self.activation(i)]
            if op.name in SCALINGS and len(acts) == 1 and len(params) == 1:
                t = self.t.tensor(params[0])
                known = t is not None and t.numel() and t.device.type != "meta"  # on meta: shapes, no values
                return acts[0], float(t.detach().float().mean()) if known else 1.0
        return v, 1.0

    def _residuals(self) -> None:
        self.residuals: list[Residual] = []
        by_out: dict[int, Residual] = {}
        for op in self.t.ops:
            pair = self._same_shape_pair(op)
            if pair is None:
                continue
            found = None
            scale = 1.0
            for s, f in (pair, pair[::-1]):
                if self.anc_m[f] >> s & 1:
                    found = (s, f, False)
                    break
                x, c = self.unscaled(s)
                if x != s and self.anc_m[f] >> x & 1:
                    found, scale = (x, f, False), c
                    break
            if found is None:
                for s, f in (pair, pair[::-1]):
                    if any(self.anc_m[f] >> c & 1 for c in self.chain(s, by_out)[1:]):
                        found = (s, f, True)
                        break
            if found is None:
                continue
            r = Residual(op.index, found[0], found[1], op.outputs[0], found[2], op.call, scale=scale)
            r.block = self._block_of_call(op.call)
            self.residuals.append(r)
            by_out[r.out] = r
        for r in self._projection_residuals():
            self.residuals.append(r)
            by_out[r.out] = r
        self.residuals.sort(key=lambda r: r.op)
        self.by_out = by_out
        self._families()
        self.stream_bits = 0
        for r in self.residuals:
            self.stream_bits |= (1 << r.origin) | (1 << r.stream) | (1 << r.out)
        # a repeated element that runs no residual add is not a block (e.g. a ModuleList of norms)
        self.blocks_with_adds = {r.block for r in self.residuals if r.block is not None}

    def _projection_residuals(self) -> list[Residual]:
        """In each block that adds none of the residual adds above onto its input, the last other add of two tensors
        computed from the block's input along separate paths, each through a mixing op, neither from the other: a
        block whose shortcut is a projection (ResNet's first block of a stage, conv + BatchNorm beside its branch;
        Hiera's proj(norm(x)) + attn(norm(x)), before its MLP's ordinary add). Its stream is the operand fewer ops
        away from the input."""
        adds = {r.op for r in self.residuals}
        onto = {(r.block, self.base(r.origin)) for r in self.residuals}  # (block, the value it adds onto)
        out = []
        for c in self.t.calls:
            if self.call_block[c.index] != c.index or not c.inputs or c.last_op < c.first_op:
                continue
            x = c.inputs[0]
            if not self.activation(x) or (c.index, self.base(x)) in onto:
                continue
            found = None
            for op in self.t.ops[c.first_op:c.last_op + 1]:
                pair = self._same_shape_pair(op)
                if pair is None or op.index in adds or self._block_of_call(op.call) != c.index:
                    continue
                a, b = pair
                if (self.anc_m[a] >> x & 1 and self.anc_m[b] >> x & 1
                        and not self.anc[a] >> b & 1 and not self.anc[b] >> a & 1):
                    found = (op, a, b)
            if found is None:
                continue
            op, a, b = found
            steps = self._steps_from(x, c.first_op, op.index)
            s, f = (a, b) if steps.get(a, 0) <= steps.get(b, 0) else (b, a)
            out.append(Residual(op.index, s, f, op.outputs[0], False, op.call, block=c.index, source=x))
        return out

    def _steps_from(self, x: int, first: int, last: int) -> dict[int, int]:
        """The longest chain of ops from value ``x`` to each value computed from it in ops ``first`` … ``last``."""
        steps = {x: 0}
        for op in self.t.ops[first:last]:
            d = max((steps[i] for i in op.inputs if i in steps), default=None)
            if d is not None:
                for o in op.outputs:
                    steps[o] = d + 1
        return steps

    def _families(self) -> None:
        """Each add's stream: that of the latest earlier add whose sum its stream value was computed from without
        a mixing op, else a new one."""
        count = 0
        for k, r in enumerate(self.residuals):
            earlier = next((p for p in reversed(self.residuals[:k]) if self.anc_t[r.origin] >> p.out & 1), None)
            if earlier is None:
                r.family, count = count, count + 1
            else:
                r.family = earlier.family
        self.families = count

    def family_of(self, x: int, y: int) -> int | None:
        """The stream a norm belongs to: the latest one its input was read from without a mixing op (pre, post,
        final), else the one its output enters without a mixing op (an embedding norm, a branch norm); None
        when neither (queries and keys, a norm inside a sublayer)."""
        read = [r for r in self.residuals if self.anc_t[x] >> r.out & 1 or self.anc_t[x] >> r.origin & 1]
        if read:
            return read[-1].family
        enters = next((r for r in self.residuals
                       if self.anc_t[r.stream] >> y & 1 or self.anc_t[r.branch] >> y & 1), None)
        return None if enters is None else enters.family

    def _block_of_call(self, call: int | None) -> int | None:
        return None if call is None else self.call_block[call]

    def block_of(self, call: int | None) -> int | None:
        """The block call a module call runs in, counting only blocks that run residual adds."""
        c = call
        while c is not None:
            b = self.call_block[c]
            if b is None:
                return None
            if b in self.blocks_with_adds:
                return b
            c = self.t.calls[b].parent
        return None

    def stream_of(self, x: int, y: int, call: int | None) -> int | None:
        """The residual stream a site belongs to: that of the block it runs in, else the one it reads or
        enters (:meth:`family_of`)."""
        b = self.block_of(call)
        if b is not None:
            family = next((r.family for r in self.residuals if r.block == b), None)
            if family is not None:
                return family
        return self.family_of(x, y)

    def layer(self, call: int | None) -> int | None:
        b = self.block_of(call)
        return None if b is None else self.block_index[b]

    def chain(self, s: int, by_out: dict[int, Residual] | None = None, depth: int = 4) -> list[int]:
        """s, then the streams of the residual sums it is made of (through parallel-form adds)."""
        by_out = self.by_out if by_out is None else by_out
        out = [s]
        while depth > 0 and s in by_out:
            s = by_out[s].stream
            out.append(s)
            depth -= 1
        return out

    def _qk(self) -> None:
        self.qk_operands: list[tuple[int, int]] = []  # (operand value, op index)
        ops = self.t.ops
        softmax_inputs = [i for op in ops if op.name in SOFTMAX for i in op.inputs[:1]]
        for op in ops:
            if op.name == "scaled_dot_product_attention":
                self.qk_operands += [(v, op.index) for v in op.inputs[:2]]
            elif op.name in _ATTENTION_MATMULS and op.outputs:
                o = op.outputs[0]
                if any(self.anc_t[v] >> o & 1 for v in softmax_inputs):
                    self.qk_operands += [(v, op.index) for v in op.inputs if self.activation(v)]

    # ------------------------------------------------------------------ roles
    def _where(self, op_index: int) -> str:
        call = self.t.ops[op_index].call
        path = self.t.calls[call].path if call is not None else ""
        return f"op #{op_index} ({self.t.ops[op_index].name}) in {path or 'the model forward'}"

    def _of_parameter(self, v: int) -> bool:
        """Whether ``v`` is a parameter, or one seen through layout ops (a kernel reshaped to rows)."""
        for _ in range(64):
            if self.t.values[v].param:
                return True
            p = self.t.values[v].producer
            if p is None or self.t.ops[p].name not in TRANSPARENT or len(self.t.ops[p].inputs) != 1:
                return False
            v = self.t.ops[p].inputs[0]
        return False

    def role(self, x: int, y: int, call: int | None) -> Role:
        ybit = 1 << y
        if self._of_parameter(x):
            return Role("weight", "the input is a parameter (seen through layout ops only): the norm standardizes "
                                  "weights, not activations")
        for v, op in self.qk_operands:
            if self.anc_t[v] & ybit:
                return Role("qk", f"the output reaches the query/key operand of {self._where(op)} "
                                  "without a mixing op in between")
        family = self.family_of(x, y)
        own = [(k, r) for k, r in enumerate(self.residuals) if family is None or r.family == family]
        for k, r in own:
            if not (self.anc[r.branch] & ybit):
                continue
            # the stream does not depend on the norm, except a projection shortcut's that reads the block's
            # normalized input as its branch does (BiT's pre-activation, Hiera's proj(norm(x)) + attn(norm(x)))
            if self.anc[r.stream] & ybit and (r.source is None or self.base(x) != self.base(r.source)):
                continue
            if self.anc_t[r.branch] & ybit and self.anc_m[x] >> r.origin & 1:
                return Role("branch", f"the output is added onto the stream at {self._where(r.op)} with no mixing op "
                                      "in between; the input came from that stream through a sublayer", update=k)
            if self.anc_m[r.branch] & ybit:
                bases = {self.base(s) for s in self.chain(r.stream)} | {self.base(r.origin)}
                if self.base(x) in bases:
                    return Role("pre", f"the input is the stream that {self._where(r.op)} adds onto; the output "
                                       "reaches the added branch through a sublayer (mixing ops)", update=k)
                return Role("other", f"the output reaches the residual add at {self._where(r.op)} through mixing ops, "
                                     "but the input is not the stream: a norm inside a sublayer", update=k)
            break
        if not self.anc_m[x] and self.anc[x] & self.embedding_bits:
            return Role("embedding", "the input comes from an embedding lookup with no mixing op before it")
        sums = [k for k, r in own if self.anc_t[x] >> r.out & 1]
        reads_y = [k for k, r in own if (self.anc[r.stream] | self.anc[r.branch]) & ybit]
        if sums:
            k = sums[-1]
            becomes = [j for j in reads_y if self.anc_t[self.residuals[j].stream] & ybit]
            if becomes:
                return Role("post", f"the input is the residual sum of {self._where(self.residuals[k].op)}; the output "
                                    f"is the stream of {self._where(self.residuals[becomes[0]].op)}", after=k)
            if not reads_y and self.block_of(call) is not None:
                return Role("post", f"the input is the residual sum of {self._where(self.residuals[k].op)}; the output "
                                    "ends the block (no later residual add)", after=k)
        if self.block_of(call) is None and own and not reads_y:
            last = max((r for _, r in own if self.anc[x] >> r.out & 1), key=lambda r: r.op, default=None)
            if last is not None:
                return Role("final", f"after the last residual add ({self._where(last.op)}), outside the blocks; the "
                                     "output is not added back to any stream")
        return Role("other", "none of the residual patterns: not on the stream, a branch, queries/keys or embeddings")

    # ------------------------------------------------------------------ placement
    def terms(self, f: int, depth: int = 0) -> list[int]:
        """The sublayer outputs summed into a branch (``attn + mlp`` is two terms)."""
        p = self.t.values[f].producer
        if p is None or depth > 16:
            return [f]
        op = self.t.ops[p]
        pair = self._same_shape_pair(op)
        if pair is not None and op.index not in {r.op for r in self.residuals}:
            return self.terms(pair[0], depth + 1) + self.terms(pair[1], depth + 1)
        acts = [i for i in op.inputs if self.activation(i)]
        if op.name in TRANSPARENT and len(acts) == 1:
            return self.terms(acts[0], depth + 1)
        return [f]

    def read(self, v: int) -> int:
        """The latest stream value a value was computed from (-1 if none)."""
        return (self.anc[v] & self.stream_bits).bit_length() - 1

    def placements(self, site_roles: list[tuple[Role, int, int]]
                   ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        """The model's placement (its streams' one placement, else ``mixed``), one record per block and one per
        residual stream; ``site_roles`` holds (role, x, y) per site."""
        attached: dict[int, set[str]] = {k: set() for k in range(len(self.residuals))}
        for role, _x, _y in site_roles:
            if role.role in ("pre", "branch") and role.update is not None:
                attached[role.update].add(role.role)
            if role.role == "post" and role.after is not None:
                attached[role.after].add("post")
        by_block: dict[int | None, list[int]] = {}
        for k, r in enumerate(self.residuals):
            by_block.setdefault(r.block, []).append(k)
        records = []
        for block, updates in by_block.items():
            reads: dict[int, int] = {}
            readers: dict[int, set[int]] = {}  # stream value → the updates with a term that reads it
            for k in updates:
                for term in self.terms(self.residuals[k].branch):
                    rv = self.read(term)
                    reads[rv] = reads.get(rv, 0) + 1
                    readers.setdefault(rv, set()).add(k)
            kinds = [_update_kind(attached[k]) for k in updates]
            scales = [self.residuals[k].scale for k in updates]
            if set(kinds) == {"post"} and all(c != 1.0 for c in scales):
                kinds = ["deepnorm"] * len(kinds)  # post-norm over α·x + f(x)
            # parallel: sublayers that read one stream value and are added back together (GPT-J, NeoX, Phi: one
            # update with attn + mlp) or in adds of their own (each reads the value from before the other's add).
            # Terms of one update in a block with several (a shared-expert MoE: shared(n(h)) + routed(n(h)) after
            # the attention's add) are one sublayer's branch: that block is sequential
            parallel = any(n >= 2 and (len(updates) == 1 or len(readers[rv]) >= 2)
                           for rv, n in reads.items() if rv >= 0)
            if parallel:
                placement = "parallel"
            elif len(set(kinds)) == 1:
                placement = kinds[0]
            else:
                placement = "mixed"
            records.append({
                "block": self.t.calls[block].path if block is not None else None,
                "layer": self.block_index.get(block) if block is not None else None,
                "stream": self.residuals[updates[0]].family,
                "placement": placement,
                "updates": [{"op": self.residuals[k].op, "norms": sorted(attached[k]), "kind": kind,
                             "residual_scale": self.residuals[k].scale}
                            for k, kind in zip(updates, kinds, strict=True)],
                "sublayers_reading_one_stream": max(reads.values(), default=0),
            })
        streams = [self._stream_record(f, [r for r in records if r["stream"] == f]) for f in range(self.families)]
        placements = {s["placement"] for s in streams}
        if not records:
            overall = "none"
        elif len(placements) == 1:
            overall = placements.pop()
        else:
            overall = "mixed"
        return overall, records, streams

    def _stream_record(self, family: int, records: list[dict[str, Any]]) -> dict[str, Any]:
        """One stream: where its blocks live (their common path), how many, and its placement."""
        import os.path

        paths = [r["block"] for r in records if r["block"]]
        common = os.path.commonprefix([p + "." for p in paths]).rpartition(".")[0] if paths else ""
        blocks = [r for r in records if r["layer"] is not None]
        # an add outside the blocks (a positional convolution added before the layers: wav2vec2, HuBERT) is no block
        # of the stream: its placement is its blocks'
        kinds = {r["placement"] for r in blocks or records}
        return {"stream": family, "path": common or None, "blocks": len(blocks),
                "placement": kinds.pop() if len(kinds) == 1 else "mixed"}


def _update_kind(norms: set[str]) -> str:
    if norms == {"pre"}:
        return "pre"
    if norms == {"branch"}:
        return "reordered"
    if norms == {"pre", "branch"}:
        return "sandwich"
    if norms == {"post"}:
        return "post"
    if not norms:
        return "none"
    return "mixed"
