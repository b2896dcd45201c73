"""The Target protocol: one way to call any normalization implementation.

A target takes float64 NumPy arrays of values, one per named input, and a dtype name, runs the
implementation on the values cast to that dtype (on the target's ``device``), and returns every named output
as float64 together with the dtype the implementation returned it in (:class:`Outputs`). ``target(x, dtype)``
is the single-input shortcut: the first output's values. A target counts its calls and declares what it can
do in one place, its :class:`Capabilities`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import DTYPES, dtype_name
from ..errors import DeadlinePassed, InputError, TargetError, TargetRaised, TargetTimeout
from ..inputs import shorten

DEFAULT_TIMEOUT = 60.0  # seconds one call of a target may take before normscope reports it as hung
REDRAW_SEED = 0  # the stream :func:`redraw` draws from: one set of values wherever a copy is re-drawn


def redraw(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The values re-drawn parameters take, by name in the order given: uniform in ±[0.5, 1.5] from one fixed
    stream. A contract does not depend on γ/β's values, and values away from zero (a γ of zero moves no output)
    and from one (a γ of ones hides the order of γ and the cast) hide no field. The one home of the re-draw:
    :meth:`Target.redrawn_parameters` (``infer``) and ``model.redrawn`` (scan's and diff's private copies) take
    their values here, so the copy ``infer`` probes is the copy ``scan`` probes."""
    rng = np.random.default_rng(REDRAW_SEED)
    return {name: rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1.0, 1.0], size=shape)
            for name, shape in shapes.items()}


@dataclass(frozen=True)
class Capabilities:
    """What a kind of target can do beyond being called; the probes read these and nothing else."""

    dtypes: tuple[str, ...] = DTYPES  # the dtypes it may be called at (each is still probed once: ``accepts``)
    differentiable: bool = False  # ``gradients`` works
    modes: bool = False  # train/eval behaviour (``mode``, ``buffers_after_training_step``): torch modules
    noncontiguous: bool = False  # ``call_noncontiguous`` feeds a strided view
    parameters: bool = False  # ``parameters`` lists them and ``perturbed_parameters`` can change a private copy
    # ``parameters`` and ``buffers`` hold every tensor the target applies (a module's state dict): a γ or β the
    # contract names must be one of them, or a checkpoint's has nowhere to go
    whole_state: bool = False


@dataclass(frozen=True)
class Outputs:
    """The outputs of one call, by name, as float64 copies, each with the dtype the implementation returned.

    ``dtypes[name]`` is None for an output whose dtype is not one normscope knows (an integer index, say).
    """

    values: dict[str, np.ndarray]
    dtypes: dict[str, str | None] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.values)

    @property
    def value(self) -> np.ndarray:
        """The first output (a normalization's normalized values)."""
        return next(iter(self.values.values()))

    @property
    def dtype(self) -> str | None:
        """The dtype the first output came back in."""
        return self.dtypes.get(self.names[0])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]


def pick_outputs(out, names: Sequence[str], description: str) -> list:
    """The raw values of the declared outputs ``names`` from what an implementation returned.

    A dict is read by name; a tuple or list by position (with one declared output its first element is the
    output, so ``return y, None`` and ``return y, mean, rstd`` work); anything else is the single output.
    """
    if isinstance(out, Mapping):
        missing = [n for n in names if n not in out]
        if missing:
            raise TargetError(f"{description} returned a dict without {', '.join(map(repr, missing))} "
                              f"(it has {', '.join(map(repr, out)) or 'no keys'})")
        return [out[n] for n in names]
    if isinstance(out, tuple | list):
        if len(out) < len(names) or not out:
            raise TargetError(f"{description} returned {len(out)} values; its declared outputs are "
                              f"{', '.join(names)}")
        return list(out[:len(names)])
    if len(names) != 1:
        raise TargetError(f"{description} returned one value; its declared outputs are {', '.join(names)}")
    return [out]


def check_names(names: Sequence[str], what: str) -> tuple[str, ...]:
    """Input or output names as a tuple of distinct, non-empty strings (one clear InputError otherwise)."""
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise InputError(f"{what} must be distinct non-empty names, e.g. ('x', 'residual'); got {names!r}")
    return names


