"""Section "forward vs reference": the probe shape and others (leading sizes 1 and 3, hidden sizes where no
parameter fixes them) at every dtype, the output dtype, and a strided view."""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import NormscopeError
from ..results.check import Finding
from .context import Context

HIDDEN_SIZES = (1, 3, 64, 123, 1000, 4097)
_WIDTH = ("bfloat16", "float16", "float32", "float64")


def grid_dtypes(ctx: Context) -> tuple[str, ...]:
    """The dtypes of the forward grid: every accepted one, or in --quick the lead dtype and bfloat16."""
    if not ctx.quick:
        return ctx.accepted
    return tuple(dict.fromkeys([ctx.dtype, *(d for d in ("bfloat16",) if d in ctx.accepted)]))


def shapes(ctx: Context) -> Iterator[tuple[int, ...]]:
    """The probe shape, leading sizes 1 and odd, and hidden sizes where no parameter fixes them."""
    spec, lay = ctx.spec, ctx.layout
    yield ctx.shape
    lead = list(lay.kept_axes)
    if all(a >= 0 for a in spec.axes):  # channel-first layouts: only the batch axis is free
        lead = [a for a in lead if a == 0]
    for sizes in ((1,), (3,)) if not ctx.quick else ((1,),):
        s = list(ctx.shape)
        for a in lead:
            s[a] = sizes[0]
        if tuple(s) != ctx.shape:
            yield tuple(s)
    if ctx.quick:
        return
    fixed = set(lay.param_axes) | ({lay.group_axis} if lay.group_axis is not None else set())
    free = [a for a in lay.axes if a not in fixed and a != 0]
    if free:
        a = free[-1]
        for h in HIDDEN_SIZES:
            if h == ctx.shape[a] or (spec.center and h == 1):
                continue
            s = list(ctx.shape)
            s[a] = h
            yield tuple(s)


def forward(ctx: Context) -> Iterator[Finding]:
    dtypes = grid_dtypes(ctx)
    skipped_sizes = []
    for shape in shapes(ctx):
        for d in dtypes:
            x = ctx.rng.normal(size=shape) * 2 + 0.5
            try:
                f = ctx.compare("reference.forward", f"forward {shape} {d}", x, d, f"random input of shape {shape}",
                                shape=shape)
            except NormscopeError:  # the target (or the contract's grouping) does not take this shape
                if shape == ctx.shape:
                    raise
                skipped_sizes.append(shape)
                break
            yield f
            ctx.progress(f"forward {shape} {d}")
    if skipped_sizes:
        yield ctx.finding("reference.other_shapes", "other shapes", "skip",
                          [list(s) for s in dict.fromkeys(skipped_sizes)],
                          why="the target does not accept these shapes (sizes fixed by the implementation)")
    yield ctx.finding("reference.other_eps", "other ε values", "skip", expected=ctx.spec.eps,
                      why="a target's ε is its own and cannot be varied from outside; the tiny-variance findings "
                          "test it where it takes over")
    yield from output_dtypes(ctx, dtypes)
    if ctx.target.supports_noncontiguous:
        x = ctx.rng.normal(size=ctx.shape)
        for d in dtypes[:2]:
            try:
                yield ctx.compare("reference.noncontiguous", f"non-contiguous input {d}", x, d,
                                  "a strided (transposed) view", run=ctx.target.call_noncontiguous)
            except Exception as exc:
                yield ctx.finding("reference.noncontiguous", f"non-contiguous input {d}", "fail", None, None, None,
                                  f"the target failed on a strided view: {type(exc).__name__}: {exc}", dtype=d)


def output_dtypes(ctx: Context, dtypes) -> Iterator[Finding]:
    """The output's dtype is part of the contract (``output_dtype``: the input's, unless it says fp32): a wider one
    fails as a narrower one does — layers after it would compute in another dtype than the checkpoint's."""
    promoted = ctx.spec.output_dtype == "float32"
    for d in dtypes:
        ctx.target(ctx.rng.normal(size=ctx.shape), d)
        out = ctx.target.output_dtype
        want = "float32" if promoted and d in _WIDTH and _WIDTH.index(d) < _WIDTH.index("float32") else d
        if out == want:
            yield ctx.finding("reference.output_dtype", f"output dtype at {d}", "pass", out, want, None,
                              f"{d} in, {out} out", dtype=d)
        elif out in _WIDTH and want in _WIDTH and _WIDTH.index(out) > _WIDTH.index(want):
            yield ctx.finding("reference.output_dtype", f"output dtype at {d}", "fail", out, want, None,
                              f"{d} in, {out} out: promoted, where the contract returns {want} (layers after it "
                              "would compute in the wider dtype; if that is intended, the contract says "
                              "output_dtype='float32')", dtype=d)
        else:
            yield ctx.finding("reference.output_dtype", f"output dtype at {d}", "fail", out, want, None,
                              f"{d} in, {out} out: the output lost or changed precision", dtype=d)
