"""The layers of docs/architecture.md, kept: every import in src/normscope (lazy ones inside functions included)
goes to its own layer or one below, except the few upward imports listed with their reason; and the packages
import each other without cycles. A checker that could not fail would prove nothing: it is shown failing on
imports written into the test itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "normscope"

# lowest first; a module belongs to the layer of its longest listed prefix ("" is the package's own __init__ only:
# a module no prefix covers is in no layer, and the test says so)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "exitcodes", "jsonable", "lazy", "numba_bits", "numba_threads")),
    ("contract", ("spec", "presets")),
    ("shapes and dtypes", ("layout", "groups", "dtypes")),
    ("boundary", ("extras", "loading", "sources", "inputs")),
    ("results", ("results", "report")),
    ("reference", ("precision", "reference", "nn.modules")),
    ("numerics", ("numerics",)),
    ("targets", ("targets",)),
    ("probe", ("probe",)),
    ("battery", ("battery",)),
    ("model toolkit", ("model",)),
    ("model base", ("sites",)),
    ("model level", ("artifacts", "divergence", "tracing", "gradient_flow", "nn", "nn.blocks", "kernels")),
    ("entry points", ("", "__main__", "documents", "cli", "sites.command", "artifacts.command", "divergence.command",
                      "tracing.command", "gradient_flow.command", "model_options", "testing", "pytest_plugin",
                      "explain")),
]

# the imports that go up, each with why (importer, imported module)
UPWARD = {
    ("nn.modules", "kernels"): "a module built with backend= loads its fused kernel, lazily, only then",
    ("inputs", "reference"): "a probe input drawn in the reference's own float64, lazily",
}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or (p and module.startswith(p + "."))) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"normscope.{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return rank


def _module_name(path: Path) -> tuple[str, str]:
    """(the module's dotted name below normscope, the package its relative imports start from)."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _resolve(target: str) -> str:
    """The longest prefix of ``target`` (below normscope) that is a module or package of src/."""
    parts = target.split(".") if target else []
    for n in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:n])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return ".".join(parts[:n])
    return ""


def imports_of(source: str, module: str, package: str) -> list[tuple[str, int, bool]]:
    """(imported module below normscope, line, lazy) for every normscope import in ``source``."""
    tree = ast.parse(source)
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        lazy = id(node) in inside
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "normscope":
                target = node.module[len("normscope."):] if node.module != "normscope" else ""
            else:
                continue
            for alias in node.names:  # "from . import x" imports the submodule x when there is one
                out.append((_resolve(f"{target}.{alias.name}" if target else alias.name), node.lineno, lazy))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "normscope":
                    out.append((_resolve(alias.name[len("normscope."):]), node.lineno, lazy))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            # a module named in a string (importlib.import_module, a lazy-export table) is imported when used
            target = node.value[len("normscope."):]
            if _resolve(target) == target:
                out.append((target, node.lineno, True))
    return out


_MODULE_STRING = re.compile(r"^normscope(\.[a-z_]+)+$")


def violations(source: str, module: str, package: str) -> list[str]:
    mine = layer_of(module)
    found = []
    for target, line, lazy in imports_of(source, module, package):
        if target == module or layer_of(target) <= mine:
            continue
        if any((module == a or module.startswith(a + ".")) and (target == b or target.startswith(b + "."))
               for a, b in UPWARD):
            continue
        found.append(f"normscope.{module}:{line} imports normscope.{target}{' (lazily)' if lazy else ''}: "
                     f"{LAYERS[mine][0]} may not import {LAYERS[layer_of(target)][0]}")
    return found


def _sources():
    for path in sorted(SRC.rglob("*.py")):
        module, package = _module_name(path)
        yield path, module, package


def test_every_import_keeps_the_layers():
    bad = []
    for path, module, package in _sources():
        bad += violations(path.read_text(encoding="utf-8"), module, package)
    assert not bad, "\n".join(bad)


def test_every_upward_exception_is_still_used():
    used = set()
    for path, module, package in _sources():
        for target, _, _ in imports_of(path.read_text(encoding="utf-8"), module, package):
            for a, b in UPWARD:
                if (module == a or module.startswith(a + ".")) and (target == b or target.startswith(b + ".")):
                    used.add((a, b))
    assert used == set(UPWARD), f"exceptions no longer needed: {set(UPWARD) - used}"


