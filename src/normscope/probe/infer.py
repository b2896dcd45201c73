"""Black-box inference of a normalization's complete contract.

Every experiment is an input whose correct output the reference knows; each field of the NormSpec comes
with the experiment that decided it and the numbers it measured (:class:`~normscope.results.inference.Evidence`).
Each step is a function of :mod:`normscope.probe.fields` that takes what it needs and returns its field(s):

====================  =============================================================================
step                  module (``normscope.probe.fields.…``) → fields
====================  =============================================================================
determinism           ``target``: identical calls → the noise floor of every experiment
train/eval modes      ``modes`` → ``batch_stats`` (a frozen BatchNorm: ``frozen``, every field)
dependency            ``axes`` → ``axes``, ``groups``, ``group_axis`` (scale invariance first)
common shift          ``center`` → ``center``
±u, u normalized      ``affine`` → ``gamma``, ``beta``, ``param_axes``, ``gamma_offset``;
                      ``variance`` → ``variance``
gain of u·√v          ``eps`` → ``eps``, ``eps_placement``
large offset          ``variance_algorithm`` → ``variance_algorithm``
bf16/fp16 outputs     ``low_precision`` → ``stats_dtype``, ``affine_order``; the output's dtype → ``output_dtype``
evaluation mode       ``frozen`` in eval mode → evaluation's own ε (evidence ``eps_evaluation`` where it differs);
                      ``running`` → running mean and variance
fresh inputs          ``validation``: the contract must reproduce the target
====================  =============================================================================
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from ..errors import NotANormalization, TargetError
from ..groups import Groups
from ..inputs import probe_shape, quiet
from ..results.inference import SCHEMA, Confidence, Evidence, Inference
from ..results.params import NormParams
from ..spec import NormSpec
from ..targets import as_target
from ..targets.base import check_dtype_list
from .fields.affine import affine, own_affine, parameter_values
from .fields.axes import axes_evidence, dependency
from .fields.center import center
from .fields.eps import eps
from .fields.frozen import frozen_batchnorm, read_map
from .fields.low_precision import with_random_parameters
from .fields.modes import batch_stats, modes
from .fields.probe import Probe, Progress, natural
from .fields.running import running_stats
from .fields.target import determinism, input_changes
from .fields.validation import VALIDATION_TOL, validate
from .fields.variance_algorithm import variance_algorithm

__all__ = ["SCHEMA", "VALIDATION_TOL", "Confidence", "Evidence", "Inference", "infer"]


def output_dtype(probe) -> tuple[bool, Evidence]:
    """Whether a low-precision input comes back in fp32 (a mixed-precision implementation that keeps fp32
    parameters and never casts back): one call at each of bf16 and fp16 the target runs."""
    seen = {}
    for d in ("bfloat16", "float16"):
        if d in probe.accepted:
            probe.target(probe.rng.normal(size=probe.shape), d)
            seen[d] = probe.target.output_dtype
    promoted = bool(seen) and all(v == "float32" for v in seen.values())
    note = "" if seen else "no 16-bit dtype ran: the output's dtype is the input's as far as was seen"
    return promoted, Evidence("a 16-bit input's output dtype", {"returned": seen}, note=note)


def _other_eps(a: NormSpec, b: NormSpec) -> bool:
    """Whether two measured ε (or their placements) differ beyond measurement (0.1 %)."""
    if a.eps_placement != b.eps_placement:
        return True
    return abs(a.eps - b.eps) > 1e-3 * max(abs(a.eps), abs(b.eps), 1e-30)


def _spec_of(g, ndim: int, centred: bool, found_eps, aff, algorithm, batch) -> tuple[NormSpec, bool]:
    """The contract the experiments found, in the axes' natural (channels-last or channels-first) form."""
    channel_style = (0 in g.axes) or g.groups is not None or bool(
        aff.param_axes and not set(aff.param_axes) <= set(g.axes))
    spec = NormSpec(
        center=centred,
        axes=natural(g.axes, ndim, channel_style),
        groups=g.groups,
        group_axis=None if g.group_axis is None else natural((g.group_axis,), ndim, channel_style)[0],
        eps=found_eps.eps,
        eps_placement=found_eps.placement,
        variance=aff.variance,
        variance_algorithm=algorithm,
        gamma=aff.gamma,
        beta=aff.beta,
        param_axes=natural(tuple(aff.param_axes), ndim, channel_style),
        gamma_offset=aff.gamma_offset if aff.gamma else 0.0,
        batch_stats=batch,
    )
    return spec, channel_style


