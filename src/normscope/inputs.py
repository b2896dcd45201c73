"""What crosses the API boundary of ``check()`` and ``infer()``: the probe shape, its memory, warnings.

``probe_shape`` turns what a caller passed as ``shape`` into a tuple of positive ints, or raises one
clear :class:`~normscope.InputError`; it also refuses, before anything runs, a shape whose probing would
need more memory than the machine has. ``quiet`` keeps the warnings NumPy and torch raise while normscope
feeds a target degenerate inputs (NaN, zeros, huge values) away from the user.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable
from numbers import Integral
from typing import TypeVar

from .errors import InputError

# Peak memory of a probe, in float64 copies of the input: measured with /usr/bin/time at shape
# (4, 256, 1024) — check on a torch LayerNorm ≈ 32 copies above the interpreter, infer ≈ 24 — plus margin.
COPIES_AT_PEAK = 40
BYTES_PER_ELEMENT = 8  # the probes are float64

F = TypeVar("F", bound=Callable)


def flag_example(flag: str) -> str:
    """``e.g. --shape 2,8,64`` for an option that takes a shape (``e.g. --inputs ids:2,8`` for token ids)."""
    sizes = "2,8" if flag.endswith("ids:") or flag == "--tokens" else "2,8,64"
    return f"e.g. {flag}{'' if flag.endswith(':') else ' '}{sizes}"


def probe_shape(shape, name: str = "shape") -> tuple[int, ...]:
    """``shape`` as a tuple of positive ints (an int is a 1-d shape); one clear InputError otherwise."""
    example = flag_example(name) if name.startswith("--") else f"e.g. {name}=(2, 8, 64)"
    if shape is None:
        raise InputError(f"{name} is required: the input shape to probe with, {example}")
    if isinstance(shape, str):
        raise InputError(f"{name} must be a tuple of sizes, not the string {shorten(shape)}; {example}")
    if isinstance(shape, Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        sizes = list(shape)
    except TypeError:
        raise InputError(f"{name} must be a tuple of sizes; got a {type(shape).__name__}; {example}") from None
    if not sizes:
        raise InputError(f"{name} is empty; {example}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, Integral):
            raise InputError(f"{name} must hold whole numbers; got {shorten(s)} in {shorten(tuple(sizes))}; {example}")
        if s < 1:
            raise InputError(f"{name} sizes must be ≥ 1; got {int(s)} in {shorten(tuple(sizes))}; {example}")
    out = tuple(int(s) for s in sizes)
    check_memory(out)
    return out


def spec_fits(spec, shape: tuple[int, ...]):
    """``spec`` when it can normalize an input of ``shape`` (axes exist, groups divide the channels)."""
    from . import reference
    from .errors import NormscopeError

    try:
        reference.param_shape(shape, spec)
    except NormscopeError as exc:
        raise InputError(f"the expected contract ({spec.summary()}) does not fit shape {shape}: {exc}") from None
    return spec


def probe_bytes(shape: tuple[int, ...]) -> int:
    """Estimated peak memory of probing at ``shape`` (COPIES_AT_PEAK float64 copies of the input)."""
    return math.prod(shape) * BYTES_PER_ELEMENT * COPIES_AT_PEAK


def available_bytes() -> int | None:
    """Memory this process can still use: the least of free RAM, the cgroup's room and RLIMIT_AS."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                limits.append(int(text) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    if not limits:
        try:
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return max(min(limits), 0)


def check_memory(shape: tuple[int, ...]) -> None:
    need = probe_bytes(shape)
    have = available_bytes()
    if have is not None and need > have:
        raise InputError(
            f"probing at shape {shorten(shape)} needs about {human_bytes(need)} of memory ({COPIES_AT_PEAK} float64 "
            f"copies of a {human_bytes(need // COPIES_AT_PEAK)} input) and {human_bytes(have)} is available; use a "
            "smaller shape: the statistics only need the normalized axes at full size, e.g. 2 for the batch axes")


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover


def shorten(value, limit: int = 60, as_text: bool = False) -> str:
    """``repr(value)`` (``str`` with ``as_text``) cut to ``limit`` characters: an error line never echoes a
    huge input."""
    text = str(value) if as_text else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + f"… ({len(text)} characters)"


def quiet(fn: F) -> F:
    """Run ``fn`` with NumPy/torch warnings silenced: degenerate probes make them on purpose."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
