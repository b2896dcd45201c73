"""``diff(..., grad=True)``: the per-site comparison for activation and parameter gradients of two torch executions.

A scalar loss (the sum of the primary output in float32, or the user's ``loss_fn(output)``) is differentiated
with ``torch.autograd.grad`` (nothing is accumulated into the models' ``.grad``). The candidate runs first and
keeps the gradient with respect to each site's output (at its own dtype); during the reference's backward a
tensor hook at each site compares the two (the *propagated* gradient error, then drops the candidate's) and,
at the sites that get an own error in the forward, runs both modules' backward on the reference's input and the
reference's output gradient (teacher forcing: the site's *own* gradient error, dx and the module's own
parameter gradients). Bounds: at norm sites the error model (:func:`~normscope.numerics.tolerance.backward_bound`
of the inferred contract, per element); elsewhere the forward's dtype-derived rule on ‖Δ‖/‖r‖ (the reference's
module at the candidate's dtype, the twin, when the dtypes differ). The first divergence is the first site in
backward order (from the output towards the input: where a gradient error is born). Whole-model parameter
gradients are compared by name and reported; they carry everything downstream of them and are not judged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import InputError, NormscopeError
from ..report.numbers import sig
from ..sites.classes import known_class
from . import metrics
from .execution import (
    CallStack,
    Hooks,
    Unfrozen,
    cast,
    forwards_replaced,
    freeze,
    input_at,
    input_of,
    primary,
    restored,
    site_name,
    snapshot,
    stateless,
    thawed,
    versions,
)
from .result import SiteDiff


def _loss(out, loss_fn) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise InputError(f"loss_fn must return a floating scalar tensor; got "
                             f"{type(loss).__name__}{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        return loss.float().reshape(())
    y = primary(out)
    if y is None or not y.is_floating_point():
        what = "no tensor" if y is None else f"a {str(y.dtype).replace('torch.', '')} tensor"
        raise InputError(f"the model's output is {what}, which has no gradient: gradients (--grad) need a "
                         "floating output to differentiate; name one with --loss OUTPUT (an output's name or "
                         "index, e.g. --loss logits), or pass loss_fn= in Python")
    return y.float().sum()


def output_loss(key: str):
    """``--loss OUTPUT``: the float32 sum of one output of the model, by name (a dict or ``ModelOutput`` field) or
    index (a tuple's); an output that is not there, or not floating, is an input error naming what there is."""
    def loss(out):
        if isinstance(out, torch.Tensor):
            out = (out,)
        if isinstance(out, Mapping):
            names = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
            value = out.get(key) if key in out else (list(out.values())[int(key)] if key.isdigit() and
                                                       int(key) < len(out) else None)
        elif isinstance(out, tuple | list):
            names = [str(i) for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
            value = out[int(key)] if key.isdigit() and int(key) < len(out) else None
        else:
            names, value = [], None
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            have = ", ".join(names) or "none"
            raise InputError(f"--loss {key}: the model's output has no floating tensor of that name or index (its "
                             f"tensors: {have})")
        return value.float().sum()

    return loss


def undecided(g: dict[str, Any]) -> list[str]:
    """Why a gradient comparison without a divergence still cannot say "no divergence"."""
    why = []
    sites = g["sites"]
    if not sites:
        why.append("gradients: " + (g["notes"][0] if g["notes"] else "no site's gradient was compared") +
                   "; what would decide it: a model and loss whose output depends on parameters that require grad")
        return why
    failed = [n for n in g["notes"] if n.startswith("gradient comparison failed")]
    if failed:
        why.append(f"gradients: the comparison raised at {len(failed)} site(s), which were not judged ({failed[0]}); "
                   "what would decide it: that site compared")
    own = [s for s in sites if s.own is not None or s.elementwise is not None]
    if not own:
        why.append(f"gradients: no site's own backward was compared ({len(sites)} gradients compared as they "
                   "arrived, none judged on its own: "
                   f"{next((s.note for s in sites if s.note), 'no module call could be run again')}); what would "
                   "decide it: modules called with tensors (no cache object), aligned by name")
    unmatched = [s for s in sites if s.status == "unmatched"]
    if unmatched and len(unmatched) * 2 > len(sites):
        why.append(f"gradients: {len(unmatched)} of {len(sites)} sites found no gradient at the candidate's "
                   f"counterpart (first: {unmatched[0].name}); what would decide it: a candidate aligned by name")
    return why


class _ChildBackward(torch.autograd.Function):
    """A replayed child in a module's own backward: forward, the reference's outputs for that call; backward, the
    reference child's vector-Jacobian products at the reference's inputs (for every floating input the module's
    code handed it — a residual, an encoder's states — and from every floating output — a router's weights beside
    its logits), so the module's own code alone is what the comparison sees."""

    @staticmethod
    def forward(ctx, n_out, vjp, *tensors):
        outs, xs = tensors[:n_out], tensors[n_out:]
        ctx.vjp, ctx.dtypes = vjp, [x.dtype for x in xs]
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx, *gs):
        dx = ctx.vjp(list(gs))
        return (None, None, *(None for _ in gs),
                *(d.to(t) if d is not None else None for d, t in zip(dx, ctx.dtypes, strict=True)))


def _floating_inputs(args, kw) -> list[tuple[str, Any, torch.Tensor]]:
    """A call's floating tensor arguments that carry a gradient, as (where, key, tensor)."""
    return [(w, k, v) for w, items in (("arg", enumerate(args)), ("kw", kw.items())) for k, v in items
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad]


class _GradKid:
    """A child call of a module, as the module's own backward replays it (see :class:`_ChildBackward`)."""

    __slots__ = ("path", "module", "args", "kw", "state", "out")

    def __init__(self, path, module, args, kw, state, out):
        self.path, self.module, self.args, self.kw, self.state, self.out = path, module, args, kw, state, out

    def vjp(self, gs: list, positions: list[tuple[str, Any]], outputs: list[int | None]) -> list:
        """The reference child's input gradients at ``positions`` for the gradients ``gs`` of its floating outputs
        (``outputs``: their indices in its output tuple; None: the output is the tensor itself)."""
        ready = restored(self.args, self.kw, self.state)
        args, kw = ready if not isinstance(ready, str) else (self.args, self.kw)
        args, kw = list(args), dict(kw)
        xs = []
        for where, key in positions:
            box = args if where == "arg" else kw
            have = box[key] if (key in box if where == "kw" else key < len(box)) else None
            if isinstance(have, torch.Tensor) and have.is_floating_point():
                box[key] = have.detach().requires_grad_(True)
                xs.append(box[key])
            else:
                xs.append(None)
        wanted = [x for x in xs if x is not None]
        if not wanted:
            return [None] * len(xs)
        with torch.enable_grad():
            out = self.module(*args, **kw)
            ys = [out if i is None else out[i] for i in outputs]
            pairs = [(y, g.to(y.dtype)) for y, g in zip(ys, gs, strict=True)
                     if g is not None and isinstance(y, torch.Tensor) and y.requires_grad]
            grads = iter(torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True)) if pairs else iter([None] * len(wanted))
        return [next(grads) if x is not None else None for x in xs]


