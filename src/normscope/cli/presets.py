"""``normscope presets``: the built-in contracts and their knobs."""

from __future__ import annotations

from ..exitcodes import EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("presets", help="the contracts of well-known implementations, with their knobs",
                       description="Built-in contracts. Use one with --expect NAME, and set its knobs with "
                                   "--expect NAME:knob=value,knob=value (e.g. torch_groupnorm:groups=32).")
    p.add_argument("--json", action="store_true", help="print JSON: name → NormSpec (defaults of the knobs)")
    p.set_defaults(run=run)


def run(args, console) -> int:
    import json

    from ..presets import PRESETS, describe, knobs
    from ..report.console import render_presets

    specs = {name: factory() for name, factory in PRESETS.items()}
    if args.json:
        print(json.dumps({"schema": "normscope.presets/1",
                          "presets": {name: spec.to_dict() for name, spec in specs.items()}}, indent=2))
    else:
        render_presets([(n, s, describe(n), knobs(n)) for n, s in specs.items()], console)
    return EXIT_OK