def _evaluation_mode(probe, det, found_modes, spec: NormSpec, params, aff, g, found_eps, ev, module_training):
    """A module whose modes differ (BatchNorm): evaluation's own contract — its running statistics, its ε (an
    export-time fold may change it) and, for a module in evaluation mode, the precision its statistics are
    applied at — with its own validation. Returns (the evaluation contract, the parameters, its validation)."""
    t = probe.target
    eval_spec = spec.replace(batch_stats="running")
    with t.mode(False):  # evaluation may use another ε (an export-time fold): measured there, as frozen
        at_eval = read_map(probe, det, found_modes)  # the map and its ε only: no rounding, no validation
    if at_eval is not None and _other_eps(at_eval[0], spec):
        eval_spec = eval_spec.replace(eps=at_eval[0].eps, eps_placement=at_eval[0].eps_placement)
        e = at_eval[2]["eps"]
        ev["eps_evaluation"] = Evidence(e.experiment, {**e.measured, "training_eps": spec.eps,
                                                       "training_placement": spec.eps_placement},
                                        e.confidence, "evaluation mode uses another ε than training; the "
                                        "contract reported is the module's mode's")
    with t.mode(False):
        params = params.merged(running_stats(probe, eval_spec, params))  # with evaluation's own ε
        if not module_training:  # evaluation may apply its statistics at another precision than training
            eval_rounding = with_random_parameters(probe, eval_spec, params, aff, ", evaluation mode")
            eval_spec = eval_rounding.spec
            for k, e in eval_rounding.evidence.items():
                e.measured["training_mode"] = {"chosen": getattr(spec, k), "evidence": ev[k].measured}
                ev[k] = e
        validation = validate(probe, eval_spec, params, g, found_eps.measured_at)
    return eval_spec, params, validation


@quiet
def infer(
    target,
    *,
    shape,
    framework: str | None = None,
    dtypes=None,
    seed: int = 0,
    progress: Progress | None = None,
) -> Inference:
    """Recover the complete contract of a black-box normalization.

    ``target``: a torch module, an ONNX model (path, bytes, ModelProto), a Target, or a plain callable with
    ``framework="torch"|"numpy"|"jax"``. ``shape``: the input shape to probe with. Raises
    :class:`~normscope.NotANormalization` when no NormSpec explains the target, with the experiment that
    ruled it out. A target whose own parameters hide its structure (a γ of zero moves no output) is probed again
    on its private copy with re-drawn parameters, and the contract held to its own (evidence
    ``parameters_probed``).
    """
    started = time.perf_counter()
    t = as_target(target, framework)
    shape = probe_shape(shape)
    calls_before, modified_before = t.calls, t.input_modifications
    probe = Probe.open(t, shape, check_dtype_list(dtypes), seed, progress)
    try:
        spec, params, validation, ev = _contract(probe)
    except NotANormalization as first:
        spec, params, validation, ev = _with_redrawn_parameters(probe, first)
    if (changed := input_changes(probe, modified_before)) is not None:
        ev["modifies_input"] = changed
    return Inference(spec=spec, evidence=ev, params=params, calls=t.calls - calls_before,
                     target=t.description, shape=shape, probe_dtype=probe.dtype, dtypes=probe.accepted,
                     seconds=time.perf_counter() - started, validation=validation)