@contextlib.contextmanager
def _replayed(kids: list[_GradKid], module_of, dtype):
    """While a module's own backward runs: each child call returns the reference's output, tied to the inputs the
    module's code handed it by the reference child's backward (:class:`_ChildBackward`); a child called more often
    than in the reference runs as it is. Yields the list of (child path, its replayed output), whose gradients
    are what the module's own backward hands its children."""
    queues: dict[int, list[_GradKid]] = {}
    modules: dict[int, torch.nn.Module] = {}
    for kid in kids:
        m = module_of(kid)
        if isinstance(m, torch.nn.Module):
            queues.setdefault(id(m), []).append(kid)
            modules[id(m)] = m

    def replacement(m, forward):
        queue = queues[id(m)]

        def replayed(*a, **k):
            if not queue:
                return forward(*a, **k)
            kid = queue.pop(0)
            out = thawed(kid.out, dtype)
            inputs = _floating_inputs(a, k)
            if isinstance(out, torch.Tensor):
                at = [None] if out.is_floating_point() else []
            elif isinstance(out, tuple | list):
                at = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
            else:
                at = []
            if not at:
                return out
            ys = [out if i is None else out[i] for i in at]
            if inputs:
                positions = [(w, key) for w, key, _ in inputs]
                tied = _ChildBackward.apply(len(ys), lambda gs: kid.vjp(gs, positions, at),
                                            *(y.detach() for y in ys), *(t for _, _, t in inputs))
            else:  # no input gradient (token ids): only what the module's code hands it is seen
                tied = tuple(y.detach().requires_grad_(True) for y in ys)
            handed.append((kid.path, tied[0]))  # the gradient the module's own backward hands this child
            if isinstance(out, torch.Tensor):
                return tied[0]
            items = list(out)
            for i, t in zip(at, tied, strict=True):
                items[i] = t
            return type(out)(items)

        return replayed

    handed: list[tuple[str, torch.Tensor]] = []
    with forwards_replaced(modules.values(), replacement):
        yield handed