class Target:
    """Base class of every adapter. Subclasses implement ``_run`` and declare ``capabilities``."""

    framework: str = "?"
    capabilities: Capabilities = Capabilities()
    timeout: float | None = DEFAULT_TIMEOUT  # per call; None waits forever (CLI: --timeout)
    _worker: _Worker | None = None  # the thread every call runs on (with a timeout); made at the first call

    def __init__(self, description: str, inputs: Sequence[str] = ("x",), outputs: Sequence[str] = ("y",),
                 device: object = "cpu"):
        self.description = description
        self.inputs = check_names(inputs, "inputs")
        self.outputs = check_names(outputs, "outputs")
        self.device = device  # where the implementation's tensors live ("cpu", torch.device("cuda:0"), ...)
        self.calls = 0
        self._last_dtype: str | None = None
        self._accepts: dict[tuple[str, tuple[int, ...]], bool] = {}
        self._reasons: dict[str, str] = {}
        self.input_modifications = 0  # calls after which the target's own input array had changed

    # ------------------------------------------------------------------ declared capabilities
    @property
    def supported_dtypes(self) -> tuple[str, ...]:
        return self.capabilities.dtypes

    @property
    def differentiable(self) -> bool:
        return self.capabilities.differentiable

    @property
    def has_modes(self) -> bool:
        return self.capabilities.modes

    @property
    def supports_noncontiguous(self) -> bool:
        return self.capabilities.noncontiguous

    @property
    def output_dtype(self) -> str | None:
        """Deprecated: the dtype the last call returned its first output in; use ``run(...).dtype``."""
        return self._last_dtype

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description}>"

    # ------------------------------------------------------------------ calling
    def __call__(self, x: np.ndarray, dtype: str = "float64") -> np.ndarray:
        """The single-input shortcut: the first output of the implementation on ``x`` at ``dtype``, as float64."""
        if len(self.inputs) != 1:  # the caller's mistake, not the target's refusal: no probe may read it as one
            raise InputError(f"{self.description} takes {len(self.inputs)} inputs ({', '.join(self.inputs)}); infer "
                             "and check probe one (fold the others into constants or initializers); from Python, "
                             "call target.run({name: values, ...}, dtype)")
        x = np.asarray(x, dtype=np.float64)  # run() takes the private copy
        out = self.run({self.inputs[0]: x}, dtype).value
        if out.shape != x.shape:
            raise TargetError(
                f"{self.description} returned shape {out.shape} for an input of shape {x.shape}; "
                "a normalization returns its input's shape (check --shape)"
            )
        return out

    def run(self, inputs: Mapping[str, np.ndarray], dtype: str = "float64") -> Outputs:
        """Every output of the implementation on the named ``inputs`` at ``dtype``, with the dtypes returned."""
        dtype = dtype_name(dtype)
        if not isinstance(inputs, Mapping):
            raise InputError(f"run() takes a dict of inputs by name ({', '.join(self.inputs)}); "
                             f"got a {type(inputs).__name__}")
        if set(inputs) != set(self.inputs):
            raise InputError(f"{self.description} takes the inputs {', '.join(self.inputs)}; got "
                             f"{', '.join(map(str, inputs)) or 'none'}")
        # private copies: what the target does to its inputs stays there
        given = {n: np.array(inputs[n], dtype=np.float64) for n in self.inputs}
        self.calls += 1
        shapes = ", ".join(str(v.shape) for v in given.values())
        with self.running_code(f"a {dtype} input of shape {shapes}"):
            out = run_with_deadline(self, given, dtype)
        # and copies of the outputs: the target may reuse its buffers
        out = Outputs({n: np.array(v, dtype=np.float64) for n, v in out.values.items()}, dict(out.dtypes))
        self._last_dtype = out.dtype
        return out

    @contextlib.contextmanager
    def running_code(self, what: str) -> Iterator[None]:
        """Any exception from the target's code (SystemExit included) becomes a :class:`TargetRaised` (a
        TargetError) with its words: its type and the first line of its message.

        KeyboardInterrupt passes through unchanged: the user stopped the run.
        """
        try:
            yield
        except (TargetError, TargetTimeout, KeyboardInterrupt, DeadlinePassed):
            raise
        except BaseException as exc:  # noqa: BLE001 - the implementation's own failure, whatever it raised
            if isinstance(exc, SystemExit):
                kind, line = "SystemExit", f"the target's code called sys.exit({exc.code!r})"
                words = f"SystemExit({exc.code!r}): the target's code called sys.exit()"
            else:
                kind, words = type(exc).__name__, f"{type(exc).__name__}: {exc}"
                line = next((t.strip() for t in str(exc).splitlines() if t.strip()), "")
            raise TargetRaised(f"{self.description} failed on {what}: {words}", kind, line, what) from exc

    def note_input(self, before, after) -> None:
        """Record a call after which an array the target was given no longer holds its input.

        ``before``/``after`` are one array each, or lists of arrays (one per input); a call counts once.
        """
        pairs = zip(before, after, strict=True) if isinstance(before, list) else [(before, after)]
        if any(not np.array_equal(np.asarray(b, dtype=np.float64), np.asarray(a, dtype=np.float64), equal_nan=True)
               for b, a in pairs):
            self.input_modifications += 1

    def outputs_from(self, out, to_numpy) -> Outputs:
        """The declared outputs in what the implementation returned, as NumPy arrays with their dtypes."""
        raw = pick_outputs(out, self.outputs, self.description)
        return Outputs({n: to_numpy(v) for n, v in zip(self.outputs, raw, strict=True)},
                       {n: dtype_of(v) for n, v in zip(self.outputs, raw, strict=True)})

    def _run(self, inputs: dict[str, np.ndarray], dtype: str) -> Outputs:  # pragma: no cover - abstract
        """The implementation on float64 ``inputs`` (by name) cast to ``dtype``; values as NumPy arrays."""
        raise NotImplementedError

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
            ok = dtype in self.capabilities.dtypes
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
    def redrawn_parameters(self) -> Iterator[dict[str, np.ndarray] | None]:
        """Inside the block, the target's own copy holds its vector parameters re-drawn by :func:`redraw`
        (yielded by name; scalars, such as a learned ε, keep their values): the copy ``infer`` probes when the
        parameters the target holds hide its structure (a γ of zero, a standard initialisation, moves no output).

        Yields None where the target cannot do this (plain functions) or holds no vector parameter. The caller's
        object is never touched: targets that support this work on a private copy.
        """
        yield None

    @contextlib.contextmanager
    def with_buffers(self, values: dict[str, np.ndarray]) -> Iterator[bool]:
        """Inside the block, the private copy's named buffers hold ``values`` (yields False where impossible)."""
        yield False

    def gradients(self, x: np.ndarray, dy: np.ndarray, dtype: str = "float64"):
        """(dx, {parameter name: gradient}) of sum(dy · f(x)), for differentiable targets."""
        raise TargetError(f"{self.description} is not differentiable through normscope")


