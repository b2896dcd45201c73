"""``diff(reference, candidate, inputs)``: two executions of one model compared site by site, down to the first
site whose *own* error is beyond what a faithful execution at the candidate's dtype is allowed.

How it runs (streaming: never two full activation caches):

1. the candidate runs once; the primary output of each of its module calls is kept (at the candidate's dtype)
   — or, for an ONNX candidate, onnxruntime returns every intermediate value, mapped to the torch sites by the
   exporter's node-name scopes;
2. the reference runs once; at the end of each module call (children before parents) its output is compared
   with the candidate's (the *propagated* error, then the candidate's copy is dropped), and the candidate's
   counterpart module is run on the reference's own inputs (teacher forcing: the site's *own* error; for an
   ONNX candidate the site's nodes extracted as a subgraph, :mod:`.runtimes.onnx`), as is the reference's module at
   the candidate's dtype (the *twin*: the error precision alone makes there). Under ``autocast`` each
   teacher-forced call is observed below the autocast key and the site judged at the dtype its ops ran at;
3. a site diverges when its own error exceeds :func:`.metrics.bound`; the first one is the culprit. At a norm
   site both contracts are inferred (``normscope.infer``) and their differences printed in the contract's words.

The pipeline: the arguments are checked; the candidate's strategy is chosen (:mod:`.candidate`: a torch module
as it is, a private copy at a dtype, autocast, ONNX) and runs its own forward; the reference's forward is walked
(:mod:`.walk`), each site judged by a pure judge (:mod:`.judge`); the verdict step (:mod:`.verdict`) says why a
run without a divergence is still inconclusive and explains the first divergent site.

Module calls are seen through process-wide forward hooks filtered to the model's modules (nothing is
registered on the user's models); both models are left as they were (modes, parameters, buffers, flags).
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..dtypes import dtype_name
from ..errors import InputError, NormscopeError, TargetError
from ..model import arguments, describe, untouched
from ..model import progress as progress_of
from ..model.streaming import Accounting
from ..sites.dataflow import block_modules
from . import verdict
from .candidate import Candidate, candidate_for
from .execution import Hooks, Memo, model_dtype
from .result import Diff
from .runtimes import runtime_of
from .sharded import ShardedCandidate, agreed_inputs, check_same_reference
from .walk import Walk

_LOW = ("bfloat16", "float16", "float32", "float64")
_AUTOCAST = ("bfloat16", "float16")


def _dtype_argument(name: str, value, allowed) -> str:
    try:
        value = dtype_name(value)
    except Exception as exc:
        raise InputError(f"{name}: {exc}") from None
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _runtime(candidate) -> str | None:
    runtime = runtime_of(candidate)
    return runtime.name if runtime is not None else None


def _checked(reference, candidate, candidate_dtype, autocast, grad: bool, loss_fn) -> tuple[str | None, str | None]:
    """The arguments, checked together: (candidate_dtype, autocast) as dtype names, or an InputError."""
    if not isinstance(reference, torch.nn.Module):
        raise InputError(f"diff takes a torch.nn.Module as the reference; got a {type(reference).__name__}")
    if candidate_dtype is not None:
        candidate_dtype = _dtype_argument("candidate_dtype", candidate_dtype, _LOW)
    runtime = _runtime(candidate)  # "ONNX", "OpenVINO", "MLX" or "llama.cpp": a model as a runtime runs it
    onnx_cand = runtime is not None
    if autocast is not None:
        if candidate_dtype is not None:
            raise InputError("give autocast (--autocast) or candidate_dtype (--candidate-dtype), not both: autocast "
                             "runs the candidate as it is under torch.autocast, candidate_dtype runs a private copy "
                             "cast to that dtype")
        autocast = _dtype_argument("autocast", autocast, _AUTOCAST)
        if onnx_cand:
            raise InputError(f"an {runtime} candidate runs as exported; autocast applies to torch candidates only")
    if candidate is None and candidate_dtype is None and autocast is None:
        raise InputError("diff needs a candidate: another module, an ONNX, OpenVINO or MLX model, a GGUF, or "
                         "candidate_dtype= (or "
                         "autocast=) to compare the reference with itself at a lower precision (e.g. "
                         "candidate_dtype='bfloat16')")
    if candidate is not None and not onnx_cand and not isinstance(candidate, torch.nn.Module):
        raise InputError(f"the candidate must be a torch.nn.Module, an ONNX model (path, bytes or ModelProto), an "
                         f"OpenVINO model (openvino.Model or an IR .xml), an MLX module ('mlx': the reference "
                         f"ported by mlx-lm), a GGUF ('llama.cpp': the reference written as one) or None; got a "
                         f"{type(candidate).__name__}")
    if onnx_cand and grad:
        raise InputError(f"grad=True compares two torch executions; an {runtime} candidate has no backward here")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (output -> scalar tensor); got a {type(loss_fn).__name__}")
    if onnx_cand and candidate_dtype not in (None, "float32"):
        raise InputError(f"an {runtime} candidate runs as exported; candidate_dtype applies to torch candidates only")
    if candidate_dtype is not None:
        from ..dtypes import UNIT_ROUNDOFF

        ref_dtype = model_dtype(reference)
        if UNIT_ROUNDOFF.get(candidate_dtype, 0) < UNIT_ROUNDOFF.get(ref_dtype, 0):
            raise InputError(f"candidate_dtype {candidate_dtype} is more precise than the reference ({ref_dtype}): "
                             "diff finds where a candidate departs from its reference, and a more precise execution "
                             "is a reference, not a suspect; to measure the model's own rounding, make a "
                             f"{candidate_dtype} copy the reference and the model the candidate (Python: "
                             f"diff(copy.deepcopy(model).to(torch.{candidate_dtype}), model, inputs) with inputs "
                             "the copy accepts), or give a less precise candidate_dtype (bfloat16, float16)")
    return candidate_dtype, autocast


def _block_or_above(reference: torch.nn.Module) -> set[int]:
    """The blocks, the modules that hold one, and the model: sites without an own error of their own."""
    blocks = block_modules(reference)
    out = set(blocks)
    for m in reference.modules():
        if any(id(s) in blocks for s in m.modules() if s is not m):
            out.add(id(m))
    out.add(id(reference))
    return out


def _walk_reference(reference, args, kwargs, walk: Walk) -> Hooks:
    """The reference's forward with the walk's callbacks on every module call; a comparison that raises is noted
    by the hooks, a forward that raises is the user's input error."""
    hooks = Hooks(reference, walk.pre, walk.post)
    try:
        with hooks.active(), torch.no_grad():
            reference(*args, **kwargs)
    except NormscopeError:
        raise
    except Exception as exc:
        raise TargetError(f"the reference's forward failed on the inputs ({describe(args, kwargs)}): "
                          f"{type(exc).__name__}: {exc}") from exc
    return hooks