def _vjp(module, args, kw, dy, dtype, ac=None, kids=(), module_of=None):
    """dx (w.r.t. the call's main input: the first floating positional tensor, or for a call with keyword
    arguments only the floating keyword tensor of the output's shape) and the module's own parameter gradients,
    at ``dtype`` (None: as given), for output gradient ``dy``; and, under ``ac`` (autocast), the least precise
    dtype the forward's ops ran at (else None); and the gradients its code hands each replayed child's output.
    ``kids``: child calls replayed (:func:`_replayed`), each found on this side by ``module_of``."""
    xs, kws = list(cast(args, dtype)), dict(cast(kw, dtype, True))
    at = input_at(xs, kws, dy)  # None: no floating input (token ids), only parameter gradients
    inputs = []
    if at is not None:
        box = xs if at[0] == "arg" else kws
        box[at[1]] = box[at[1]].detach().requires_grad_(True)
        inputs = [box[at[1]]]
    params = [(n, p) for n, p in module.named_parameters(recurse=True) if p.requires_grad]
    seen: list[str] = []
    with torch.enable_grad():
        with ac.observe() if ac else contextlib.nullcontext(seen) as seen, \
                _replayed(list(kids), module_of, dtype) if kids else contextlib.nullcontext([]) as handed:
            y = primary(module(*xs, **kws))
        if not y.requires_grad:  # nothing of its own is differentiable (its children replayed, no input gradient)
            return None, {}, seen[0] if seen and seen[0] else None, []
        g = dy if dtype is None else dy.to(dtype)
        grads = list(torch.autograd.grad(y, inputs + [p for _, p in params] + [t for _, t in handed],
                                         g.to(y.dtype), allow_unused=True))
    dx = grads.pop(0) if inputs else None
    to_kids = [(path, grads[len(params) + i]) for i, (path, _) in enumerate(handed)]
    return (dx, {n: gp for (n, _), gp in zip(params, grads[:len(params)], strict=True) if gp is not None},
            seen[0] if seen and seen[0] else None, to_kids)


def _norm_judge(site_contracts, module, x, dy, dx_c, dparams_c, ref_dx, ref_dparams, ref_dtype, cand_dtype):
    from .. import reference
    from ..numerics import tolerance
    from ..precision import Precision

    try:
        spec, params, _ = site_contracts.infer(module, tuple(x.shape))
    except Exception as exc:
        return {"error": f"the reference's contract could not be inferred: {type(exc).__name__}: {exc}"}
    lay_names = {"dgamma": "weight", "dbeta": "bias"}
    x64, dy64 = x.detach().double().numpy(), dy.detach().double().numpy()
    with np.errstate(all="ignore"), torch.enable_grad():  # a backward hook runs with grad mode off
        try:
            ex = dict(zip(tolerance.GRADIENTS, reference.backward(x64, dy64, spec, **params.kwargs()), strict=True))
            rb = tolerance.backward_bound(x64, dy64, spec, ref_dtype, params,
                                          exact=tuple(ex[k] for k in tolerance.GRADIENTS))
            ref_got = {"dx": ref_dx, **{k: ref_dparams.get(n) for k, n in lay_names.items()}}
            for k, b in rb.items():
                if ref_got.get(k) is not None:
                    c = tolerance.compare(ref_got[k].double().numpy().reshape(b.shape), ex[k], None, b)
                    if not c.ok:
                        return {"error": f"the inferred contract ({spec}) does not describe the reference module's "
                                         f"{k}: worst |Δ| {sig(c.worst_error)} > bound {sig(c.worst_bound)}"}
            if cand_dtype != ref_dtype:
                p = Precision(cand_dtype)
                x64, dy64 = p.round(x64).astype(np.float64), p.round(dy64).astype(np.float64)
                ex = dict(zip(tolerance.GRADIENTS, reference.backward(x64, dy64, spec, **params.kwargs()),
                              strict=True))
            cb = tolerance.backward_bound(x64, dy64, spec, cand_dtype, params,
                                          exact=tuple(ex[k] for k in tolerance.GRADIENTS))
        except Exception as exc:
            return {"error": f"the error model could not be evaluated: {type(exc).__name__}: {exc}"}
        got = {"dx": dx_c, **{k: dparams_c.get(n) for k, n in lay_names.items()}}
        worst = None
        for k, b in cb.items():
            if got.get(k) is None:
                continue
            c = tolerance.compare(got[k].double().numpy().reshape(b.shape), ex[k], None, b)
            if worst is None or c.max_ratio > worst[1].max_ratio:
                worst = (k, c)
    if worst is None:
        return {"error": "no gradient to compare"}
    k, c = worst
    return {"spec": str(spec), "gradient": k, "ok": c.ok, "worst": list(c.worst), "worst_error": c.worst_error,
            "worst_bound": c.worst_bound, "worst_faithful": None, "max_ratio": c.max_ratio, "outside": c.outside,
            "total": c.total, "nonfinite": c.nonfinite}


