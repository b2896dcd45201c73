"""The reference's forward, streamed: at the end of each module call (children before parents) its output is
compared with the candidate's counterpart (the *propagated* error; then the candidate's copy is dropped), the
counterpart is run on the reference's own inputs (the *own* error, :meth:`.candidate.Candidate.own`) and the site
judged (:mod:`.judge`). Never two full activation caches: only a few recent outputs are held, for the input errors
of the calls that take them."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..report.numbers import sig
from ..sites.classes import known_class
from . import contracts, judge, metrics
from .candidate import Alignment, Candidate, NotMeasured
from .execution import (
    CallStack,
    Kid,
    Memo,
    Record,
    Unfrozen,
    floating_leaves,
    freeze,
    input_of,
    output_of,
    primary,
    reduce_len,
    site_name,
    snapshot,
    stateless,
    versions,
)
from .result import SiteDiff


class Walk:
    """The comparison's state while the reference runs: the sites so far, the recent outputs with their errors,
    the calls in flight, and the first divergent site's modules and tensors (for its explanation)."""

    def __init__(self, cand: Candidate, alignment: Alignment, *, ref_dtype: str, block_or_above: set[int],
                 keep: bool, memo: Memo, model_inputs: list):
        self.cand, self.alignment, self.ref_dtype = cand, alignment, ref_dtype
        self.block_or_above, self.keep, self.memo = block_or_above, keep, memo
        self.sites: list[SiteDiff] = []
        self.own_sites = 0  # sites that have an own error to measure (leaves and their parents)
        self.outputs: list[tuple[torch.Tensor, float]] = []  # recent reference outputs and their propagated errors
        self.input_errors: dict[str, float] = {}  # site → the propagated error of its input
        self.frames = CallStack()
        self._kid: Kid | None = None  # this call, as its parent's replay will take it (set when judged on its own)
        self.first: dict[str, Any] = {}
        self.nonfinite: str | None = None  # the first site where the reference itself is not finite
        self.recent: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        self.site_contracts = contracts.Contracts()
        self.model_inputs = model_inputs  # the model's own arguments: their error is known (none)
        # sites whose candidate output is the reference's times a constant: (their output, the site, its consumers)
        # a site whose output the candidate scaled: the reference's output (what its consumers take), the site, its
        # consumers, and what a consumer's input is compared with (the reference's output; a quantized candidate's
        # twin output)
        self.scaled: list[tuple[torch.Tensor, SiteDiff, list[tuple[SiteDiff, str, float | None]], torch.Tensor]] = []

    # ------------------------------------------------------------------ hook callbacks
    def pre(self, module, path, number, a, kw=None) -> None:
        # a call that will write to a state object (a KV cache): its state before the call, for teacher forcing
        # (of the candidate's module, or of a quantized candidate's twin)
        state = snapshot(a, kw) if (self.cand.replays_children or self.cand.quantized) and not (
            stateless(a) and stateless(kw or {})) else None
        self.frames.enter(a, state)

    def post(self, module, path, number, a, kw, output) -> None:
        f, leaf = self.frames.leave()
        count = len(self.sites)
        self._kid = None
        try:
            self.compare(module, path, number, kw, output, f, leaf)
        finally:
            s = self.sites[count] if len(self.sites) > count else None
            self._account(f, s)
            self._hand_up(s, a, kw, output)

    def _hand_up(self, s: SiteDiff | None, args, kw, output) -> None:
        """Give the parent call this call's output to replay in the parent's teacher-forced run, when this call
        was judged on its own (its error is then its own, not the parent's); else the parent's run computes it."""
        if not len(self.frames) or s is None:
            return
        parent = self.frames.frames[-1]
        kid, self._kid = self._kid, None
        if kid is not None and s.status in ("within", "diverged"):
            try:
                y = primary(output)
                x = input_of(args, kw, y)
                dtype = self.cand.torch_dtype
                kid.x = freeze(x, dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else None
                kid.out = freeze(output, dtype)
                parent["kids"].append(kid)
                parent["child_sites"].append((s.name, True))
                return
            except Unfrozen:
                pass
        parent["child_sites"].append((s.name, False))

    def _account(self, f, s: SiteDiff | None) -> None:
        """Tell the parent call what this one erred by (for :func:`.judge.composition`): the site's propagated
        error, else its own (an output the candidate overwrote later), else that it could not be measured."""
        parent = self.frames.frames[-1] if len(self.frames) else None
        if parent is None:
            return
        parent["child_error"] = max(parent["child_error"], f["child_error"])
        parent["child_unmeasured"] |= f["child_unmeasured"]
        if s is None:
            return
        err = next((m["normalized"] for m in (s.propagated, s.own) if m and isinstance(m.get("normalized"), float)
                    and math.isfinite(m["normalized"])), None)
        if err is None or s.status in ("raised", "shape", "unmatched"):
            parent["child_unmeasured"] = True
        else:
            parent["child_error"] = max(parent["child_error"], err)

    # ------------------------------------------------------------------ one site
    def compare(self, module, path, number, kw, output, f, leaf) -> None:
        f["output"] = output
        y = primary(output)
        if not isinstance(y, torch.Tensor) or not y.is_floating_point():
            return
        name = site_name(path, number)
        kind = "norm" if known_class(module) else ("leaf" if leaf else "module")
        s = SiteDiff(name=name, cls=type(module).__name__, kind=kind, order=len(self.sites), depth=len(self.frames),
                     shape=list(y.shape), status="unmatched")
        self.sites.append(s)
        # a block holds sites of its own, judged there; a leaf holds none, so a leaf is judged even where a layer
        # list repeats it (nn.Sequential(Linear, GELU, Linear): the two Linears read as blocks). A candidate that
        # replays children judges every module: its own code alone, between its children
        own_site = leaf or self.cand.replays_children or (f["leaf_children"] and id(module) not in self.block_or_above)
        r = self.alignment.counterpart(path, number, list(y.shape))
        if r is None:
            s.note = "no counterpart in the candidate"
            self.own_sites += own_site  # unmatched sites count against the coverage
            return
        why_not = self.cand.matched(r, y, path)
        if why_not is None and self.cand.graph and r.output is not None and list(r.output.shape) != list(y.shape):
            # a runtime's value under this scope is not this module's primary output (a module with two outputs
            # whose scope exposes the other): not a counterpart, so not compared — never a shape divergence
            why_not = (f"not compared: the candidate's value here has shape {list(r.output.shape)}, the module's "
                       f"primary output {list(y.shape)} (another of its outputs)")
        if why_not:
            s.note = why_not
            self.own_sites += own_site
            return
        r.used = True
        s.counterpart = site_name(r.path, r.number)
        self._consumes(s, r, f["args"], kw)
        if self.cand.failed is not None and (r.path, r.number) == self.cand.failed:
            s.status, s.note = "raised", self.cand.error  # where the candidate's own forward stopped
            self._remember(s, module, r.module, f["args"], y, None)
            return
        err = self._propagated(s, r, y)
        if s.status == "reference_not_finite":
            return
        n = reduce_len(f["args"], y)
        # a quantized runtime graph's block is judged on its own error where the graph holds its input: carried
        # quantization noise says nothing of the code between its children
        own_site = own_site or (self.cand.graph and bool(self.cand.quantized))
        if own_site:
            self.own_sites += 1
        if not own_site or r.module is None:
            self._without_own(s, f, err, n, leaf, module, r.module, y)
            return
        x_in = input_of(f["args"], kw, y)
        if x_in is not None and y is x_in:
            s.note = "returns its input (an identity in evaluation mode): nothing of its own to compare"
            self.own_sites -= 1
            return
        if versions(f["args"]) != f["versions"]:
            s.note = "own error not measured: the module wrote its input in place"
            return
        try:
            yc, site_dtype, cand_ref = self.cand.own(r, f["args"], kw, self.memo, f["kids"], f["state"])
        except NotMeasured as exc:
            if exc.missing is not None:
                s.own_missing = exc.missing
                if self.cand.graph:
                    self._without_own(s, f, err, n, leaf, module, r.module, y)
            else:
                s.note = exc.note
            return
        self._judge_own(s, module, path, r, cand_ref, f, kw, x_in, y, yc, site_dtype, n)
        if self.cand.replays_children and isinstance(r.module, torch.nn.Module) and not self.cand.wrote_input:
            self._kid = Kid(path, s.name, r.module, None, None)  # (a module that writes its input runs in its parent)

    def _propagated(self, s: SiteDiff, r: Record, y: torch.Tensor) -> float | None:
        """The candidate's output against the reference's: sets the site's propagated error and status."""
        if r.output is None:
            s.note = "the candidate's forward gave no floating tensor here"
            s.propagated = None
        elif r.output._version != r.version:
            s.note = "propagated error not measured: the candidate overwrote this output in place later"
            r.output = None
            s.propagated = None
        else:
            # a module returning its last child's output (or its input) compares the same pair of tensors
            same = next((m for yy, cc, m in self.recent if yy is y and cc is r.output), None)
            s.propagated = dict(same) if same is not None else metrics.errors(r.output, y)
            self.recent.append((y, r.output, s.propagated))
            del self.recent[:-4]
        r.output = None  # streaming: the candidate's copy is no longer needed
        err = (s.propagated or {}).get("normalized")
        if isinstance(err, float) and math.isfinite(err):
            self.outputs.append((y, err))
            del self.outputs[:-64]
        if s.propagated is None:
            s.status = "propagated"
        elif "error" in s.propagated:
            s.status, s.note = "shape", s.propagated["error"]
        elif not s.propagated["reference_finite"]:
            s.status = "reference_not_finite"
            self.nonfinite = self.nonfinite or s.name
        else:
            s.status = "propagated"
        return err

    def _without_own(self, s: SiteDiff, f, err, n: int, leaf: bool, module, cand_module, y) -> None:
        """A site without an own error: an ONNX site on its propagated error; a torch module by composition."""
        if self.cand.graph:
            if s.depth > 0 and self.cand.quantized:
                judge.graph_carried(s, n=n, cand_dtype=self.cand.dtype, ref_dtype=self.ref_dtype,
                                    child_error=f["child_error"])
                if s.status == "diverged":
                    self._remember(s, module, cand_module, f["args"], y, None)
                return
            if s.depth > 0:
                judge.graph_propagated(s, n=n, cand_dtype=self.cand.dtype, ref_dtype=self.ref_dtype)
                return
            judged_own = {t.name for t in self.sites if t.own is not None and t.status in ("within", "diverged")}
            names = [t.name for t in self.sites]
            # a site the candidate holds no tensor of is accounted for when the sites that compute it inside
            # themselves (an attention's rotary embedding, an MLP's activation) were each judged on their own
            not_compared = []
            for t in self.sites:
                if t is s or not (t.status == "unmatched" or (t.propagated is None and t.own is None)):
                    continue
                cover = self.cand.covered_by(t.name, names)
                if cover and all(c in judged_own for c in cover):
                    more = f" and {len(cover) - 1} more" if len(cover) > 1 else ""
                    t.note = f"{t.note}; accounted for: computed inside {cover[0]}{more}, each judged on its own"
                else:
                    not_compared.append(t.name)
            judge.graph_output(s, n=n, cand_dtype=self.cand.dtype, ref_dtype=self.ref_dtype,
                               child_error=f["child_error"], not_compared=not_compared,
                               hold=getattr(self.cand, "output_hold", None))
            if s.status == "diverged":
                self._remember(s, module, cand_module, f["args"], y, None)
            return
        if leaf or f["child_unmeasured"] or s.status != "propagated" or err is None:
            return
        x = input_of(f["args"], {}, None)
        incoming = self._error_of(x)
        if x is not None and incoming is None and not any(x is a for a in self.model_inputs):
            return  # its input's error is unknown: nothing to tell its own part from
        if judge.composition(s, err=err, child_error=f["child_error"], incoming=incoming, n=n,
                             cand_dtype=self.cand.dtype, ref_dtype=self.ref_dtype):
            self._remember(s, module, cand_module, f["args"], y, None)

    def _judge_own(self, s, module, path, r, cand_ref, f, kw, x_in, y, yc, site_dtype, n) -> None:
        args = f["args"]
        s.dtype = site_dtype
        s.own = metrics.errors(yc, y)
        self._other_outputs(s, output_of(self.cand), f["output"])
        replay = getattr(self.cand, "replay", None)
        if replay is not None and f["child_sites"]:
            s.children_replayed = replay.replayed
            s.children_run = [name for name, replayed in f["child_sites"] if not replayed]
            if replay.feeds is not None:
                s.feeds, s.feeds_to = replay.feeds
        x_err = self._error_of(x_in)
        if x_err is not None:
            self.input_errors[s.name] = x_err
        if "error" in s.own:
            s.status, s.note = "shape", "teacher-forced: " + s.own["error"]
            self._remember(s, module, cand_ref, args, y, yc)
            return
        if s.kind == "norm":
            v = contracts.judge(self.site_contracts, module, r.module if self.cand.torch_modules else None, x_in, y, yc,
                                self.ref_dtype, site_dtype) if x_in is not None else {"error": "no floating tensor input"}
            if judge.norm_contract(s, v, site_dtype):
                if s.status == "diverged":
                    self._remember(s, module, cand_ref, args, y, yc)
                return
        if self.cand.quantized:
            self._judge_quantized(s, module, path, r, cand_ref, f, kw, y, yc, site_dtype, n)
            return
        own = max(s.own["normalized"], s.feeds or 0.0)
        tw, note = self.cand.twin_error(path, r, site_dtype, self.ref_dtype, own, args, kw, y, self.memo,
                                        f["kids"], f["state"])
        if note:
            s.note = note
        judge.own_error(s, site_dtype=site_dtype, ref_dtype=self.ref_dtype, twin=tw,
                        twin_expected=self.cand.twin is not None, n=n, suffix=self.cand.bound_suffix)
        if s.status == "diverged":
            self._remember(s, module, cand_ref, args, y, yc)
            factor = metrics.constant_factor(yc, y, s.bound)
            if factor is not None:
                s.factor = factor
                self.scaled.append((y, s, [], y))

    def _judge_quantized(self, s, module, path, r, cand_ref, f, kw, y, yc, site_dtype, n) -> None:
        """A quantized candidate's site: its own output against the reference's module run with the candidate's
        dequantized weights at its dtype (the twin), held to float rounding at that dtype; the twin's error against
        the reference is what the quantization explains."""
        yt = None
        if path in self.cand.twin_modules:
            yt, _ = self.cand.twin_output(path, r, f["args"], kw, self.memo, f["kids"], f["state"])
        if yt is None or tuple(yt.shape) != tuple(yc.shape):  # not judged: it counts against the coverage
            s.own, s.own_missing = None, "the reference with the candidate's dequantized weights could not run here"
            return
        s.twin = metrics.errors(yt, y).get("normalized")
        beyond = metrics.errors(yc, yt)
        s.beyond_twin = beyond.get("normalized")
        s.bound, s.bound_rule = metrics.bound(site_dtype, site_dtype, None, n)
        s.bound_rule += " beyond the reference run with the candidate's dequantized weights" + self.cand.bound_suffix
        s.status = "diverged" if s.beyond_twin is None or not s.judged_error <= s.bound else "within"
        fault = self.cand.weight_faults.get(path)
        if fault is not None:  # computing faithfully with weights that are not the reference's
            s.status, s.note = "diverged", fault
            s.bound_rule = "each element of its dequantized weight within one quantization step of the reference's"
        if s.status == "diverged":
            self._remember(s, module, cand_ref, f["args"], y, yc)
            factor = metrics.constant_factor(yc, yt, s.bound) if fault is None else None
            if factor is not None:  # a scale applied in another module, as in ``_judge_own``
                s.factor = factor
                self.scaled.append((y, s, [], yt))

    def _other_outputs(self, s: SiteDiff, cand_out, ref_out) -> None:
        """A module with several floating outputs (an attention's weights beside its output, a model's pooled
        output beside its hidden states): each one after the primary, matched by name or position and shape, is
        held to the site's bound with the primary (``SiteDiff.outputs``); one the candidate does not return is
        listed as not compared."""
        if cand_out is None or ref_out is None:
            return
        ref = floating_leaves(ref_out)[1:]
        if not ref:
            return
        cand = dict(floating_leaves(cand_out))
        for name, t in ref:
            c = cand.get(name)
            if c is None or list(c.shape) != list(t.shape):
                s.outputs[name] = None
                continue
            s.outputs[name] = metrics.errors(c, t).get("normalized")

    def _consumes(self, s: SiteDiff, r, args, kw) -> None:
        """When this call takes the output of a site the candidate scaled: how far the candidate's own input here
        (when its record keeps it) is from the reference's, else this site's propagated error (judged later)."""
        for out, _, consumers, target in self.scaled:
            if not any(a is out for a in (*args, *kw.values())):
                continue
            xc = self.cand.recorded_input(r)
            err = metrics.errors(xc, target).get("normalized") if xc is not None else None
            consumers.append((s, "input" if err is not None else "output", err))

    def regroup(self) -> None:
        """A site whose candidate output is the reference's times a constant, while what consumes that output
        agrees — the candidate's own input to each consumer (else each consumer's output) within the site's bound
        of the reference's — is a scale the candidate applies elsewhere (an mlx-lm port scales Gemma's embedding
        after the embedding): ``regrouped``, not a divergence. Without a consumer that agrees, it stays diverged (a
        scale lost, not moved)."""
        for _, s, consumers, _ in self.scaled:
            judged = [(c, what, err if what == "input" else (c.propagated or {}).get("normalized"))
                      for c, what, err in consumers if what == "input" or c.propagated is not None]
            if not judged or not all(isinstance(e, float) and e <= s.bound for _, _, e in judged):
                continue
            if all(w == "output" and c.kind == "norm" for c, w, _ in judged):
                continue  # a norm's output does not see a scale of its input: its agreement shows nothing
            s.status = "regrouped"
            names = ", ".join(c.name for c, _, _ in judged[:3])
            what = "their inputs in the candidate's forward" if all(w == "input" for _, w, _ in judged) else \
                "their outputs"
            s.note = (f"the candidate's output here is ×{sig(s.factor, 6)} the reference's (own error "
                      f"{sig(s.own['normalized'])}), and what consumes it agrees ({names}: {what} within "
                      f"{sig(max(e for _, _, e in judged))} of the reference's, this site's bound {sig(s.bound)}): the "
                      "candidate applies that factor outside this module")
            self.first.pop(s.name, None)

    def _error_of(self, x: torch.Tensor | None) -> float | None:
        """The propagated error of a recent reference output (None: not one of them)."""
        if x is None:
            return None
        return next((e for t, e in reversed(self.outputs) if t is x), None)

    def _remember(self, s: SiteDiff, ref_module, cand_module, args, y, yc) -> None:
        """The first divergent site's modules (and, with ``keep``, its tensors), for its explanation; sites before it
        that may turn out to be a regrouping (:meth:`regroup`) do not count as the first yet."""
        if any(name not in {site.name for _, site, _, _ in self.scaled} for name in self.first):
            return
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.first[s.name] = {"ref": ref_module, "cand": cand_module, "shape": tuple(x.shape) if x is not None else None,
                              "tensors": {"input": x, "reference": y.detach().clone(),
                                          "candidate_own": None if yc is None else yc.detach().clone()}
                              if self.keep else None}