def diff(reference, candidate=None, inputs=None, *, candidate_dtype=None, autocast=None, grad: bool = False,
         loss_fn=None, keep: bool = False, progress=True) -> Diff:
    """Compare two executions of ``reference`` site by site; see the module docstring.

    ``candidate``: another torch module with the same architecture (aligned by module name, else by execution
    order and output shapes), an ONNX model (path, bytes or ``ModelProto``, run on onnxruntime), or None: the
    reference itself at ``candidate_dtype`` (a private copy). ``candidate_dtype`` ('bfloat16', 'float16',
    'float32') also runs a torch candidate as a private copy at that dtype. ``autocast`` ('bfloat16',
    'float16'; exclusive with ``candidate_dtype``): the candidate (the reference itself when None) runs as it is
    under ``torch.autocast`` on its device type, and each site is judged at the dtype its ops were observed to
    run at. ``inputs`` as in ``scan``.
    ``grad=True`` also compares the gradients of a scalar loss (the sum of the primary output, or
    ``loss_fn(output)``) site by site (:mod:`.gradients`; torch candidates only). ``keep=True`` keeps the
    first divergent site's input and outputs in ``Diff.tensors``.
    """
    started = time.perf_counter()
    candidate_dtype, autocast = _checked(reference, candidate, candidate_dtype, autocast, grad, loss_fn)
    streamed = Accounting(reference, candidate if isinstance(candidate, torch.nn.Module) else None)
    if grad and streamed.files:
        raise InputError("grad=True: a streamed model reads each module's weights at its call and lets them go, "
                         "but a backward needs every weight its forward used, so the whole model would be held; "
                         "leave grad out (--grad), or compare gradients on a model that fits in memory")
    runtime = _runtime(candidate)
    if runtime is not None and streamed.files:
        raise InputError(f"a streamed reference against a {runtime} candidate: the runtime's candidate is built from "
                         "the whole model (exported, ported or dequantized into a twin), which streaming does not "
                         "hold; compare a streamed reference with a torch candidate (--candidate-dtype), or leave "
                         "out --stream on a model that fits in memory")
    ref_dtype = model_dtype(reference)
    notes: list[str] = []
    with progress_of(progress) as say, contextlib.ExitStack() as stack:
        if streamed.files:
            streamed.say = say
            stack.callback(lambda: notes.append(streamed.note()))
            stack.enter_context(streamed)
        args, kwargs = arguments(reference, inputs)
        stack.enter_context(untouched(reference))
        reference.eval()
        cand = candidate_for(reference, candidate, candidate_dtype, autocast, ref_dtype, stack)
        if isinstance(cand, ShardedCandidate):  # every rank runs rank 0's batch on the same reference
            if grad:
                raise InputError("grad=True with a sharded candidate: its backward's collectives are not replayed "
                                 "site by site here; leave grad out (--grad)")
            check_same_reference(reference)
            args, kwargs = agreed_inputs(args, kwargs)
        if grad and cand.quantized:
            raise InputError("grad=True: a quantized candidate's forward is judged against its dequantized weights, "
                             "but its backward (the gradients its quantized weights pass on, or their "
                             "straight-through estimate) has no error model here, so no gradient could be judged; "
                             "leave grad out (--grad), or compare the gradients of a float copy")
        say(f"running the candidate{cand.runner}")
        cand.run(args, kwargs)
        alignment = cand.align([p for p, _ in reference.named_modules()])
        notes.extend(cand.notes)  # what its run and its alignment said of themselves
        if cand.error:
            notes.append(cand.error)
        parting = cand.parting(reference) if alignment.mode == "order" else None
        if parting is not None:
            return _not_aligned(reference, cand, parting, args, kwargs, ref_dtype, autocast, grad, notes, started)
        memo = Memo()  # one copy of each reference tensor for the teacher-forced runs
        walk = Walk(cand, alignment, ref_dtype=ref_dtype, block_or_above=_block_or_above(reference), keep=keep,
                    memo=memo, model_inputs=[*args, *kwargs.values()])
        say("running the reference, comparing site by site")
        hooks = _walk_reference(reference, args, kwargs, walk)
        result = _verdict(reference, cand, alignment.mode, walk, hooks.errors, notes, say)
        g = {"sites": [], "first": None, "divergence": None, "params": [], "undecided": []}
        if grad and cand.error:
            notes.append("gradients not compared: the candidate's forward raised (above)")
        elif grad:
            g = _gradients(reference, cand, alignment.mode, walk, args, kwargs, loss_fn, ref_dtype, notes, say)
            if g.get("raised"):  # a candidate whose backward raises is wrong, as one whose forward does
                result["failed"] = result["failed"] or result["first_divergence"] is None
                result["divergence"] = result["divergence"] or {"site": None, "reason": g["raised"]}
            elif g["first"] is None:
                result["inconclusive"] = result["inconclusive"] + g["undecided"]
    sites = walk.sites
    return Diff(reference=type(reference).__name__, candidate=cand.desc, reference_dtype=ref_dtype,
                candidate_dtype=cand.dtype, autocast=autocast, inputs=describe(args, kwargs), sites=sites,
                notes=notes, grad=grad, grad_sites=g["sites"], grad_first_divergence=g["first"],
                grad_divergence=g["divergence"], param_grads=g["params"], seconds=time.perf_counter() - started,
                stats={"alignment": alignment.mode, "sites": len(sites),
                       **({"self_candidate": True, "error_added": verdict.error_added(sites, walk.input_errors,
                                                                                      ref_dtype)}
                          if cand.self_copy else {}),
                       "own_measured": sum(s.own is not None for s in sites),
                       "children_replayed": sum(s.children_replayed for s in sites),
                       "candidate_cache_bytes": int(cand.cache_bytes),
                       **({"streamed": streamed.stats} if streamed.files else {})},
                **result)


