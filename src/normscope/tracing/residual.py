"""The residual stream through one forward's blocks, followed as the tracer sees the ops: a scope per block call
(and per nested element: a stage's residual block), whose adds of its current stream are its residual adds — the
branch a ``sublayer_output``, the sum a ``residual_sum`` and the stream from then on — with the views of the stream
(a reshape, a cast, a dropout) followed, two branches joined before they meet it (a parallel block), the token
mixers that are neither attention nor MLP, and, in a block whose shortcut is a projection, the add of two tensors
computed from its input along separate paths (:mod:`.lineage`). An identity test on each op, no graph capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .activations import ActivationBatch, writes_in_place
from .discovery import Layout
from .lineage import Lineage


class Stream:
    """The scopes of the forward in flight (innermost last) and what each has seen of its stream. Its probes run
    under the tracer's ``guard``; a failure disables the ``residual`` probe (``fail``), never the training."""

    def __init__(self, layout: Layout, activations: ActivationBatch, guard: Callable, fail: Callable,
                 disabled: set[str]):
        self.layout, self.activations, self.guard, self.fail, self.disabled = (layout, activations, guard, fail,
                                                                               disabled)
        self.scopes: list[dict[str, Any]] = []  # one per active block call
        self.plain: set[int] = set()  # blocks seen adding their own input (no projection shortcut to look for)
        self.counters: dict[tuple, int] = {}  # (layer, sublayer) → how many of its adds this forward has had

    def reset(self) -> None:
        """A new forward: no scope open, sublayer sites numbered from the first again."""
        self.scopes.clear()
        self.counters = {}

    def layer(self) -> int | None:
        """The layer of the innermost block call in flight (None outside the blocks)."""
        return self.scopes[-1]["layer"] if self.scopes else None

    def normalized(self, x, y) -> None:
        """A norm took ``x`` to ``y``: where ``x`` is the stream, ``y`` may be the stream the next add reads (a
        post-norm block normalizes its sum)."""
        if self.scopes and x is self.scopes[-1]["stream"]:
            self.scopes[-1]["alt"] = y

    def enter(self, module, args, kwargs) -> None:
        """A block's call, or a nested element's (a stage's residual block), opens a scope for the stream: the adds
        of its own input inside it are its residual adds, recorded under the block's layer (a nested element's
        with its name inside the block as their sites' prefix)."""
        nested = self.layout.nested.get(id(module))
        layer, prefix = (self.layout.blocks[id(module)], "") if nested is None else (nested[0], nested[1] + ".")
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        self.scopes.append({"layer": layer, "stream": x, "alt": None, "attn": False, "module": module,
                            "joined": [], "views": [], "prefix": prefix, "added": False, "mixer": False,
                            "lineage": Lineage(x) if isinstance(x, torch.Tensor) and id(module) not in self.plain
                            and "residual" not in self.disabled else None,
                            "tentative": None, "input": x, "projected": False})
        if nested is None and isinstance(x, torch.Tensor) and x.is_floating_point():
            self.activations.defer("layer_input", layer, "", x)

    def exit(self, module, output) -> None:
        """The end of a block's (or nested element's) call: a pending projection add settled, the scope closed."""
        if self.scopes and self.scopes[-1]["module"] is module:
            s = self.scopes[-1]
            out = output[0] if isinstance(output, tuple | list) and output else output
            if s["tentative"] is not None:
                self.guard("residual", self._settle, s, out)
            elif s["added"] and not s["projected"]:
                self.plain.add(id(module))  # adds its own input: no projection add to look for in it again
            self.scopes.pop()
            if self.scopes and self.scopes[-1]["lineage"] is not None:  # what the nested scope computed
                inner = s["lineage"].depth(out) if s["lineage"] is not None else None
                self.guard("residual", self.scopes[-1]["lineage"].inherit, s["input"], out, inner or 1)
            if self.scopes and s["prefix"] and not s["added"]:
                # not a residual block of its own (an attention head of a list of heads, an expert): what ran in
                # it belongs to the scope around it
                self.scopes[-1]["attn"] |= s["attn"]
                self.scopes[-1]["mixer"] |= s["mixer"]

    def follow(self, x, out: torch.Tensor) -> None:
        """``out`` is ``x`` seen through a reshape, a cast or a dropout: a stand-in for the stream, or a joined
        branch, when ``x`` is one (OPT flattens the stream to (B·T, H) before its MLP's add; Falcon drops out the
        joined attention + MLP branch before adding it)."""
        if "residual" in self.disabled:
            return
        try:  # not under the guard: a few identity checks on every such op of the forward, kept cheap
            s = self.scopes[-1]
            if self._is_stream(s, x):
                s["views"].append(out)
            elif any(x is j for j in s["joined"]):
                s["joined"].append(out)
            elif s["tentative"] is not None and self._is_stream(s["tentative"]["after"], x):
                s["tentative"]["after"]["views"].append(out)
        except Exception as exc:  # never break training
            self.fail("residual", exc)

    def mixing(self, name: str, args, kwargs) -> None:
        """A depthwise convolution along the sequence (one group per channel), or a shift of a (batch, sequence,
        channel) tensor along its sequence (``pad`` by (0, 0, k, -k): RWKV's token shift): a state-space, recurrent
        or convolutional token mixer, whose residual branch is then a ``mixer``, not an MLP."""
        if "residual" in self.disabled:
            return
        try:  # not under the guard, as follow: a few checks on every such op, kept cheap
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, torch.Tensor):
                return
            if name == "conv1d":
                groups = kwargs.get("groups", args[6] if len(args) > 6 else 1)
                mixes = x.dim() >= 2 and isinstance(groups, int) and 1 < groups == x.shape[-2]
            else:
                pad = kwargs.get("pad", args[1] if len(args) > 1 else ())
                mixes = (x.dim() == 3 and isinstance(pad, tuple | list) and len(pad) == 4 and pad[0] == pad[1] == 0
                         and pad[2] != 0 and pad[2] + pad[3] == 0)
            if mixes:
                self.scopes[-1]["mixer"] = True
        except Exception as exc:  # never break training
            self.fail("residual", exc)

    def _is_stream(self, s: dict, x) -> bool:
        return x is s["stream"] or x is s["alt"] or any(x is v for v in s["views"])

    def before_add(self, name: str, args) -> tuple | None:
        """Before an add: whether it is a residual add of the current stream (then the branch's statistics are
        deferred, and taken at once where the add writes into the branch: ResNet's ``out += shortcut``), or two
        branches joined before they meet the stream. What :meth:`after_add` completes, or None."""
        s = self.scopes[-1]
        if len(args) < 2:
            return None
        a, b = args[0], args[1]
        tentative = False
        pending = s["tentative"]
        if pending is not None:
            if self._is_stream(s, a) or self._is_stream(s, b):
                self._refute(s)  # an add of the scope's own input after all: the earlier add was not its residual add
            elif s["lineage"] is not None and any(self._is_stream(pending["after"], x) and s["lineage"].marked(y)
                                                  for x, y in ((a, b), (b, a))):
                self._confirm(s)  # the sum and a branch computed from it: it is the stream, its add the residual add
        if self._is_stream(s, a):
            stream, branch = a, b
        elif self._is_stream(s, b):
            stream, branch = b, a
        else:
            # two stream-shaped branches summed after attention, before either meets the stream: a parallel block
            # (GPT-J, GPT-NeoX, Phi: x + attn(ln x) + mlp(ln x)), whose residual branch then holds both sublayers
            attn = s["attn"] or (pending is not None and pending["attn"])
            if (attn and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and isinstance(s["stream"], torch.Tensor) and a.shape == b.shape == s["stream"].shape):
                return s, None
            depths = self._projection_add(s, a, b)
            if depths is None:
                return None
            branch, stream = (a, b) if depths[0] > depths[1] else (b, a)
            tentative = True
        if (not isinstance(branch, torch.Tensor) or not isinstance(stream, torch.Tensor)
                or branch.shape != stream.shape or not branch.is_floating_point()):
            return None
        joined = any(branch is j for j in s["joined"])
        part = s["prefix"] + (("attn+mlp" if joined else "attn") if s["attn"] else "mixer" if s["mixer"] else "mlp")
        k = self.counters.get((s["layer"], part), 0)
        self.counters[(s["layer"], part)] = k + 1
        site = part if k == 0 else f"{part}#{k}"
        self.activations.defer("sublayer_output", s["layer"], site, branch)
        if branch is a and writes_in_place(name, args, {}):
            self.activations.flush()  # the add overwrites the branch
        if tentative:  # the flags start again for the next branch; the stream stays, until the add is settled
            s["tentative"] = {"site": site, "counter": (s["layer"], part), "attn": s["attn"], "mixer": s["mixer"],
                              "after": {"stream": None, "alt": None, "views": []}}
            s["attn"] = s["mixer"] = False
        return s, site

    def after_add(self, add: tuple, out) -> None:
        s, site = add
        if not isinstance(out, torch.Tensor):
            return
        if site is None:
            if out.shape == s["stream"].shape:
                s["joined"].append(out)
            return
        self.activations.defer("residual_sum", s["layer"], site, out)
        pending = s["tentative"]
        if pending is not None and pending["site"] == site:  # a projection add: the stream it may have made
            pending["after"]["stream"] = out
            if s["lineage"] is not None:  # what derives from the sum tells at the scope's end if it was its output
                s["lineage"].mark(out)
            return
        s["stream"], s["alt"], s["attn"], s["joined"], s["views"] = out, None, False, [], []
        s["added"], s["mixer"], s["lineage"] = True, False, None

    # ------------------------------------------------------------------ blocks whose shortcut is a projection
    def derive(self, args, out) -> None:
        """While a scope has no residual add of its own input (and its block was not seen adding it before), its
        :class:`.Lineage` follows ``out``."""
        s = self.scopes[-1]
        lineage = s["lineage"]
        try:  # not under the guard, as follow: a few lookups on every op of the scope, kept cheap
            lineage.derive(args, out)
            if lineage.full:
                s["lineage"] = None
        except Exception as exc:  # never break training
            self.fail("residual", exc)

    def _projection_add(self, s: dict, a, b) -> tuple[int, int] | None:
        """(depths of a and b) when ``a + b`` may be the residual add of a block whose shortcut is a projection
        (ResNet's ``conv(x) + shortcut_conv(x)``; Hiera's ``proj(norm(x)) + attn(norm(x))``): the scope has had no
        residual add yet, both operands derive from its input, the same shape, at different depths (the branch is the
        deeper one), along separate paths (the shallower is not on the deeper's). It stays tentative until the sum is
        added to again or is the scope's output."""
        lineage = s["lineage"]
        if lineage is None or s["added"] or s["tentative"] is not None:
            return None
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.is_floating_point() and b.is_floating_point()):
            return None
        da, db = lineage.depth(a), lineage.depth(b)
        if da is None or db is None or da == db:
            return None
        deep, shallow = (a, b) if da > db else (b, a)
        if lineage.derives(deep, shallow):
            return None  # one path, not two: an add inside a branch (GELU's x + 0.044715·x³)
        return da, db

    def _settle(self, s: dict, out) -> None:
        """At the end of a scope with a pending projection add: its residual add if the scope's output (``out``, its
        first when a tuple) is its sum or derives from it (ResNet's ReLU after the add), else not a residual add at all
        (its entries dropped)."""
        if s["lineage"] is not None and s["lineage"].marked(out):
            self._confirm(s)
        else:
            self._refute(s)

    def _confirm(self, s: dict) -> None:
        """A pending projection add was the scope's residual add: its sum is the stream from now on."""
        pending, s["tentative"] = s["tentative"], None
        s["stream"], s["alt"], s["views"], s["joined"] = pending["after"]["stream"], None, pending["after"]["views"], []
        s["added"], s["lineage"], s["projected"] = True, None, True

    def _refute(self, s: dict) -> None:
        """A pending projection add that was not the scope's residual add: its entries dropped, its site's number
        given back, and the flags of the branch it closed restored."""
        pending, s["tentative"] = s["tentative"], None
        layer, site = s["layer"], pending["site"]
        self.activations.drop([("sublayer_output", layer, site), ("residual_sum", layer, site)])
        counter = pending["counter"]
        self.counters[counter] = self.counters.get(counter, 1) - 1
        s["attn"] |= pending["attn"]
        s["mixer"] |= pending["mixer"]
        if s["lineage"] is not None:
            s["lineage"].unmark()
