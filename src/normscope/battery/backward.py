"""Section "backward vs reference": dx, dγ, dβ against the analytic reference within
:func:`normscope.numerics.tolerance.backward_bound` (a faithful ``nn.Norm`` at the same dtype as baseline)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .. import reference
from ..numerics import tolerance
from ..precision import Precision
from ..report.numbers import sig
from ..results.check import Finding
from .context import Context

_FIELD = {"dgamma": "gamma", "dbeta": "beta"}


def backward(ctx: Context) -> Iterator[Finding]:
    if not ctx.target.differentiable:
        yield ctx.finding("reference.backward", "backward", "skip",
                          why=f"{ctx.target.framework} targets expose no gradients here")
        return
    dtypes = ctx.accepted if not ctx.quick else (ctx.dtype,)
    x = ctx.rng.normal(size=ctx.shape) * 2 + 0.5
    dy = ctx.rng.normal(size=ctx.shape)
    spec, params = ctx.spec, ctx.params
    for d in dtypes:
        xd = Precision(d).round(x).astype(np.float64)
        try:
            dx, pgrads = ctx.target.gradients(xd, dy, d)
        except Exception as exc:  # a differentiable target whose backward fails fails the finding
            yield ctx.finding("reference.backward", f"backward {d}", "fail", None, "gradients", None,
                              f"the target's backward failed: {type(exc).__name__}: {exc}", dtype=d)
            continue
        exact = reference.backward(xd, dy, spec, **params.kwargs())
        faithful = tolerance.faithful_gradients(xd, dy, spec, d, params)
        bounds = tolerance.backward_bound(xd, dy, spec, d, params, exact=exact, faithful=faithful)
        grads = {"dx": dx}
        for label, ref_g in (("dgamma", exact[1]), ("dbeta", exact[2])):
            name = ctx.param_names.get(_FIELD[label])
            if ref_g is not None and name in pgrads:
                grads[label] = pgrads[name].reshape(ref_g.shape)
        for label, got in grads.items():
            ex = exact[("dx", "dgamma", "dbeta").index(label)]
            c = tolerance.compare(got, ex, faithful[label], bounds[label])
            yield ctx.finding("reference.backward", f"backward {label} {d}", "pass" if c.ok else "fail",
                              c.worst_error, 0.0, c.worst_bound,
                              f"{label} at {d}: worst element {sig(c.worst_error)} vs 2 × a faithful {d} module's error "
                              f"+ the rounding of its terms ({sig(c.worst_bound)}); largest error {sig(c.max_error)}",
                              gradient=label, dtype=d)
