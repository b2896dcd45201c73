"""Sections "dtypes" and "determinism": which dtypes run, and whether two calls on one input agree."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..dtypes import UNIT_ROUNDOFF
from ..numerics import constants as C
from ..report.numbers import sig
from ..results.check import Finding
from .context import Context

_DTYPE_WORDS = ("dtype", "type", "half", "float16", "bfloat16", "bf16", "fp16", "precision", "supported")


def names_a_dtype(reason: str, dtype: str) -> bool:
    """Whether an error reads as a refusal of the input's dtype (by design) rather than a failure on it."""
    text = reason.lower()
    if " failed on a " in text:  # "<target> failed on a <dtype> input of shape (…): <Error>: <message>"
        text = text.split(" failed on a ", 1)[1].split(": ", 2)[-1]
    return "not finite" not in text and any(w in text for w in _DTYPE_WORDS)


def dtypes(ctx: Context) -> Iterator[Finding]:
    """Every dtype tried that the target cannot run: a failure when asked for or when the target takes the input
    and then fails on it (non-finite output, an error that is not a dtype refusal); otherwise a skip that names
    the dtype and the target's reason."""
    asked = ctx.asked is not None
    for d in ctx.tried:
        if d in ctx.accepted:
            continue
        reason = ctx.target.rejection(d) or "the target does not run at this dtype"
        refused = d not in ctx.target.supported_dtypes or names_a_dtype(reason, d)
        if asked or not refused:
            yield ctx.finding("dtypes.runs", f"runs at {d}", "fail", reason, d, None,
                              f"{d} was {'asked for' if asked else 'tried'} and the target cannot run it: {reason}",
                              dtype=d)
        else:
            yield ctx.finding("dtypes.runs", f"runs at {d}", "skip", reason, d, None,
                              f"not checked at {d}: the target refuses it ({reason}); ask for it with dtypes= to "
                              "make this a failure", dtype=d)


def determinism(ctx: Context) -> Iterator[Finding]:
    """Call the target three times on one input and set ``ctx.call_noise``: findings that compare two calls
    allow for what differs."""
    x = ctx.rng.normal(size=ctx.shape) * 2 + 0.5
    d = ctx.dtype
    runs = [ctx.target(x, d) for _ in range(3)]
    with np.errstate(all="ignore"):
        spread = float(np.nanmax([np.nanmax(np.abs(r - runs[0])) for r in runs[1:]]))
        scale = max(1.0, float(np.nanmax(np.abs(runs[0]))))
        # rounding noise scales with each output: measure it relative to the element (floored near 0)
        size = np.maximum(np.abs(runs[0]),
                          max(C.RELATIVE_NOISE_FLOOR * float(np.sqrt(np.nanmean(runs[0] ** 2))), 1e-300))
        relative = float(np.nanmax([np.nanmax(np.abs(r - runs[0]) / size) for r in runs[1:]]))
    if not (np.isfinite(spread) and np.isfinite(relative)):
        spread = relative = 0.0  # non-finite outputs are judged by the forward findings
    ctx.call_noise = relative
    if spread == 0:
        yield ctx.finding("determinism.repeated_calls", "same output on repeated calls", "pass", 0.0, 0.0, 0.0,
                          f"three calls on one input at {d} returned identical outputs", dtype=d)
    else:
        yield ctx.finding("determinism.repeated_calls", "same output on repeated calls", "skip", spread, 0.0, None,
                          f"the target is not deterministic: three calls on one input at {d} differ by up to "
                          f"{sig(spread)} ({sig(spread / scale / UNIT_ROUNDOFF[d])} units of {d}'s rounding at the "
                          "output scale); findings that compare two calls allow twice this", dtype=d)
