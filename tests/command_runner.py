"""Run one subcommand through its own parser, as the command line does, and capture what it prints."""

from __future__ import annotations

import argparse

from rich.console import Console

from normscope.errors import NormscopeError


def run_command(command, argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``command`` (a module with ``add_parser``) on ``argv``; a NormscopeError is
    exit 2 with its message, as ``normscope.cli.main`` reports it."""
    parser = argparse.ArgumentParser(prog="normscope")
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        code = args.run(args, Console(width=200, highlight=False))
    except NormscopeError as exc:
        return 2, "", str(exc)
    out = capsys.readouterr()
    return code, out.out, out.err
