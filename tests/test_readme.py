"""Every ``$ normscope …`` command of the README's tour runs as printed and prints what the README shows.

The files the commands use (a Gemma 3 config, a Llama checkpoint and its GGUF, a traced run) are written by
``examples/readme_files.py``, as a user would write them (in a subprocess). Each command runs through
``normscope.cli.main``, the console script's function, from that folder. Each line of a README output block
must appear in the output, in order (spacing and line wrapping aside); ``…`` or ``...`` elides, a run time
(``0.81 s``) may differ, and so may the digits of a rounding error in scientific notation (``3.813e−6``), which
depend on the CPU's arithmetic (its vector width, its BLAS kernels): its order of magnitude may not.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def tour() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each ``$ normscope`` command in the README's plain code blocks."""
    out: list[tuple[str, list[str]]] = []
    fence, plain = False, False  # inside a fenced block; a plain one (no language)
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence, plain = (False, False) if fence else (True, line == "```")
            if not fence and out:
                out.append(("", []))  # a block's end ends its last command's output
            continue
        if not (fence and plain):
            continue
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out and out[-1][0]:
            out[-1][1].append(line)
    return [(cmd, lines) for cmd, lines in out if "normscope" in cmd]


ELIDED = re.compile(r"^(…|\.\.\.)$")
SECONDS = re.compile(r"^\d+(\.\d+)?$")
ROUNDING = re.compile(r"^(\(?)\d\.\d+e([−-]\d+)([),;]?)$")  # 3.813e−6, (2.1e−7),


def line_pattern(line: str) -> re.Pattern | None:
    """A README output line as a pattern over the output with its whitespace collapsed; None for an elision."""
    tokens = line.split()
    if not tokens or all(ELIDED.match(t) for t in tokens):
        return None
    parts = []
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if SECONDS.match(tok) and re.match(r"^s\b|^s[,;)]?$", nxt):
            parts.append(r"[0-9.]+")  # a run time
        elif m := ROUNDING.match(tok):
            parts.append(re.escape(m[1]) + r"\d\.\d+e" + re.escape(m[2]) + re.escape(m[3]))  # its exponent only
        else:
            parts.append(r".*?".join(re.escape(piece) for piece in re.split(r"…|\.\.\.", tok)))
    return re.compile(r"\s+".join(parts))


def mismatches(output: str, expected: list[str]) -> list[str]:
    """The expected lines not found in ``output`` in order (whitespace collapsed)."""
    text = " ".join(output.split())
    at, missing = 0, []
    for line in expected:
        pattern = line_pattern(line)
        if pattern is None:
            continue
        m = pattern.search(text, at)
        if m is None:
            missing.append(line)
        else:
            at = m.end()
    return missing


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    pytest.importorskip("gguf", reason="the dev extra installs gguf")
    pytest.importorskip("transformers", reason="the hf extra installs transformers")
    folder = tmp_path_factory.mktemp("readme")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "readme_files.py"), str(folder)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return folder


EXIT = {"normscope contract llama llama-eps.gguf": 1}  # the README says: a mismatch, exit 1
COMMANDS = tour()


def test_the_readme_has_its_tour():
    assert len(COMMANDS) >= 8, [c for c, _ in COMMANDS]


def _argv(command: str) -> list[str]:
    """The command's arguments as the shell would pass them (``$(python -c "…")`` run in a subprocess)."""
    def substitute(m: re.Match) -> str:
        return subprocess.run([sys.executable, "-c", m.group(1)], capture_output=True, text=True,
                              check=True).stdout.strip()

    command = re.sub(r'\$\(python -c "([^"]*)"\)', substitute, command)
    argv = shlex.split(command)
    assert argv[0] == "normscope", command
    return argv[1:]


@pytest.mark.parametrize(("command", "expected"), COMMANDS, ids=[c.split(" --")[0][:60] for c, _ in COMMANDS])
def test_each_readme_command_prints_what_the_readme_shows(files, command, expected, monkeypatch, capsys):
    """Through ``normscope.cli.main`` (the console script's own function: same parser, same exit codes), in the
    folder the example files were written to, at 120 columns."""
    from normscope import cli

    if command.startswith("PYTHONPATH=examples "):
        command = command.removeprefix("PYTHONPATH=examples ")
        monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.chdir(files)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("TERM", "dumb")
    capsys.readouterr()
    code = cli.main(_argv(command))
    out = capsys.readouterr()
    want = EXIT.get(command, 1 if " check " in command and "primer" in command else 0)
    assert code == want, f"exit {code}\n{out.out[-3000:]}\n{out.err[-3000:]}"
    missing = mismatches(out.out, expected)
    assert not missing, "README lines not in the output:\n" + "\n".join(missing) + "\n--- output ---\n" + out.out


def test_the_matcher_can_fail():
    assert mismatches("a b c 1.23 s, 4 calls", ["a b", "c 9.99 s, 4 calls"]) == []
    assert mismatches("a b c", ["b", "a"]) == ["a"]  # order matters
    assert mismatches("x = 1", ["x = 2"]) == ["x = 2"]
    assert mismatches("weights from /long/path/model", ["weights from …/model"]) == []
    # a rounding error's digits may differ from CPU to CPU; its order of magnitude may not
    assert mismatches("error 3.763e−6, tolerance 1e−4", ["error 3.813e−6, tolerance 1e−4"]) == []
    assert mismatches("error 3.763e−5, tolerance", ["error 3.813e−6, tolerance"]) == ["error 3.813e−6, tolerance"]
    assert mismatches("(2.25e−7)", ["(2.1e−7)"]) == [] and mismatches("2.1e−7", ["(2.1e−7)"]) == ["(2.1e−7)"]


def test_the_tour_writer_says_what_it_needs_where_only_the_core_is_installed(monkeypatch, tmp_path):
    import importlib.util

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import readme_files
    finally:
        sys.path.remove(str(ROOT / "examples"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(SystemExit, match=r"need gguf .*make test"):
        readme_files.main([str(tmp_path / "tour")])
    assert not (tmp_path / "tour").exists()  # nothing written