def _not_aligned(reference, cand: Candidate, parting: str, args, kwargs, ref_dtype, autocast, grad, notes,
                 started) -> Diff:
    """Two models whose module names differ and whose structures part: nothing is compared."""
    why = (f"the two models do not align: their module names differ, and aligned by execution order their structures "
           f"part at {parting}; nothing was compared; what would decide it: a candidate with the reference's "
           "architecture (its module names, or the same parameter shapes in the same order)")
    return Diff(reference=type(reference).__name__, candidate=cand.desc, reference_dtype=ref_dtype,
                candidate_dtype=cand.dtype, autocast=autocast, inputs=describe(args, kwargs), sites=[], notes=notes,
                grad=grad, seconds=time.perf_counter() - started, stats={"alignment": "none", "sites": 0},
                inconclusive=[why])


def _verdict(reference, cand: Candidate, mode: str, walk: Walk, errors: list[str], notes: list[str],
             say) -> dict:
    """The first divergent site (explained), what was left unmatched, and why a run without one is inconclusive."""
    sites = walk.sites
    walk.regroup()
    notes.extend(f"comparison failed at {e}" for e in errors[:5])
    unmatched_ref = [s.name for s in sites if s.status == "unmatched"]
    unmatched_cand = walk.alignment.unmatched()
    if walk.nonfinite:
        notes.append(f"the reference itself is not finite from {walk.nonfinite} on: sites there are not compared")
    if unmatched_ref:
        notes.append(f"{len(unmatched_ref)} reference sites have no counterpart in the candidate (first: "
                     f"{unmatched_ref[0]})")
    if unmatched_cand:
        notes.append(f"{len(unmatched_cand)} candidate sites have no counterpart in the reference (first: "
                     f"{unmatched_cand[0]})")
    culprit = next((s for s in sites if s.status in ("diverged", "raised", "shape")), None)
    divergence, tensors = None, None
    if culprit is not None:
        divergence = verdict.explain(culprit, walk.first.get(culprit.name), say)
        if walk.keep and culprit.name in walk.first:
            tensors = walk.first[culprit.name].get("tensors")
    elif cand.error:
        divergence = {"site": None, "reason": cand.error}
    undecided = [] if culprit is not None or cand.error else verdict.undecided(
        sites, walk.own_sites, errors, walk.nonfinite, mode, cand.graph, cand.replays_children)
    return {"first_divergence": culprit.name if culprit is not None else None, "divergence": divergence,
            "unmatched_reference": unmatched_ref, "unmatched_candidate": unmatched_cand, "inconclusive": undecided,
            "failed": culprit is None and bool(cand.error), "tensors": tensors}


def _gradients(reference, cand: Candidate, mode: str, walk: Walk, args, kwargs, loss_fn, ref_dtype: str,
               notes: list[str], say) -> dict:
    if mode != "name":
        notes.append("gradients are compared by module name; the candidate's names differ from the reference's, "
                     "so gradient sites are unmatched")
    from . import gradients

    g = gradients.run(reference, cand.model, cand.twin, args, kwargs, cand_torch_dtype=cand.torch_dtype, ac=cand.ac,
                      ref_dtype=ref_dtype, cand_dtype=cand.dtype, loss_fn=loss_fn,
                      own_site=lambda m, leaf, leaf_children: True,  # every module: its children replayed
                      site_contracts=walk.site_contracts, say=say)
    notes.extend(g["notes"][:5])
    g["undecided"] = gradients.undecided(g)
    return g
