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

from ..errors import InputError
from ..sites.classes import known_class
from . import metrics
from .execution import CallStack, Hooks, cast, input_at, input_of, primary, site_name, stateless
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


def _vjp(module, args, kw, dy, dtype, ac=None):
    """dx (w.r.t. the call's main input: the first floating positional tensor, or for a call with keyword
    arguments only the floating keyword tensor of the output's shape) and the module's own parameter gradients,
    at ``dtype`` (None: as given), for output gradient ``dy``; and, under ``ac`` (autocast), the least precise
    dtype the forward's ops ran at (else None)."""
    xs, kws = list(cast(args, dtype)), dict(cast(kw, dtype, True))
    where, key = input_at(xs, kws, dy)
    box = xs if where == "arg" else kws
    box[key] = box[key].detach().requires_grad_(True)
    params = [(n, p) for n, p in module.named_parameters(recurse=True) if p.requires_grad]
    seen: list[str] = []
    with torch.enable_grad():
        with ac.observe() if ac else contextlib.nullcontext(seen) as seen:
            y = primary(module(*xs, **kws))
        g = dy if dtype is None else dy.to(dtype)
        grads = torch.autograd.grad(y, [box[key]] + [p for _, p in params], g.to(y.dtype), allow_unused=True)
    return (grads[0], {n: gp for (n, _), gp in zip(params, grads[1:], strict=True) if gp is not None},
            seen[0] if seen and seen[0] else None)


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
                                         f"{k}: worst |Δ| {c.worst_error:.3g} > bound {c.worst_bound:.3g}"}
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
    """The largest of dx's ‖Δ‖/‖r‖ (given) and each own parameter gradient's."""
    worst = dx_error
    for n, gp in dp.items():
        if n in ref_dp and worst is not None:
            worst = max(worst, metrics.errors(gp, ref_dp[n]).get("normalized", math.inf))
    return worst


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
        self.frames.enter(a)

    def post(self, module, path, number, a, kw, output):
        f, leaf = self.frames.leave()
        y = primary(output)
        if not (isinstance(y, torch.Tensor) and y.is_floating_point() and y.requires_grad):
            return
        x = input_of(f["args"], kw, y)  # a module called with keyword arguments only has its input there
        own = self.own_site(module, leaf, f["leaf_children"]) and x is not None and y is not x \
            and stateless(f["args"]) and stateless(kw)
        saved = (tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in f["args"]),
                 {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}) if own else None
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

    def _own(self, s: SiteDiff, module, cm, path, g, a, kw):
        ref_dx, ref_dp, _ = _vjp(module, a, kw, g, None)
        try:
            dx_c, dp_c, seen = _vjp(cm, a, kw, g, self.cand_torch_dtype, self.ac)
        except Exception as exc:
            s.status, s.note = "raised", f"the candidate's backward raised on the reference's input: " \
                                         f"{type(exc).__name__}: {exc}"
            return
        site_dtype = s.dtype = seen or self.cand_dtype  # under autocast: the dtype its forward's ops ran at
        s.own = metrics.errors(dx_c, ref_dx)
        x = input_of(a, kw, g)
        if s.kind == "norm":
            v = _norm_judge(self.site_contracts, module, x, g, dx_c, dp_c, ref_dx, ref_dp, self.ref_dtype,
                            site_dtype)
            if "error" not in v:
                s.elementwise = v
                s.bound_rule = (f"backward error model of {v['spec']} at {site_dtype}: worst {v['gradient']} "
                                f"element |Δ| {v['worst_error']:.3g} vs bound {v['worst_bound']:.3g}")
                s.status = "within" if v["ok"] else "diverged"
                return
            s.note = f"judged by the dtype-derived rule: {v['error']}"
        worst = _worst(s.own["normalized"], dp_c, ref_dp)  # ‖Δ‖/‖r‖ of dx and each own parameter gradient
        lowered = self.twin is not None and site_dtype != self.ref_dtype
        tw = None
        if lowered and self.twin is self.cand_model:
            tw = worst  # the candidate is the reference's own copy at its dtype: it is its own twin
        elif lowered and path in self.twin_modules:
            t_dx, t_dp, _ = _vjp(self.twin_modules[path], a, kw, g, self.cand_torch_dtype, self.ac)
            tw = _worst(metrics.errors(t_dx, ref_dx).get("normalized"), t_dp, ref_dp)
            tw = tw if tw is not None and math.isfinite(tw) else None
        s.twin = tw
        n = int(x.shape[-1]) if x.dim() else 1
        s.bound, s.bound_rule = metrics.bound(site_dtype, self.ref_dtype, tw if lowered else None, n)
        if lowered and tw is None:
            s.bound_rule += " (no faithful twin measured)"
        s.status = "diverged" if worst > s.bound else "within"


def _divergence(first: SiteDiff) -> dict[str, Any]:
    if first.elementwise is not None:
        v = first.elementwise
        reason = (f"own {v['gradient']} at element {tuple(v['worst'])}: |Δ| = {v['worst_error']:.3g} > bound "
                  f"{v['worst_bound']:.3g} ({v['outside']} of {v['total']} outside) [{first.bound_rule}]")
    elif first.status == "raised":
        reason = first.note
    else:
        reason = (f"own gradient error ‖Δ‖/‖r‖ = {first.own['normalized']:.3g} > bound {first.bound:.3g} "
                  f"[{first.bound_rule}]")
    return {"site": first.name, "class": first.cls, "kind": first.kind, "reason": reason}


def _nothing(why: str) -> dict[str, Any]:
    return {"sites": [], "first": None, "divergence": None, "params": [], "notes": [f"gradients not compared: {why}"]}


def run(reference, cand_model, twin, args, kwargs, *, cand_torch_dtype, ac, ref_dtype: str, cand_dtype: str,
        loss_fn, own_site, site_contracts, say) -> dict[str, Any]:
    """The gradient comparison; returns sites (backward order), the first divergence, parameter gradients, notes."""
    say("gradients: the candidate's forward and backward")
    found = _candidate_pass(cand_model, args, kwargs, cand_torch_dtype, ac, loss_fn)
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