# cycles between two units of one layer that stay, each with why
CYCLES = {
    ("presets", "spec"): "NormSpec.preset(name) looks the preset up, lazily; the presets are NormSpecs",
    ("report", "results"): "Report.text() and Report.to_junit() render through report/, lazily; report/ renders "
                           "results",
}


def _package(module: str) -> str:
    """The unit a cycle is looked for between: a top-level module, or a package (its command module apart)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[-1] == "command":
        return module
    return parts[0]


def cycles_of(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle of the graph once (from its smallest member), but the two-unit ones listed in CYCLES."""
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start and not (len(path) == 2 and tuple(sorted(path)) in CYCLES):
                    cycles.append(" → ".join(path + [start]))
                elif nxt not in path and nxt > start:
                    stack.append((nxt, path + [nxt]))
    return cycles


def test_packages_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for path, module, package in _sources():
        for target, _, _ in imports_of(path.read_text(encoding="utf-8"), module, package):
            a, b = _package(module), _package(target)
            if a != b and a and b:
                graph.setdefault(a, set()).add(b)
    cycles = cycles_of(graph)
    assert not cycles, "\n".join(cycles[:20])


def test_the_cycle_check_fails_on_a_cycle():
    assert cycles_of({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a → b → c → a"]
    assert cycles_of({"presets": {"spec"}, "spec": {"presets"}}) == []  # listed, with its reason
    assert cycles_of({"a": {"b"}, "b": {"c"}}) == []


@pytest.mark.parametrize(("module", "package", "source", "expect"), [
    ("spec", "", "from .sites import scan\n", "contract may not import model base"),
    ("numerics.tolerance", "numerics", "def f():\n    from ..battery import check\n",
     "numerics.tolerance:2 imports normscope.battery.check (lazily)"),
    ("probe.infer", "probe", "import normscope.tracing.recorder\n", "probe may not import model level"),
    ("results.check", "results", "from .. import divergence\n", "results may not import model level"),
    ("sites.core", "sites", "from ..divergence.core import diff\n", "model base may not import model level"),
])
def test_the_checker_fails_on_a_wrong_import(module, package, source, expect):
    found = violations(source, module, package)
    assert len(found) == 1 and expect in found[0], found


def test_the_checker_reads_a_module_named_in_a_string():
    found = violations('LOADERS = {"x": ("normscope.sites.result", "ModelScan")}\n', "results", "results")
    assert len(found) == 1 and "imports normscope.sites.result (lazily)" in found[0], found


def test_a_module_in_no_layer_is_named():
    with pytest.raises(AssertionError, match="normscope.unlisted is in no layer"):
        layer_of("unlisted")
    assert layer_of("") == len(LAYERS) - 1  # the package's own __init__: the entry points


def test_the_checker_passes_imports_that_go_down():
    assert violations("from ..errors import InputError\nfrom . import metrics\n", "divergence.core",
                      "divergence") == []
    assert violations("def f():\n    from ..kernels import ops\n", "nn.modules", "nn") == []  # a listed exception


def private_names_across_packages(source: str, module: str, package: str) -> list[str]:
    """Names with a leading underscore imported from another top-level package or module."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        found = imports_of(ast.unparse(node), module, package)
        if not found:  # not an import of normscope
            continue
        for (target, _, _), alias in zip(found, node.names, strict=True):
            if alias.name.startswith("_") and not alias.name.startswith("__") \
                    and target.split(".")[0] != module.split(".")[0]:
                out.append(f"normscope.{module}:{node.lineno} imports {alias.name} from normscope.{target}")
    return out


def test_no_private_name_is_imported_across_packages():
    bad = []
    for path, module, package in _sources():
        bad += private_names_across_packages(path.read_text(encoding="utf-8"), module, package)
    assert not bad, "\n".join(bad)
    assert private_names_across_packages("from ..sites.core import _arguments\n", "divergence.core", "divergence")
    assert not private_names_across_packages("from .common import _progress\n", "cli.check", "cli")


def test_the_public_namespace_holds_only_the_api():
    import normscope

    names = dir(normscope)
    assert "annotations" not in names and "TYPE_CHECKING" not in names and "check" in names and "NormSpec" in names
    assert all(not n.startswith("_") or n == "__version__" for n in names)
