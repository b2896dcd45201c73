"""``check``: run the acceptance battery of an implementation against an expected contract.

Each finding compares the target with the float64 reference (and, at low precision, with the reference's
emulation of a faithful implementation at that dtype) within a derived bound (:mod:`normscope.numerics`).
The sections are listed in :data:`normscope.battery.registry.SECTIONS`; ``check`` builds the context and
walks them in order, then explains a failure by inferring the target's contract.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ..errors import InputError, NormscopeError, NotANormalization, TargetRaised
from ..inputs import probe_shape, quiet, spec_fits
from ..loading import read_json_file
from ..presets import preset_from_text
from ..results.check import Finding, Report
from ..results.inference import unsettled
from ..spec import NormSpec, differences
from ..targets import as_target
from ..targets.base import check_dtype_list
from .context import Context, NonFiniteOutput, Progress
from .registry import SECTIONS, Section


def resolve_expected(expect, eps: float | None = None, shape=None) -> NormSpec:
    """A NormSpec from a NormSpec, a preset name (with knobs: ``name:groups=32``) or a spec JSON file path."""
    if isinstance(expect, NormSpec):
        spec = expect
    elif isinstance(expect, str | Path) and Path(str(expect)).is_dir():
        raise InputError(f"--expect {expect} is a directory; give a preset name or a spec JSON file")
    elif isinstance(expect, str | Path) and (str(expect).endswith(".json") or Path(str(expect)).is_file()):
        path = Path(expect)
        if not path.is_file():
            raise InputError(f"no such spec file: {path}")
        data = read_json_file(path, "a spec JSON file or a preset name", what="--expect")
        if isinstance(data, dict) and data.get("schema") in ("normscope.inference/1", "normscope.check/1"):
            data = data.get("spec") or data.get("expected")  # a saved inference or check names its contract
        spec = NormSpec.from_dict(data)
    elif isinstance(expect, str):
        spec = preset_from_text(expect, shape)
    else:
        raise InputError(f"expect must be a NormSpec, a preset name or a spec JSON path; got {type(expect).__name__}")
    spec = spec.replace(eps=eps) if eps is not None else spec
    return spec if shape is None else spec_fits(spec, shape)


@quiet
def check(
    target,
    *,
    expect,
    shape,
    framework: str | None = None,
    dtypes=None,
    quick: bool = False,
    eps: float | None = None,
    seed: int = 0,
    explain_failures: bool = True,
    progress: Progress | None = None,
) -> Report:
    """Run the acceptance battery of ``target`` against the expected contract.

    ``expect``: a NormSpec, a preset name or a spec JSON path (``eps`` overrides its ε). Returns a
    :class:`Report`; when a finding fails, the report also carries the inferred contract and its
    differences from the expected one, in plain words.
    """
    started = time.perf_counter()
    shape = probe_shape(shape)
    spec = resolve_expected(expect, eps, shape)
    t = as_target(target, framework)
    calls_before = t.calls
    mode = {"batch": True, "running": False}.get(spec.batch_stats or "", t.training)
    try:
        ctx = Context.build(t, spec, shape, check_dtype_list(dtypes), quick, seed, progress)
    except NonFiniteOutput as exc:  # it ran, and failed: a report with that finding, not a usage error
        findings = [Finding(f"runs at {d}", "dtypes", "fail", "non-finite", "finite", None,
                            f"normal random input of shape {shape} at {d}: the output is not finite", "dtypes.runs",
                            {"dtype": d}) for d in exc.dtypes]
        return Report(target=t.description, expected=spec, shape=shape, dtypes=exc.dtypes, findings=findings,
                      params_source="not measured: the target's output is not finite", calls=t.calls - calls_before,
                      seconds=time.perf_counter() - started, quick=quick)
    for i, section in enumerate(SECTIONS):
        if section.label:
            ctx.progress(section.label)
        try:
            with t.mode(bool(mode)) if section.in_mode else contextlib.nullcontext():
                for finding in section.run(ctx):
                    ctx.findings.append(finding)
        except TargetRaised as exc:  # on an input the battery built: the target's failure, not the user's input
            ctx.findings.append(raised(ctx, section, exc, SECTIONS[i + 1:]))
            break
    report = Report(target=t.description, expected=spec, shape=shape, dtypes=ctx.tried, dtypes_run=ctx.accepted,
                    findings=ctx.findings, params_source=ctx.params_source, calls=t.calls - calls_before,
                    seconds=time.perf_counter() - started, quick=quick)
    if not report.ok and explain_failures:
        ctx.progress("a finding failed: inferring the contract to explain it")
        from ..probe.infer import infer

        try:
            inferred = infer(t, shape=shape, dtypes=dtypes, seed=seed)
            report.inferred = inferred.spec
            report.differences = differences(inferred.spec, spec, len(shape), shape=shape,
                                             undecided=unsettled(inferred.evidence))
        except (NotANormalization, NormscopeError) as exc:
            report.inference_error = str(exc)
        report.calls = t.calls - calls_before
        report.seconds = time.perf_counter() - started
    return report


def raised(ctx: Context, section: Section, exc: TargetRaised, rest: list[Section]) -> Finding:
    """The failed finding of a target that raised on an input the battery built (a valid one: the shape and dtype
    were accepted before the battery began). The battery stops there: the sections after it read what the earlier
    ones established, and a target that raises on valid input has already failed."""
    not_run = ", ".join(dict.fromkeys(s.label or s.id for s in rest))
    return ctx.finding("target.raised", f"raised during {section.label or section.id}", "fail",
                       f"{exc.kind}: {exc.line}" if exc.line else exc.kind, "an output", None,
                       f"the target raised {exc.kind}: {exc.line or '(no message)'} — on {exc.what} built by the "
                       f"{section.label or section.id} checks; a normalization must not raise on a valid input"
                       + (f". The battery stopped here; not run: {not_run}." if not_run else "."),
                       section=section.id)