def _contract(probe: Probe) -> tuple[NormSpec, NormParams, dict[str, Any], dict[str, Evidence]]:
    """Every step of inference on the target as it is: the contract, its parameters, its validation and the
    evidence of each field."""
    t = probe.target
    det = determinism(probe)
    ev: dict[str, Evidence] = {"determinism": det.evidence}
    found_modes = modes(probe, det)
    if not found_modes.differ and (frozen := frozen_batchnorm(probe, det, found_modes)) is not None:
        ev.update(frozen.evidence)
        return frozen.spec, frozen.params, frozen.validation, ev

    module_training = t.training
    with t.mode(True if found_modes.differ else bool(module_training)):
        dep = dependency(probe, det)
        g = dep.groups
        if not g.axes:
            raise NotANormalization(
                "each output depends only on its own input (perturbing one position moved no other "
                "output): an elementwise map, not a normalization")
        if g.size < 2:
            raise TargetError(f"each statistic covers one element at shape {probe.shape}; probe a larger shape")
        centred, ev["center"] = center(probe, dep)
        aff = affine(probe, g, det)
        ev.update(aff.evidence)
        found_eps = eps(probe, g, aff)
        ev.update(found_eps.evidence)
        algorithm, ev["variance_algorithm"] = variance_algorithm(probe, g, aff.noise, centred)
        batch, batch_evidence = batch_stats(probe, found_modes, module_training)

        spec, channel_style = _spec_of(g, len(probe.shape), centred, found_eps, aff, algorithm, batch)
        ev["axes"] = axes_evidence(dep, probe.shape, channel_style)
        params = parameter_values(probe, g, spec, aff)
        promoted, ev["output_dtype"] = output_dtype(probe)  # first: the precision experiment emulates the output
        if promoted:
            spec = spec.replace(output_dtype="float32")
        rounding = with_random_parameters(probe, spec, params, aff)
        spec = rounding.spec
        ev.update(rounding.evidence)
        probe.progress("validation on fresh inputs")
        validation = validate(probe, spec, params, g, found_eps.measured_at)

    final = spec
    if found_modes.differ:
        eval_spec, params, validation["eval"] = _evaluation_mode(probe, det, found_modes, spec, params, aff, g,
                                                                 found_eps, ev, module_training)
        if not module_training:
            final = eval_spec
    ev["batch_stats"] = batch_evidence
    return final, params, validation, ev


def _with_redrawn_parameters(probe: Probe, first: NotANormalization
                             ) -> tuple[NormSpec, NormParams, dict[str, Any], dict[str, Evidence]]:
    """The contract of a target whose own parameters made inference fail (``first``): a γ of zero — a standard
    initialisation (a zero-initialised residual branch's last norm) or a trained channel that died — moves no
    output, so no experiment sees the normalization. The contract does not depend on γ/β's values: it is inferred
    on the target's private copy with re-drawn vector parameters, then γ/β are the target's own (fitted on its
    output, the normalized values known from the contract) and the contract with them is validated on the target
    as it is. Raises ``first`` where the target has no parameters to re-draw."""
    t = probe.target
    with t.redrawn_parameters() as drawn:
        if not drawn:
            raise first
        probe.progress(f"its own parameters hide the structure ({first}): probing a copy with re-drawn parameters")
        try:
            spec, drawn_params, drawn_validation, ev = _contract(dataclasses.replace(
                probe, rng=np.random.default_rng(probe.seed)))
        except NotANormalization as second:
            raise NotANormalization(f"{first} (and with re-drawn parameters: {second})") from None
    probe.progress("γ/β of its own parameters, and validation with them")
    g = Groups.of(spec, probe.shape)
    params = own_affine(probe, spec, drawn_params)
    try:
        validation = validate(probe, spec, params, g, probe.dtype)
    except NotANormalization as exc:
        raise NotANormalization(f"{first}; with re-drawn parameters it is {spec.summary()}, but with its own "
                                f"parameters that contract does not hold: {exc}") from None
    ev["parameters_probed"] = Evidence(
        "re-drawn vector parameters in the private copy",
        {"parameters": sorted(drawn), "with_own_parameters": str(first),
         "redrawn_validation_error": drawn_validation.get("max_relative_error")},
        Confidence.DECISIVE,
        "its own parameters made the probe fail, so the contract was inferred on a copy with re-drawn γ/β; γ/β are "
        "its own, fitted on its output, and the contract is validated with them")
    return spec, params, validation, ev