class _Worker:
    """One long-lived daemon thread that runs a target's calls one after another.

    Every call of a target runs on the same thread (not a fresh one per call), so a library whose state is tied
    to the thread that created it (a compile cache, a handle, a per-thread stream) sees one thread throughout.
    A call still running at its deadline leaves this worker behind (a thread cannot be stopped from outside);
    the target's next call gets a new worker. A worker ends when its target is collected (or, left behind, when
    its hung call returns).
    """

    def __init__(self, name: str):
        import queue
        import threading

        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, done, box = job
            try:
                box["out"] = fn()
            except BaseException as exc:  # handed to the caller's thread
                box["exc"] = exc
            finally:
                done.set()
                job = fn = done = box = None  # nothing of the call (its target) is held while waiting

    def run(self, fn, timeout: float) -> dict[str, object] | None:
        """``fn()``'s result (``{"out": …}`` or ``{"exc": …}``), or None when it is still running at ``timeout``."""
        import threading

        done, box = threading.Event(), {}
        self.jobs.put((fn, done, box))
        return box if done.wait(timeout) else None


def run_with_deadline(target: Target, inputs: dict[str, np.ndarray], dtype: str) -> Outputs:
    """``target._run(inputs, dtype)``, on the target's worker thread when it has a timeout.

    A call still running at the deadline raises :class:`TargetTimeout`; its thread is a daemon and is
    left behind (a thread cannot be stopped from outside), so a hung target never holds up the exit. Every call
    of one target runs on one long-lived worker (:class:`_Worker`), in a copy of the caller's context (NumPy's
    errstate lives there).
    """
    if not target.timeout:
        return target._run(inputs, dtype)
    import contextvars
    import weakref

    context = contextvars.copy_context()
    worker = getattr(target, "_worker", None)
    if worker is None or not worker.thread.is_alive():
        worker = target._worker = _Worker(f"normscope calls of {target.description}"[:60])
        # the worker ends with its target (it holds no reference to it): 50 targets no longer leave 50 threads
        weakref.finalize(target, worker.jobs.put, None)
    box = worker.run(lambda: context.run(target._run, inputs, dtype), target.timeout)
    shapes = ", ".join(str(v.shape) for v in inputs.values())
    if box is None:
        worker.jobs.put(None)  # the hung worker ends if its call ever returns; the next call gets a fresh one
        target._worker = None
        raise TargetTimeout(
            f"{target.description} did not return within {target.timeout:g} s (call {target.calls}, a {dtype} "
            f"input of shape {shapes}): it hangs or is far too slow; raise the limit with --timeout "
            "(Python: target.timeout), or 0 to wait forever")
    if "exc" in box:
        raise box["exc"]  # type: ignore[misc]
    return box["out"]


def dtype_of(value) -> str | None:
    """The dtype name of an array-like output (None when it has no floating dtype normscope knows)."""
    dtype = getattr(value, "dtype", None)
    try:
        return dtype_name(dtype if dtype is not None else np.asarray(value).dtype)
    except (InputError, TypeError, ValueError):
        pass
    try:  # a framework's own dtype object, named after the framework ("mlx.core.float32")
        return dtype_name(str(dtype).rsplit(".", 1)[-1]) if dtype is not None else None
    except (InputError, TypeError, ValueError):
        return None


def no_dtype_error(target: Target, tried) -> TargetError:
    """One clear line when a target runs on none of the dtypes tried (usually a shape mismatch)."""
    reasons = [target.rejection(d) for d in tried]
    first = reasons[0] if reasons else "no dtype tried"
    same = all(r.split(" failed on ")[-1].split(": ", 1)[-1] == first.split(" failed on ")[-1].split(": ", 1)[-1]
               for r in reasons)
    by_reason: dict[str, list[str]] = {}  # the dtypes that failed alike, named once
    for d, r in zip(tried, reasons, strict=True):
        by_reason.setdefault(r, []).append(d)
    detail = first if same else "; ".join(f"{', '.join(ds)}: {shorten(r, 240, as_text=True)}"
                                          for r, ds in by_reason.items())
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
        raise InputError("no dtype given; e.g. --dtypes float32,bfloat16")
    return out
