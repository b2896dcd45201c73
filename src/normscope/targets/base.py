"""The Target protocol: one way to call any normalization implementation.

A target takes a float64 NumPy array of values and a dtype name, runs the implementation on the values
cast to that dtype, and returns the output as float64. It counts its calls, knows which dtypes it
accepts, and, where the framework allows, exposes its parameters, train/eval modes and gradients.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy as np

from ..errors import TargetError, TargetTimeout
from ..precision import DTYPES, dtype_name

DEFAULT_TIMEOUT = 60.0  # seconds one call of a target may take before normscope reports it as hung


class Target:
    """Base class of every adapter. Subclasses implement ``_run`` (and optionally the capabilities)."""

    framework: str = "?"
    differentiable: bool = False
    has_modes: bool = False  # train/eval behaviour (torch modules)
    supported_dtypes: tuple[str, ...] = DTYPES
    timeout: float | None = DEFAULT_TIMEOUT  # per call; None waits forever (CLI: --timeout)

    def __init__(self, description: str):
        self.description = description
        self.calls = 0
        self.output_dtype: str | None = None  # the dtype the last call returned, as a dtype name
        self._accepts: dict[tuple[str, tuple[int, ...]], bool] = {}
        self._reasons: dict[str, str] = {}
        self.input_modifications = 0  # calls after which the target's own input array had changed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description}>"

    # ------------------------------------------------------------------ calling
    def __call__(self, x: np.ndarray, dtype: str = "float64") -> np.ndarray:
        dtype = dtype_name(dtype)
        x = np.array(x, dtype=np.float64)  # a private copy: what the target does to its input stays there
        self.calls += 1
        with self.running_code(f"a {dtype} input of shape {x.shape}"):
            out = run_with_deadline(self, x, dtype)
        out = np.array(out, dtype=np.float64)  # and a copy of the output: the target may reuse its buffer
        if out.shape != x.shape:
            raise TargetError(
                f"{self.description} returned shape {out.shape} for an input of shape {x.shape}; "
                "a normalization returns its input's shape (check --shape)"
            )
        return out

    @contextlib.contextmanager
    def running_code(self, what: str) -> Iterator[None]:
        """Any exception from the target's code (SystemExit included) becomes a TargetError with its words.

        KeyboardInterrupt passes through unchanged: the user stopped the run.
        """
        try:
            yield
        except (TargetError, TargetTimeout, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - the implementation's own failure, whatever it raised
            words = (f"SystemExit({exc.code!r}): the target's code called sys.exit()" if isinstance(exc, SystemExit)
                     else f"{type(exc).__name__}: {exc}")
            raise TargetError(f"{self.description} failed on {what}: {words}") from exc

    def note_input(self, before: np.ndarray, after: np.ndarray) -> None:
        """Record a call after which the array the target was given no longer holds its input."""
        if not np.array_equal(np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64),
                              equal_nan=True):
            self.input_modifications += 1

    def _run(self, x: np.ndarray, dtype: str) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    supports_noncontiguous: bool = False

    def call_noncontiguous(self, x: np.ndarray, dtype: str = "float64") -> np.ndarray:
        """Call with a non-contiguous (strided) view holding the same values (torch targets)."""
        raise TargetError(f"{self.framework} targets have no non-contiguous inputs")

    def buffers_after_training_step(self, x: np.ndarray) -> dict[str, np.ndarray] | None:
        """Running statistics after one training-mode forward on ``x`` (in a private copy), or None."""
        return None

    def accepts(self, dtype: str, shape: tuple[int, ...]) -> bool:
        """Whether the target runs on ``dtype`` inputs of ``shape`` (probed once, then cached)."""
        dtype = dtype_name(dtype)
        key = (dtype, tuple(shape))
        if key not in self._accepts:
            ok = dtype in self.supported_dtypes
            if ok:
                rng = np.random.default_rng(12345)
                try:
                    out = self(rng.normal(size=shape), dtype)
                    ok = bool(np.isfinite(out).any())
                    if not ok:
                        self._reasons[dtype] = "output was not finite"
                except TargetError as exc:
                    ok = False
                    self._reasons[dtype] = str(exc)
            else:
                self._reasons[dtype] = f"{self.framework} targets of this kind do not take {dtype}"
            self._accepts[key] = ok
        return self._accepts[key]

    def rejection(self, dtype: str) -> str:
        return self._reasons.get(dtype_name(dtype), "")

    # ------------------------------------------------------------------ optional capabilities
    @property
    def training(self) -> bool | None:
        return None

    @contextlib.contextmanager
    def mode(self, training: bool) -> Iterator[None]:
        """Run the target in training or evaluation mode inside the block (modules only)."""
        yield

    @property
    def momentum(self) -> float | None:
        """The factor running statistics move by in one training step, where the target states it."""
        return None

    def parameters(self) -> dict[str, np.ndarray]:
        """Parameters the implementation exposes (module parameters, ONNX initializers), as float64."""
        return {}

    def buffers(self) -> dict[str, np.ndarray]:
        """Non-learned state (running statistics), as float64."""
        return {}

    @contextlib.contextmanager
    def perturbed_parameters(self, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray] | None]:
        """Inside the block, the target's own copy of its parameters holds random values (yielded).

        Yields None where the target cannot do this (plain functions). The caller's object is never
        touched: targets that support this work on a private copy.
        """
        yield None

    @contextlib.contextmanager
    def with_buffers(self, values: dict[str, np.ndarray]) -> Iterator[bool]:
        """Inside the block, the private copy's named buffers hold ``values`` (yields False where impossible)."""
        yield False

    def gradients(self, x: np.ndarray, dy: np.ndarray, dtype: str = "float64"):
        """(dx, {parameter name: gradient}) of sum(dy · f(x)), for differentiable targets."""
        raise TargetError(f"{self.description} is not differentiable through normscope")