def _candidate_pass(cand_model, args, kwargs, cand_torch_dtype, ac, loss_fn):
    """The candidate's forward and backward: the gradient at each site's output (by path and call number) and
    each parameter's gradient; None when nothing in it requires grad."""
    cand_grads: dict[tuple[str, int], torch.Tensor] = {}

    def post(module, path, number, a, kw, output):
        y = primary(output)
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.requires_grad:
            y.register_hook(lambda g, key=(path, number): cand_grads.__setitem__(key, g.detach()))

    cparams = [(n, p) for n, p in cand_model.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        with Hooks(cand_model, lambda *x: None, post).active(), ac():
            out = cand_model(*cast(args, cand_torch_dtype), **cast(kwargs, cand_torch_dtype, True))
        loss = _loss(out, loss_fn)
        if not loss.requires_grad:
            return None
        gs = torch.autograd.grad(loss, [p for _, p in cparams], allow_unused=True)
    return cand_grads, {n: g for (n, _), g in zip(cparams, gs, strict=True) if g is not None}


def _worst(dx_error: float | None, dp: dict, ref_dp: dict) -> float | None:
    """The largest of dx's ‖Δ‖/‖r‖ (given; None: the call has no floating input) and each own parameter
    gradient's; None when there is neither."""
    worst = dx_error
    for n, gp in dp.items():
        if n in ref_dp:
            e = metrics.errors(gp, ref_dp[n]).get("normalized", math.inf)
            worst = e if worst is None else max(worst, e)
    return worst


def _worst_param(dp: dict, ref_dp: dict) -> dict[str, Any] | None:
    """The metrics of the parameter gradient that errs most (a call without a floating input: an embedding)."""
    found = [metrics.errors(gp, ref_dp[n]) for n, gp in dp.items() if n in ref_dp]
    return max(found, key=lambda m: m.get("normalized", math.inf), default=None)


class _GradientWalk:
    """The reference's forward and backward: a tensor hook at each site's output compares the gradient arriving
    there with the candidate's (propagated) and, at sites with an own error, runs both modules' backward on the
    reference's input and output gradient (own)."""

    def __init__(self, cand_model, twin, cand_grads, *, cand_torch_dtype, ac, ref_dtype, cand_dtype, own_site,
                 site_contracts):
        self.cand_model, self.twin, self.cand_grads = cand_model, twin, cand_grads
        self.cand_torch_dtype, self.ac, self.ref_dtype, self.cand_dtype = cand_torch_dtype, ac, ref_dtype, cand_dtype
        self.own_site, self.site_contracts = own_site, site_contracts
        self.twin_modules = dict(twin.named_modules(remove_duplicate=False)) if twin is not None else {}
        self.cand_modules = dict(cand_model.named_modules(remove_duplicate=False))
        self.sites: list[SiteDiff] = []
        self.notes: list[str] = []
        self.frames = CallStack()

    def pre(self, module, path, number, a, kw=None):
        self.frames.enter(a, None if stateless(a) and stateless(kw or {}) else snapshot(a, kw))

    def post(self, module, path, number, a, kw, output):
        f, leaf = self.frames.leave()
        y = primary(output)
        if not (isinstance(y, torch.Tensor) and y.is_floating_point() and y.requires_grad):
            return
        x = input_of(f["args"], kw, y)  # a module called with keyword arguments only has its input there
        ready = restored(f["args"], kw, f["state"])  # a call that takes a cache: its state before the call
        # no floating input (an embedding of token ids): judged by its parameter gradients alone
        learns = x is not None or any(p.requires_grad for p in module.parameters())
        own = self.own_site(module, leaf, f["leaf_children"]) and learns and y is not x \
            and not isinstance(ready, str) and versions(f["args"]) == f["versions"]
        saved = (tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in f["args"]),
                 {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}, f["state"],
                 f["kids"]) if own else None
        if own and len(self.frames):  # its parent's own backward replays it
            try:
                self.frames.frames[-1]["kids"].append(_GradKid(path, module, saved[0], saved[1], f["state"],
                                                               freeze(output)))
            except Unfrozen:
                pass
        y.register_hook(lambda g: self._at_site(module, path, number, g, saved))

    def _at_site(self, module, path, number, g, saved):
        try:
            self._compare(module, path, number, g, saved)
        except Exception as exc:  # a comparison that fails is a note, never a broken backward
            self.notes.append(f"gradient comparison failed at {site_name(path, number)}: {type(exc).__name__}: "
                              f"{exc}")
        return None

    def _compare(self, module, path, number, g, saved):
        name = site_name(path, number)
        kind = "norm" if known_class(module) else "module"
        s = SiteDiff(name=name, cls=type(module).__name__, kind=kind, order=len(self.sites), depth=0,
                     shape=list(g.shape), status="unmatched")
        self.sites.append(s)
        gc = self.cand_grads.pop((path, number), None)
        if gc is None:
            s.note = "no gradient at the candidate's counterpart"
            return
        s.counterpart = name
        s.propagated = metrics.errors(gc, g)
        s.status = "propagated"
        cm = self.cand_modules.get(path)
        if saved is not None and cm is not None:
            self._own(s, module, cm, path, g, *saved)

    def _run(self, module, a, kw, state, g, dtype, ac=None, kids=(), module_of=None):
        ready = restored(a, kw, state)
        return _vjp(module, *ready, g, dtype, ac, kids, module_of)

    def _own(self, s: SiteDiff, module, cm, path, g, a, kw, state, kids):
        # both sides with their children replayed: the module's own backward, and what it hands each child
        ref_dx, ref_dp, _, ref_handed = self._run(module, a, kw, state, g, None, None, kids, lambda kid: kid.module)
        try:
            dx_c, dp_c, seen, handed = self._run(cm, a, kw, state, g, self.cand_torch_dtype, self.ac, kids,
                                                 lambda kid: self.cand_modules.get(kid.path))
        except Exception as exc:
            s.status, s.note = "raised", f"the candidate's backward raised on the reference's input: " \
                                         f"{type(exc).__name__}: {exc}"
            return
        site_dtype = s.dtype = seen or self.cand_dtype  # under autocast: the dtype its forward's ops ran at
        s.children_replayed = len(kids)
        handed_worst = None  # the gradient its own backward hands a child, against the reference's
        for (kid_path, gc), (_, gr) in zip(handed, ref_handed, strict=False):
            if gc is None and gr is None:
                continue
            m = metrics.errors(gc, gr) if gc is not None and gr is not None else {"normalized": math.inf}
            if s.feeds is None or not m["normalized"] <= s.feeds:
                s.feeds, s.feeds_to, handed_worst = m["normalized"], kid_path, m
        s.own = metrics.errors(dx_c, ref_dx) if dx_c is not None and ref_dx is not None else \
            _worst_param(dp_c, ref_dp) or (handed_worst if handed_worst and "max_abs" in handed_worst else None)
        if s.own is None:
            s.status, s.note = "propagated", "no input or parameter gradient of its own to compare"
            return
        x = input_of(a, kw, g)
        if s.kind == "norm":
            v = _norm_judge(self.site_contracts, module, x, g, dx_c, dp_c, ref_dx, ref_dp, self.ref_dtype,
                            site_dtype)
            if "error" not in v:
                s.elementwise = v
                s.bound_rule = (f"backward error model of {v['spec']} at {site_dtype}: worst {v['gradient']} "
                                f"element |Δ| {sig(v['worst_error'])} vs bound {sig(v['worst_bound'])}")
                s.status = "within" if v["ok"] else "diverged"
                return
            s.note = f"judged by the dtype-derived rule: {v['error']}"
        # ‖Δ‖/‖r‖ of dx, each own parameter gradient, and the gradients handed to its children
        worst = max(_worst(s.own["normalized"], dp_c, ref_dp), s.feeds or 0.0)
        lowered = self.twin is not None and site_dtype != self.ref_dtype
        tw = None
        if lowered and self.twin is self.cand_model:
            tw = worst  # the candidate is the reference's own copy at its dtype: it is its own twin
        elif lowered and path in self.twin_modules:
            t_dx, t_dp, _, t_handed = self._run(self.twin_modules[path], a, kw, state, g, self.cand_torch_dtype,
                                                self.ac, kids, lambda kid: self.twin_modules.get(kid.path))
            tw = _worst(metrics.errors(t_dx, ref_dx).get("normalized") if t_dx is not None else None, t_dp, ref_dp)
            for (_, gt), (_, gr) in zip(t_handed, ref_handed, strict=False):
                if gt is not None and gr is not None and tw is not None:
                    tw = max(tw, metrics.errors(gt, gr).get("normalized", math.inf))
            tw = tw if tw is not None and math.isfinite(tw) else None
        s.twin = tw
        n = int(g.shape[-1]) if x is None else int(x.shape[-1]) if x.dim() else 1
        s.bound, s.bound_rule = metrics.bound(site_dtype, self.ref_dtype, tw if lowered else None, n)
        if lowered and tw is None:
            s.bound_rule += " (no faithful twin measured)"
        s.status = "diverged" if worst > s.bound else "within"


