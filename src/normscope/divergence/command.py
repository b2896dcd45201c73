"""``normscope diff REFERENCE [CANDIDATE]``: the command-line glue (``add_parser(subparsers)``, ``run(args, console)``).

REFERENCE and CANDIDATE are what ``normscope scan`` takes (``package.module:factory``, a Hugging Face model
directory, a ``config.json``); CANDIDATE may also be an ``.onnx`` file, or be left out with
``--candidate-dtype`` or ``--autocast`` (the reference against itself at that precision). Exit codes: 0 no divergence,
5 diverged (the first divergent site is printed), 2 usage or input error (one line on stderr).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:  # building the parser must not import rich
    from rich.console import Console

from ..exitcodes import EXIT_DIVERGED, EXIT_INCONCLUSIVE, EXIT_OK


def add_parser(subparsers) -> Any:
    from ..model_options import MODEL_TARGET_HELP, add_model_args

    p = subparsers.add_parser(
        "diff",
        help="compare two executions of one model site by site, down to the first site that is itself wrong",
        description="Run REFERENCE and CANDIDATE (another module, an .onnx file, or REFERENCE itself at "
                    "--candidate-dtype or under --autocast) on the same inputs; per site, the candidate's own "
                    "error (its module on the reference's input) and the propagated error; the first site whose own "
                    "error exceeds what a faithful execution at the candidate's dtype is allowed. Exit 0 no "
                    "divergence, 5 diverged, 2 usage error.",
    )
    p.add_argument("reference", metavar="REFERENCE", help=MODEL_TARGET_HELP)
    p.add_argument("candidate", metavar="CANDIDATE", nargs="?",
                   help="the same forms, or an .onnx file; omit with --candidate-dtype or --autocast")
    p.add_argument("--inputs",
                   help="a shape for one float input (2,8,64), ids:B,T for token ids, or a .pt file (a tensor, tuple "
                        "or dict saved with torch.save); default: a small input_ids batch for Hugging Face models")
    p.add_argument("--candidate-dtype", dest="candidate_dtype",
                   help="bfloat16, float16 or float32 (no more precise than REFERENCE): the candidate (or REFERENCE "
                        "itself) as a private copy cast to it (default: none, the candidate runs as given)")
    p.add_argument("--autocast", metavar="DTYPE",
                   help="bfloat16 or float16: the candidate (or REFERENCE itself) runs under torch.autocast at that "
                        "dtype, each site judged at the dtype its ops ran at; excludes --candidate-dtype "
                        "(default: no autocast)")
    add_model_args(p, "the factories")
    p.add_argument("--grad", action="store_true",
                   help="also compare the gradients of the sum of the output, activation and parameter gradients "
                        "(default: forward only)")
    p.add_argument("--plot", metavar="PNG", help="write a plot of the errors against depth (default: no plot)")
    p.add_argument("--all", action="store_true", help="list every site (default: sites with a measured own error)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.diff/1)")
    p.set_defaults(run=run)
    return p


def parse_inputs(text: str | None, vocab: int | None = None):
    """``--inputs``: None, a shape (a float tensor), ``ids:B,T`` (an integer tensor of token ids below ``vocab``)
    or a ``.pt`` file."""
    import torch

    from ..loading import parse_shape

    if text is None:
        return None
    g = torch.Generator().manual_seed(0)
    if text.endswith(".pt"):
        try:
            obj = torch.load(text, weights_only=True)
        except Exception as exc:
            raise InputError(f"--inputs {text}: could not load it with torch.load ({type(exc).__name__}: {exc})") \
                from None
        if not isinstance(obj, torch.Tensor | tuple | dict):
            raise InputError(f"--inputs {text} holds a {type(obj).__name__}; save a tensor, tuple or dict")
        return obj
    if text.startswith("ids:"):
        shape = parse_shape(text[4:])
        hi = min(vocab or 1000, 1000)
        return torch.randint(min(4, hi - 1), hi, shape, generator=g)
    return torch.randn(parse_shape(text), generator=g)


def run(args, console: Console) -> int:
    import math

    import torch

    from ..loading import parse_shape
    from ..model_options import check_size, deadline
    from ..sources import load_model
    from .core import diff
    from .onnxsites import is_onnx
    from .render import plot_diff, render_diff

    if args.candidate is None and not args.candidate_dtype and not args.autocast:
        raise InputError("give a CANDIDATE, or --candidate-dtype (or --autocast) to compare REFERENCE with itself at "
                         "that precision")
    reference, origin = load_model(args.reference, args.args, args.kwargs, args.layers, args.vocab)
    candidate = None
    if args.candidate is not None:
        if is_onnx(args.candidate):
            candidate = args.candidate
        else:
            candidate, _ = load_model(args.candidate, args.args, args.kwargs, args.layers, args.vocab)
    vocab = getattr(getattr(reference, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):  # token ids stay below the first embedding's size
        vocab = next((m.num_embeddings for m in reference.modules() if isinstance(m, torch.nn.Embedding)), None)
    if args.inputs and args.inputs.startswith("ids:"):
        b_t = parse_shape(args.inputs[4:])
        if len(b_t) == 2:
            check_size(reference, f"diff --inputs {args.inputs}", b_t[0], b_t[1], b_t[0] * b_t[1],
                       f"ids:{b_t[0]},{min(b_t[1], 512)}")
    elif args.inputs and not args.inputs.endswith(".pt"):
        shape = parse_shape(args.inputs)
        check_size(reference, f"diff --inputs {args.inputs}", shape[0], None, math.prod(shape),
                   ",".join(map(str, (2, *shape[1:]))))
    inputs = parse_inputs(args.inputs, vocab if isinstance(vocab, int) else None)
    if args.inputs and args.inputs.startswith("ids:") and getattr(reference, "config", None) is not None:
        import inspect

        inputs = {"input_ids": inputs}  # Hugging Face models take their ids by keyword
        if "use_cache" in inspect.signature(reference.forward).parameters:
            inputs["use_cache"] = False
    with deadline(args.timeout, "diff"):
        result = diff(reference, candidate, inputs, candidate_dtype=args.candidate_dtype, autocast=args.autocast,
                      grad=getattr(args, "grad", False), progress=not args.json)
    result.inputs["model"] = origin
    if args.plot:
        plot_diff(result, args.plot)
    if args.json:
        print(result.to_json())
    else:
        render_diff(result, console, all_sites=args.all)
        if args.plot:
            console.print(f"[dim]plot: {args.plot}[/]")
    return {"fail": EXIT_DIVERGED, "inconclusive": EXIT_INCONCLUSIVE}.get(result.verdict, EXIT_OK)
