"""Any JSON document normscope wrote, read back into its result type by its ``schema`` field.

It sits with the entry points: reading a document back loads the module of its result type, from every layer
(a contract from the model level, a spec from the bottom), while ``results/`` stays data.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from .errors import InputError

#: schema → (module, class) of the result type that reads it back (``from_dict``).
LOADERS: dict[str, tuple[str, str]] = {
    "normscope.spec/1": ("normscope.spec", "NormSpec"),
    "normscope.inference/1": ("normscope.results.inference", "Inference"),
    "normscope.check/1": ("normscope.results.check", "Report"),
    "normscope.scan/1": ("normscope.sites.result", "ModelScan"),
    "normscope.contract/1": ("normscope.artifacts.model", "ModelContract"),
    "normscope.diff/1": ("normscope.divergence.result", "Diff"),
    "normscope.gradflow/1": ("normscope.gradient_flow.core", "GradFlow"),
}


def load(source: str | Path | dict[str, Any]) -> Any:
    """The result a normscope JSON document holds (a path to it, or the parsed dict), chosen by its ``schema``:
    a NormSpec, Inference, check Report, ModelScan, ModelContract, Diff or GradFlow."""
    from .loading import read_json_file

    data = source if isinstance(source, dict) else read_json_file(
        source, "a JSON document normscope wrote (--json or to_json())", what="normscope.load:")
    name = str(source) if not isinstance(source, dict) else "the document"
    if not isinstance(data, dict) or "schema" not in data:
        raise InputError(f"{name} is not a normscope JSON document (no 'schema' field); normscope writes them with "
                         "--json or to_json()")
    schema = data["schema"]
    if schema not in LOADERS:
        raise InputError(f"{name} has schema {schema!r}, which normscope.load does not read; it reads "
                         f"{', '.join(LOADERS)} (a training trace is read by normscope.diagnose(run_dir))")
    module, cls = LOADERS[schema]
    return getattr(importlib.import_module(module), cls).from_dict(data)