def _divergence(first: SiteDiff) -> dict[str, Any]:
    if first.elementwise is not None:
        v = first.elementwise
        reason = (f"own {v['gradient']} at element {tuple(v['worst'])}: |Δ| = {sig(v['worst_error'])} > bound "
                  f"{sig(v['worst_bound'])} ({v['outside']} of {v['total']} outside) [{first.bound_rule}]")
    elif first.status == "raised":
        reason = first.note
    else:
        reason = (f"own gradient error ‖Δ‖/‖r‖ = {sig(first.own['normalized'])} > bound {sig(first.bound)} "
                  f"[{first.bound_rule}]")
        if first.feeds is not None and first.bound is not None and first.feeds > first.bound:
            reason += f"; its backward hands {first.feeds_to} a gradient that errs by ‖Δ‖/‖r‖ = {sig(first.feeds)}"
        if first.children_replayed:
            reason += (f"; the error is in this module's own backward, between its children ({first.children_replayed}"
                       " child call(s) replayed with the reference's outputs and backward)")
    return {"site": first.name, "class": first.cls, "kind": first.kind, "reason": reason}


def _nothing(why: str) -> dict[str, Any]:
    return {"sites": [], "first": None, "divergence": None, "params": [], "notes": [f"gradients not compared: {why}"]}


