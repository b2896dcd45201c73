"""The command-line options of the commands that take a whole model (scan, diff, gradflow). A leaf module: each
command module registers its parser with these without importing the ``cli`` package (which imports them)."""

from __future__ import annotations

#: the help of a TARGET that names a whole model (scan, gradflow; diff's REFERENCE)
MODEL_TARGET_HELP = ("package.module:factory, a local Hugging Face model directory, or a config.json "
                     "(random weights)")


def add_model_args(p, what: str = "the factory") -> None:
    """The options of a TARGET that names a whole model (scan, diff, gradflow): factory arguments and the size cap
    of a config.json built with random weights."""
    p.add_argument("--args", help=f"JSON list of positional arguments for {what}, e.g. '[64]' (default: none)")
    p.add_argument("--kwargs", help=f"JSON object of keyword arguments for {what} (default: none)")
    p.add_argument("--layers", type=int, default=2,
                   help="config.json only: number of layers built (default 2; 0 keeps the config's)")
    p.add_argument("--vocab", type=int, default=512,
                   help="config.json only: vocabulary cap (default 512; 0 keeps the config's)")
