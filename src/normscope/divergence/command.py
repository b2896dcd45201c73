"""``normscope diff REFERENCE [CANDIDATE]``: the command-line glue (``add_parser(subparsers)``, ``run(args, console)``).

REFERENCE and CANDIDATE are what ``normscope scan`` takes (``package.module:factory``, a Hugging Face model
directory, a ``config.json``); CANDIDATE may also be an ``.onnx`` file, an OpenVINO IR ``.xml``, ``openvino`` (REFERENCE
as OpenVINO runs it), ``mlx`` (REFERENCE ported by mlx-lm, run by MLX), a ``.gguf`` or ``llama.cpp`` (REFERENCE
written as a GGUF, run by llama.cpp), or be left out with
``--candidate-dtype`` or ``--autocast`` (the reference against itself at that precision). Exit codes: 0 pass,
5 diverged (the first divergent site is printed), 6 inconclusive (the reason and what would decide it), 2 usage or
input error (one line on stderr).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:  # building the parser must not import rich
    from rich.console import Console

from ..exitcodes import EXIT_DIVERGED
from ..results.verdict import exit_code


def add_parser(subparsers) -> Any:
    from ..model_options import INPUTS_HELP, MODEL_TARGET_HELP, add_model_args

    p = subparsers.add_parser(
        "diff",
        help="compare two executions of one model site by site, down to the first site that is itself wrong",
        description="Run REFERENCE and CANDIDATE (another module, an .onnx file, an OpenVINO IR .xml, 'openvino' — "
                    "REFERENCE as OpenVINO runs it —, 'mlx' — REFERENCE ported by mlx-lm —, a .gguf or 'llama.cpp' — "
                    "REFERENCE written as a GGUF — run by llama.cpp, or REFERENCE itself at "
                    "--candidate-dtype or under --autocast) on the same inputs; per site, the candidate's own "
                    "error (its module on the reference's input) and the propagated error; the first site whose own "
                    "error exceeds what a faithful execution at the candidate's dtype is allowed; every module is "
                    "judged on its own code, its judged children replayed with the reference's outputs. Exit 0 "
                    "pass, 5 diverged, 6 inconclusive (what was not compared, and what would decide it), 2 usage "
                    "error.",
    )
    p.add_argument("reference", metavar="REFERENCE", help=MODEL_TARGET_HELP)
    p.add_argument("candidate", metavar="CANDIDATE", nargs="?",
                   help="the same forms, an .onnx file, an OpenVINO IR .xml, or 'openvino' (REFERENCE converted by "
                        "openvino.convert_model and run by OpenVINO on the CPU; pip install 'normscope[openvino]'), "
                        "or 'mlx' (REFERENCE, a Hugging Face model, ported by mlx-lm and run by MLX on the CPU; "
                        "pip install 'normscope[mlx]'; 'mlx:4bit' or 'mlx:8bit': that port quantized as mlx_lm.convert "
                        "-q does, judged against REFERENCE with its own dequantized weights; or a directory "
                        "mlx_lm.convert -q wrote), a .gguf (quantized too: Q8_0, Q4_0, Q4_K_M…) or 'llama.cpp' "
                        "(REFERENCE written as a GGUF; 'llama.cpp:Q4_K_M': and quantized by llama.cpp) run by "
                        "llama.cpp on the CPU (pip install 'normscope[llamacpp]': builds llama.cpp, minutes); omit "
                        "with --candidate-dtype or --autocast")
    p.add_argument("--inputs", help=INPUTS_HELP)
    p.add_argument("--candidate-dtype", dest="candidate_dtype",
                   help="bfloat16, float16 or float32 (no more precise than REFERENCE): the candidate (or REFERENCE "
                        "itself) as a private copy cast to it (default: none, the candidate runs as given)")
    p.add_argument("--autocast", metavar="DTYPE",
                   help="bfloat16 or float16: the candidate (or REFERENCE itself) runs under torch.autocast at that "
                        "dtype, each site judged at the dtype its ops ran at; excludes --candidate-dtype "
                        "(default: no autocast)")
    add_model_args(p, "the factories")
    p.add_argument("--stream", action="store_true",
                   help="read REFERENCE's (and CANDIDATE's) weights from their safetensors files at each module's "
                        "call instead of loading them whole: a model larger than memory, compared block by block "
                        "(default: only where a model directory's files take more than half the memory available)")
    p.add_argument("--grad", action="store_true",
                   help="also compare the gradients of the sum of the output, activation and parameter gradients "
                        "(default: forward only)")
    p.add_argument("--loss", metavar="OUTPUT",
                   help="with --grad: the output whose sum is differentiated, by name (logits, last_hidden_state) "
                        "or index (0, 1, …) (default: the first floating output)")
    p.add_argument("--plot", metavar="PNG", help="write a plot of the errors against depth (default: no plot)")
    p.add_argument("--all", action="store_true", help="list every site (default: sites with a measured own error)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.diff/1)")
    p.set_defaults(run=run)
    return p


def run(args, console: Console) -> int:
    from ..model_options import check_plot_path, deadline, model_inputs
    from .core import diff
    from .render import plot_diff, render_diff
    from .runtimes import runtime_of

    if args.candidate is None and not args.candidate_dtype and not args.autocast:
        raise InputError("give a CANDIDATE, or --candidate-dtype (or --autocast) to compare REFERENCE with itself at "
                         "that precision")
    if args.plot:
        check_plot_path(args.plot, "diff.png")
    reference, origin = _load(args.reference, args, "REFERENCE")
    candidate = None
    if args.candidate is not None:
        if runtime_of(args.candidate) is not None:
            candidate = args.candidate
        else:
            candidate, _ = _load(args.candidate, args, "CANDIDATE")
    inputs = model_inputs(args.inputs, reference, "diff")
    loss = getattr(args, "loss", None)
    if loss is not None and not getattr(args, "grad", False):
        raise InputError("--loss names the output differentiated by --grad; add --grad, or leave --loss out")
    from .gradients import output_loss

    with deadline(args.timeout, "diff"):
        result = diff(reference, candidate, inputs, candidate_dtype=args.candidate_dtype, autocast=args.autocast,
                      grad=getattr(args, "grad", False), loss_fn=output_loss(loss) if loss is not None else None,
                      progress=not args.json)
    result.inputs["model"] = origin
    if args.plot:
        plot_diff(result, args.plot)
    if args.json:
        print(result.to_json())
    else:
        render_diff(result, console, all_sites=args.all)
        if args.plot:
            console.print(f"[dim]plot: {args.plot}[/]")
    return exit_code(result.verdict, fail=EXIT_DIVERGED)


def _load(target: str, args, which: str):
    """The model TARGET names: streamed from its files (--stream, or a model directory whose files take more than
    half the memory available), else loaded whole (:func:`..sources.load_model`)."""
    from ..model.streaming import checkpoint_bytes, memory_available, streamed
    from ..sources import MODEL_FORMS, load_model, resolve

    source = resolve(target, MODEL_FORMS)
    folder = {"hf-dir": source.path, "safetensors": source.path.parent if source.path else None}.get(source.kind)
    size = checkpoint_bytes(folder) if folder is not None else None
    available = memory_available()
    if getattr(args, "stream", False) or (size and available and size > available / 2):
        if folder is None or not size:
            raise InputError(f"--stream reads a Hugging Face model directory's safetensors files; {which} {target} "
                             f"is {source.description}: leave --stream out")
        from ..inputs import human_bytes

        why = ("--stream" if getattr(args, "stream", False) else
               f"its files ({human_bytes(size)}) take more than half the memory available ({human_bytes(available)})")
        return streamed(folder), f"weights streamed from {source.text} ({why})"
    return load_model(source, args.args, args.kwargs, args.layers, args.vocab)
