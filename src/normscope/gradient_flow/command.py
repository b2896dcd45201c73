"""``normscope gradflow TARGET``: the command-line glue (``add_parser(subparsers)`` and ``run(args, console)``).

TARGET is what ``normscope scan`` takes (``package.module:factory`` with ``--args``/``--kwargs``, a Hugging Face
model directory or a ``config.json``). The loss: a Hugging Face model gets a small ``input_ids`` batch with
``labels`` (its own loss); ``--tokens B,T`` feeds random token ids below the model's ``vocab_size`` and takes the
next-token cross-entropy of the logits; ``--shape`` feeds a standard-normal tensor. When the model returns no
logits over the vocabulary or no loss, the loss is the mean square of its output, and the output says so.
Exit codes: 0 measured, 2 usage or input error (one line on stderr).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..report.numbers import sig

if TYPE_CHECKING:  # the command line registers this parser without loading rich
    from rich.console import Console

from ..errors import InputError
from ..exitcodes import EXIT_OK


def add_parser(subparsers) -> Any:
    from ..model_options import MODEL_TARGET_HELP, add_model_args

    p = subparsers.add_parser(
        "gradflow",
        help="gradient norm per layer (attention, MLP, residual stream) at the start and after training steps",
        description="One backward of a loss on the model gives every parameter's gradient norm and one row per "
                    "block; with --steps the optimizer runs and the same is measured again. The model file is "
                    "not changed. Exit 0 measured, 2 usage error.",
    )
    p.add_argument("target", metavar="TARGET", help=MODEL_TARGET_HELP)
    p.add_argument("--inputs", help="ids:B,T for token ids below the model's vocab_size (next-token loss) or a shape "
                                    "for one standard-normal float input (mean-square loss); default: a small "
                                    "input_ids batch for Hugging Face models, with the model's own loss")
    p.add_argument("--tokens", help="the same as --inputs ids:B,T (default: none)")
    p.add_argument("--shape", help="the same as --inputs SHAPE (default: none)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps before measuring again (default 0)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="optimizer for --steps (default adam)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate for --steps (default 1e-3)")
    p.add_argument("--eval", action="store_true",
                   help="measure in evaluation mode (default: training mode, dropout seeded with 0)")
    add_model_args(p)
    p.add_argument("--plot", metavar="PNG", help="write the gradient-norm-vs-layer plot here (default: no plot)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.gradflow/1)")
    p.set_defaults(run=run)
    return p


def _vocab(model) -> int:
    from ..model import vocabulary_size

    v = vocabulary_size(model, embeddings=False)
    if v is not None:
        return v
    raise InputError(f"--tokens needs the model's vocabulary size, but {type(model).__name__} has no vocab_size "
                     "(nor config.vocab_size); pass --shape for a float input instead")


def _first_tensor(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "values"):
        out = list(out.values())
    if isinstance(out, list | tuple):
        for o in out:
            if isinstance(o, torch.Tensor) and torch.is_floating_point(o):
                return o
    raise InputError(f"the model returned a {type(out).__name__} with no floating-point tensor to take a loss of")


def loss_for(model, tokens: str | None, shape: str | None):
    """(loss_fn, describe) for the command line's input options: ``describe()`` names the loss that was taken,
    which for a model returning no loss (or no logits over the vocabulary) is known only after a call."""
    import torch
    import torch.nn.functional as F

    from ..loading import parse_shape
    from ..model import default_inputs

    if tokens and shape:
        raise InputError("pass --tokens or --shape, not both")
    g = torch.Generator().manual_seed(0)
    if shape:
        x = torch.randn(parse_shape(shape), generator=g)
        what = f"mean square of the output on randn{tuple(x.shape)}"
        return (lambda m: _first_tensor(m(x)).float().pow(2).mean()), lambda: what
    fallback: list[str] = []  # set when the model's output had no loss / no logits to take one of
    if tokens:
        b_t = parse_shape(tokens)
        if len(b_t) != 2 or b_t[1] < 2:
            raise InputError(f"--tokens is B,T with T ≥ 2 (a batch of sequences); got {tokens}")
        vocab = _vocab(model)
        ids = torch.randint(0, vocab, b_t, generator=g)
        what = f"next-token cross-entropy on random ids {tuple(b_t)} below {vocab}"

        def token_loss(m):
            out = _first_tensor(m(ids[:, :-1]))
            if out.dim() == 3 and out.shape[-1] == vocab:
                return F.cross_entropy(out.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
            fallback[:] = [f"mean square of the output (shape {tuple(out.shape)}: no logits over the "
                           f"{vocab}-token vocabulary) on random ids {tuple(ids[:, :-1].shape)} below {vocab}"]
            return out.float().pow(2).mean()
        return token_loss, lambda: fallback[0] if fallback else what
    kwargs = default_inputs(model)
    kwargs["labels"] = kwargs["input_ids"]
    what = f"the model's loss on input_ids {tuple(kwargs['input_ids'].shape)} (labels = input_ids)"

    def hf_loss(m):
        try:
            out = m(**kwargs)
        except TypeError as exc:  # a model without a head takes no labels
            if "labels" not in str(exc):
                raise
            out = m(**{k: v for k, v in kwargs.items() if k != "labels"})
        loss = getattr(out, "loss", None)
        if loss is not None:
            return loss
        fallback[:] = [f"mean square of the output ({type(m).__name__} returns no loss) on input_ids "
                       f"{tuple(kwargs['input_ids'].shape)}"]
        return _first_tensor(out).float().pow(2).mean()
    return hf_loss, lambda: fallback[0] if fallback else what


_COLUMNS = ("attention", "mlp", "norm", "stream_grad", "input_rms")


def _rows(layers: list[dict]) -> list[str]:
    """Gradient norms per layer as plain right-aligned columns, the block's name last and never cut: about 60
    columns of numbers, so a row fits 80 unless the block's name is long (then it runs past, whole)."""
    cells = [[str(r["layer"]), *(f"{sig(r[c])}" if r[c] is not None else "—" for c in _COLUMNS), r["block"]]
             for r in layers]
    head = ["layer", *_COLUMNS, "block"]
    widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head) - 1)]
    return ["  ".join([*(v.rjust(w) for v, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
            for row in [head, *cells]]


def run(args, console: Console) -> int:
    import math

    import torch

    from ..loading import parse_shape
    from ..model_options import check_plot_path, check_size, deadline
    from ..report.console import indented
    from ..sources import load_model
    from .core import gradflow

    if args.steps < 0:
        raise InputError(f"--steps must be ≥ 0; got {args.steps}")
    if not args.lr > 0:
        raise InputError(f"--lr must be positive; got {args.lr}")
    if args.plot:
        check_plot_path(args.plot, "gradflow.png")
    if args.inputs:
        if args.tokens or args.shape:
            raise InputError("give --inputs, or its older spellings --tokens/--shape, not both")
        if args.inputs.endswith(".pt"):
            raise InputError("gradflow takes --inputs ids:B,T or a shape (it draws the inputs and the loss itself)")
        flags = ("--inputs ids:", "--inputs")
        if args.inputs.startswith("ids:"):
            args.tokens = args.inputs[4:]
        else:
            args.shape = args.inputs
    else:
        flags = ("--tokens", "--shape")
    # the inputs' spelling checked before the model loads
    b_t = parse_shape(args.tokens, flags[0]) if args.tokens else None
    if b_t is not None and (len(b_t) != 2 or b_t[1] < 2):
        raise InputError(f"{flags[0]} is B,T with T ≥ 2 (a batch of sequences); got {args.tokens}")
    shape = parse_shape(args.shape, flags[1]) if args.shape and not args.tokens else None
    torch.manual_seed(0)  # a model built from a config starts from the same weights whatever ran before
    model, origin = load_model(args.target, args.args, args.kwargs, args.layers, args.vocab)
    if b_t is not None:  # a backward holds about as much again as the forward
        check_size(model, f"gradflow --tokens {args.tokens}", 2 * b_t[0], b_t[1], b_t[0] * b_t[1],
                   f"--tokens {b_t[0]},{min(b_t[1], 512)}")
    elif shape is not None:
        check_size(model, f"gradflow --shape {args.shape}", 2 * shape[0], None, 2 * math.prod(shape),
                   "--shape " + ",".join(map(str, (2, *shape[1:]))))
    loss_fn, describe = loss_for(model, args.tokens, args.shape)
    cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    torch.manual_seed(0)  # dropout in training mode: the same command prints the same numbers
    with deadline(args.timeout, "gradflow"):
        result = gradflow(model, loss_fn, steps=args.steps, optimizer=lambda ps: cls(ps, lr=args.lr),
                          train=not args.eval, progress=not args.json)
    loss_what = describe()
    result.notes.insert(0, f"model: {origin}; loss: {loss_what}")
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(result.to_json())
        return EXIT_OK
    indented(console, f"{origin}; loss: {loss_what}", 0)
    for snap in result.snapshots:
        console.print()
        console.print(f"[bold]step {snap.step}[/]: loss {sig(snap.loss, 4)}")
        for line in _rows(snap.layers):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    rows = [r for snap in result.snapshots for r in snap.layers]
    if rows and all(r["norm"] is None for r in rows):
        indented(console, "note: norm is — because no normalization module is a direct child of a block; a norm "
                          "nested deeper (inside the attention or MLP submodule) counts in that submodule's column",
                 0)
    for note in result.notes[1:]:
        indented(console, f"note: {note}", 0)
    if args.plot:
        console.print(f"plot: {args.plot}")
    return EXIT_OK