def run_with_deadline(target: Target, x: np.ndarray, dtype: str):
    """``target._run(x, dtype)``, in a worker thread when the target has a timeout.

    A call still running at the deadline raises :class:`TargetTimeout`; its thread is a daemon and is
    left behind (a thread cannot be stopped from outside), so a hung target never holds up the exit.
    The worker runs in a copy of the caller's context (NumPy's errstate lives there).
    """
    if not target.timeout:
        return target._run(x, dtype)
    import contextvars
    import threading

    box: dict[str, object] = {}
    context = contextvars.copy_context()

    def work():
        try:
            box["out"] = context.run(target._run, x, dtype)
        except BaseException as exc:  # handed to the caller's thread
            box["exc"] = exc

    worker = threading.Thread(target=work, name=f"normscope call {target.calls}", daemon=True)
    worker.start()
    worker.join(target.timeout)
    if worker.is_alive():
        raise TargetTimeout(
            f"{target.description} did not return within {target.timeout:g} s (call {target.calls}, a {dtype} "
            f"input of shape {x.shape}): it hangs or is far too slow; raise the limit with --timeout "
            "(Python: target.timeout), or 0 to wait forever")
    if "exc" in box:
        raise box["exc"]  # type: ignore[misc]
    return box["out"]


def dtype_of(value) -> str | None:
    """The dtype name of an array-like output (None when it has no floating dtype normscope knows)."""
    from ..errors import InputError

    try:
        return dtype_name(getattr(value, "dtype", None) or np.asarray(value).dtype)
    except (InputError, TypeError, ValueError):
        return None


def no_dtype_error(target: Target, tried) -> TargetError:
    """One clear line when a target runs on none of the dtypes tried (usually a shape mismatch)."""
    reasons = [target.rejection(d) for d in tried]
    first = reasons[0] if reasons else "no dtype tried"
    same = all(r.split(" failed on ")[-1].split(": ", 1)[-1] == first.split(" failed on ")[-1].split(": ", 1)[-1]
               for r in reasons)
    detail = first if same else "; ".join(f"{d}: {r}" for d, r in zip(tried, reasons, strict=True))
    own_words = " ".join(r.split(" failed on ")[-1].split(": ", 1)[-1] for r in reasons)  # the target's message
    about_shape = re.search(r"shape|size|dimension|\bdims?\b|broadcast|mismatch", own_words, re.IGNORECASE)
    hint = "" if "check --shape" in detail or not about_shape else " (check --shape)"
    return TargetError(f"{target.description} ran on none of {', '.join(tried)}: {detail}{hint}")


def check_dtype_list(dtypes) -> tuple[str, ...] | None:
    if dtypes is None:
        return None
    if isinstance(dtypes, str):
        dtypes = [d.strip() for d in dtypes.split(",") if d.strip()]
    out = tuple(dict.fromkeys(dtype_name(d) for d in dtypes))  # a repeated dtype is run once
    if not out:
        from ..errors import InputError

        raise InputError("no dtype given; e.g. --dtypes float32,bfloat16")
    return out
