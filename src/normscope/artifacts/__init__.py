"""Static contracts: every norm site a model artifact states, and every mismatch between two artifacts.

``contract(path)`` reads an HF ``config.json`` or model directory, a GGUF file, an ONNX graph or a saved
contract JSON without executing anything; ``compare(a, b)`` lists every difference site by site.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError
from ..lazy import lazy_exports

_LAZY = {
    "ContractDiff": ".diff", "DiffItem": ".diff", "compare": ".diff",
    "read_gguf": ".ggufread", "read_hf": ".hf", "read_onnx": ".onnxread",
    "SCHEMA": ".model", "ContractSite": ".model", "ModelContract": ".model",
}

__all__ = ["SCHEMA", "ContractDiff", "ContractSite", "DiffItem", "ModelContract", "compare", "contract",
           "read_gguf", "read_hf", "read_onnx"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from .diff import ContractDiff, DiffItem, compare
    from .ggufread import read_gguf
    from .hf import read_hf
    from .model import SCHEMA, ContractSite, ModelContract
    from .onnxread import read_onnx


def contract(path: str | Path) -> ModelContract:
    """The static contract of a model artifact, chosen by its content and name.

    A directory or ``.json`` is an HF config (a saved ``normscope.contract/1`` JSON is read back as is); a
    file starting with ``GGUF`` is a GGUF model; ``.onnx`` is an ONNX graph.
    """
    from ..loading import read_json_file, unreadable
    from ..sources import MAX_CONFIG_BYTES
    from .ggufread import read_gguf
    from .hf import read_hf
    from .model import SCHEMA, ModelContract
    from .onnxread import read_onnx

    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    if p.is_dir():
        return read_hf(p)
    try:
        with open(p, "rb") as fh:
            head = fh.read(64)
    except OSError as exc:
        raise unreadable(p, exc) from None
    if head[:4] == b"GGUF" or p.suffix.lower() == ".gguf":
        return read_gguf(p)
    if p.suffix.lower() == ".onnx":
        return read_onnx(p)
    if p.suffix.lower() == ".json" or head.lstrip()[:1] in (b"{", b"["):
        data = read_json_file(p, "a Hugging Face config.json or a normscope contract JSON", limit=MAX_CONFIG_BYTES,
                              need_object=True)
        if data.get("schema") == SCHEMA:
            return ModelContract.from_dict(data)
        return read_hf(p)
    raise InputError(f"{p}: not a model artifact normscope reads (an HF config.json or model directory, a .gguf "
                     "file, an .onnx graph or a normscope contract JSON)")