def run(reference, cand_model, twin, args, kwargs, *, cand_torch_dtype, ac, ref_dtype: str, cand_dtype: str,
        loss_fn, own_site, site_contracts, say) -> dict[str, Any]:
    """The gradient comparison; returns sites (backward order), the first divergence, parameter gradients, notes."""
    say("gradients: the candidate's forward and backward")
    try:
        found = _candidate_pass(cand_model, args, kwargs, cand_torch_dtype, ac, loss_fn)
    except NormscopeError:
        raise
    except Exception as exc:
        return {**_nothing("the candidate's forward and backward raised"),
                "raised": f"the candidate's backward pass raised: {type(exc).__name__}: {exc}"}
    if found is None:
        return _nothing("nothing in the candidate requires grad")
    cand_grads, cand_param_grads = found
    say("gradients: the reference's forward and backward, comparing site by site")
    walk = _GradientWalk(cand_model, twin, cand_grads, cand_torch_dtype=cand_torch_dtype, ac=ac, ref_dtype=ref_dtype,
                         cand_dtype=cand_dtype, own_site=own_site, site_contracts=site_contracts)
    rparams = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        with Hooks(reference, walk.pre, walk.post).active():
            out = reference(*args, **kwargs)
        loss = _loss(out, loss_fn)
        if not loss.requires_grad:
            return _nothing("nothing in the reference requires grad")
        gs = torch.autograd.grad(loss, [p for _, p in rparams], allow_unused=True)
    params = [{"name": n, **metrics.errors(cand_param_grads[n], g)} for (n, _), g in zip(rparams, gs, strict=True)
              if g is not None and cand_param_grads.get(n) is not None]
    # the first in backward order, where a gradient error is born; a module whose own backward runs its children
    # (attention and its projections) diverges with a child that does: the child is the culprit
    bad = [s for s in walk.sites if s.status in ("diverged", "raised")]
    bad = [s for s in bad if not any(o.name.split("#")[0].startswith(s.name.split("#")[0] + ".") for o in bad)]
    first = bad[0] if bad else None
    return {"sites": walk.sites, "first": first.name if first else None,
            "divergence": _divergence(first) if first is not None else None, "params": params, "notes": walk.notes}
