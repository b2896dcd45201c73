"""What every inference step needs: the target, the probe shape and dtype, the random stream, progress.

A :class:`Probe` holds only what does not change while inference runs; each step's results (the noise floor,
the groups, the recovered γ/β …) are values it returns and later steps take as arguments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from ... import layout
from ...dtypes import DTYPES
from ...errors import InputError, TargetError
from ...targets import Target
from ...targets.base import no_dtype_error

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Probe:
    """The target under inference and the fixed settings of its experiments.

    ``dtype`` is the dtype the structure is probed in (float64 where the target accepts it, else float32);
    ``accepted`` every dtype the target runs at the probe shape; ``rng`` the one random stream the
    experiments draw from, in the order :func:`~normscope.probe.infer.infer` runs them.
    """

    target: Target
    shape: tuple[int, ...]
    accepted: tuple[str, ...]
    dtype: str
    seed: int
    rng: np.random.Generator
    progress: Progress

    @classmethod
    def open(cls, target: Target, shape: tuple[int, ...], dtypes, seed: int, progress: Progress | None) -> Probe:
        """Validate the seed, find the dtypes the target accepts (a float32 or float64 among them) and pick the
        probe dtype."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"seed must be an integer ≥ 0; got {seed!r}")
        allowed = dtypes or DTYPES
        accepted = tuple(d for d in allowed if target.accepts(d, shape))
        if not accepted:
            raise no_dtype_error(target, allowed)
        if not {"float64", "float32"} & set(accepted):
            raise TargetError(
                f"{target.description} ran only on {', '.join(accepted)}; inference probes the structure "
                "in float32 or float64 (its experiments need their range and precision): allow one of them")
        dtype = "float64" if "float64" in accepted else "float32"
        _full_precision(target, shape, dtype)
        return cls(target, shape, accepted, dtype, seed, np.random.default_rng(seed),
                   progress or (lambda _msg: None))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def run(self, x: np.ndarray, dtype: str | None = None) -> np.ndarray:
        """The target's output on ``x`` at ``dtype`` (default: the probe dtype)."""
        return self.target(x, dtype or self.dtype)


def _full_precision(target: Target, shape: tuple[int, ...], dtype: str) -> None:
    """A target that answers a float32/float64 input in 16 bits computes at a fixed low precision (flax's
    ``dtype=jnp.float16``, an autocast region inside the callable): its ε, variance estimator and cast order sit
    below that resolution, and every experiment would read rounding as structure. Say so instead of guessing."""
    target(np.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape), dtype)
    out = target.output_dtype
    if out in ("bfloat16", "float16"):
        raise TargetError(
            f"{target.description} returns {out} for a {dtype} input: it computes at a fixed {out} whatever it is "
            f"given (e.g. flax's dtype=jnp.{out}, or an autocast inside it), so the experiments cannot resolve ε, "
            f"the variance estimator or the cast order below {out}'s rounding; infer the same code with a float32 "
            "compute dtype (flax: dtype=None, the parameters' dtype), then check this one against that contract")


def rel(a: np.ndarray, b: np.ndarray, scale: float | None = None) -> float:
    """max |a − b| relative to the RMS of b (or ``scale``); inf when a difference is not finite."""
    with np.errstate(all="ignore"):
        s = scale if scale is not None else float(np.sqrt(np.mean(np.square(b))))
        d = np.abs(a - b)
        if not np.all(np.isfinite(d)):
            return math.inf
        return float(d.max() / max(s, 1e-300))


def natural(axes, ndim: int, channel_style: bool) -> list[int]:
    """Report axes negative (trailing features) or non-negative (channel-first layouts)."""
    return sorted(axes) if channel_style else sorted(a - ndim for a in axes)


def channel_affine(probe: Probe, axis: int, x: np.ndarray, noise: float):
    """A, B of y = A·x + B per index of ``axis``, from ±x around 0 (x nonzero); None when the output is not
    such a map (beyond ``1e3·noise`` of its scale)."""
    y1, y2, y0 = probe.run(x), probe.run(-x), probe.run(np.zeros(probe.shape))
    with np.errstate(all="ignore"):
        A = (y1 - y2) / (2 * x)
    B = (y1 + y2) / 2
    scale = max(float(np.max(np.abs(y1))), 1e-300)
    if not (np.all(np.isfinite(A)) and np.all(np.isfinite(B))):
        return None
    tol = max(1e3 * noise, 1e-9) * scale
    if float(np.max(np.abs(y0 - B))) > tol:
        return None
    others = tuple(a for a in range(probe.ndim) if a != axis)
    A_c, B_c = A.mean(axis=others), B.mean(axis=others)
    if (float(np.max(np.abs(A * x - layout.broadcast(A_c, probe.shape, (axis,)) * x))) > tol
            or float(np.max(np.abs(B - layout.broadcast(B_c, probe.shape, (axis,))))) > tol):
        return None
    return A_c, B_c
