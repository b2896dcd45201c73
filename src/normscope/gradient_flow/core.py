"""``gradflow(model, loss_fn)``: per-parameter and per-layer gradient norms, at the start and after training steps.

``loss_fn(model)`` returns a scalar loss. One backward gives every parameter's gradient norm (``grad_norms``)
and one row per block (``layers``): the blocks are the repeated elements of the model's ModuleLists and
Sequentials (:func:`normscope.sites.dataflow.block_modules`, the same blocks ``scan`` places norms in). A row
holds the gradient norm of each child module's parameters (``parts``), summed into ``attention``, ``mlp``
and ``norm`` columns by the child's name or class, the gradient norm of the residual stream entering the
block (``stream_grad``, from a hook on the block's input) and that input's RMS (``input_rms``). With
``steps > 0`` the optimizer runs that many steps and the same is measured again (``after``).

The user's model is left exactly as it was: parameter and buffer values and objects, ``.grad`` (the same
tensor objects, values unchanged), ``requires_grad`` flags and modes are restored, the optimizer's state too
when one is passed, and the only hooks added are removed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, TargetError
from ..jsonable import document, jsonable, parse

SCHEMA = "normscope.gradflow/1"
COLUMNS = ("attention", "mlp", "norm")
_ATTENTION = re.compile(r"attn|attention", re.I)
_MLP = re.compile(r"mlp|ffn|feed_?forward|intermediate|experts?$|moe", re.I)


# ---------------------------------------------------------------------------------------------- result
@dataclasses.dataclass
class Snapshot:
    """Gradients of one backward: at ``step`` 0 (the model as given) or after ``step`` optimizer steps."""

    step: int
    loss: float
    grad_norms: dict[str, float]
    layers: list[dict[str, Any]]
    no_grad: list[str] = dataclasses.field(default_factory=list)  # trainable parameters the loss did not reach


@dataclasses.dataclass
class GradFlow:
    """What :func:`gradflow` measured. ``grad_norms`` and ``layers`` are at the start; ``after`` is the
    measurement after the optimizer steps (None without steps); ``losses`` the loss at each step."""

    model: str
    snapshots: list[Snapshot]
    losses: list[float]
    optimizer: str | None
    blocks: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def grad_norms(self) -> dict[str, float]:
        return self.snapshots[0].grad_norms

    @property
    def layers(self) -> list[dict[str, Any]]:
        return self.snapshots[0].layers

    @property
    def after(self) -> Snapshot | None:
        return self.snapshots[-1] if len(self.snapshots) > 1 else None

    def column(self, name: str, step: int | None = None) -> list[float | None]:
        """One column of the layer table (``attention``, ``mlp``, ``norm``, ``stream_grad``, ``input_rms``,
        ``total`` or a child name from ``parts``), at the start or at ``step``."""
        snap = self.snapshots[0]
        if step is not None:
            found = [s for s in self.snapshots if s.step == step]
            if not found:
                raise InputError(f"no measurement at step {step}; measured at {[s.step for s in self.snapshots]}")
            snap = found[0]
        return [row.get(name, row["parts"].get(name)) for row in snap.layers]

    def plot(self, path: str | Path, columns: tuple[str, ...] = ("attention", "mlp", "stream_grad")) -> Path:
        """Gradient norm vs layer (log scale), one panel per column, the start solid and after steps dashed."""
        return plot_flows({self.model: self}, path, columns)

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"schema": SCHEMA, "model": self.model, "optimizer": self.optimizer, "blocks": self.blocks,
                         "losses": self.losses, "notes": self.notes,
                         "snapshots": [dataclasses.asdict(s) for s in self.snapshots]})

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GradFlow:
        d = document(d, SCHEMA, "gradflow JSON")
        d = _floats(d)
        try:
            snaps = [Snapshot(**s) for s in d["snapshots"]]
            return cls(model=d["model"], snapshots=snaps, losses=d["losses"], optimizer=d["optimizer"],
                       blocks=d["blocks"], notes=d.get("notes", []))
        except (KeyError, TypeError) as exc:
            raise InputError(f"a {SCHEMA} file is missing or has a malformed field ({exc})") from None

    @classmethod
    def from_json(cls, text: str) -> GradFlow:
        return cls.from_dict(parse(text, "gradflow JSON"))


def _floats(v: Any) -> Any:
    """Undo :func:`jsonable`'s strings for non-finite floats."""
    if isinstance(v, dict):
        return {k: _floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_floats(x) for x in v]
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return v


def plot_flows(flows: Mapping[str, GradFlow], path: str | Path,
               columns: tuple[str, ...] = ("attention", "mlp", "stream_grad"), title: str | None = None) -> Path:
    """Several gradient flows in one figure: one panel per column, one line per flow (after steps dashed)."""
    path = Path(path)
    figure(flows, columns, title).savefig(path, dpi=110)
    return path


def figure(flows: Mapping[str, GradFlow], columns: tuple[str, ...] = ("attention", "mlp", "stream_grad"),
           title: str | None = None):
    """The matplotlib Figure :func:`plot_flows` writes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not flows:
        raise InputError("plot_flows needs at least one GradFlow")
    fig = Figure(figsize=(4.2 * len(columns), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(columns), squeeze=False)[0]
    for ax, col in zip(axes, columns, strict=True):
        for k, (label, flow) in enumerate(flows.items()):
            color = f"C{k % 10}"
            for snap in flow.snapshots:
                ys = [row.get(col, row["parts"].get(col)) for row in snap.layers]
                pts = [(i, y) for i, y in enumerate(ys) if y is not None and math.isfinite(y) and y > 0]
                if not pts:
                    continue
                dashed = snap.step > 0
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker="o", markersize=3,
                        linestyle="--" if dashed else "-",
                        label=f"{label} (step {snap.step})" if dashed else label)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
        ax.set_xlabel("layer")
        ax.set_ylabel("gradient norm" if col != "input_rms" else "RMS")
        ax.set_title(col)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return fig


# ---------------------------------------------------------------------------------------------- blocks
def blocks_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of the model's blocks: repeated, parameterised elements of ModuleLists/Sequentials, the
    outermost ones only (a block's own lists of heads or experts are not blocks), in model order."""
    from ..sites.dataflow import block_modules

    ids = block_modules(model)
    named = [(n, m) for n, m in model.named_modules() if id(m) in ids and any(True for _ in m.parameters())]
    out: list[tuple[str, torch.nn.Module]] = []
    for n, m in named:
        if not any(n.startswith(o + ".") for o, _ in out):
            out.append((n, m))
    return out


def _kind(name: str, module: torch.nn.Module) -> str:
    from ..nn.modules import Norm
    from ..sites.classes import known_class

    if isinstance(module, Norm) or known_class(module):
        return "norm"
    if _ATTENTION.search(name):
        return "attention"
    if _MLP.search(name):
        return "mlp"
    return "other"


def _norm(values: list[float]) -> float | None:
    return math.sqrt(sum(v * v for v in values)) if values else None


# ---------------------------------------------------------------------------------------------- measuring
def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"loss_fn(model) must return a scalar tensor; got {what} (reduce it, e.g. .mean())")
    if loss.grad_fn is None:
        raise InputError("loss_fn(model) returned a tensor with no autograd graph: run the forward without "
                         "torch.no_grad() and do not detach the loss")
    return loss.reshape(())


def _measure(model: torch.nn.Module, loss_fn: Callable, blocks: list[tuple[str, torch.nn.Module]],
             step: int) -> Snapshot:
    stream: dict[int, float] = {}
    rms: dict[int, float] = {}
    handles = []

    def pre_hook(k: int):
        def hook(_module, args, kwargs):
            x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x) or k in rms:
                return  # the first call of a block is measured (a shared block runs more than once)
            rms[k] = float(x.detach().double().pow(2).mean().sqrt())
            if x.requires_grad:
                x.register_hook(lambda g: stream.__setitem__(k, float(g.detach().double().norm())))
        return hook

    try:
        for k, (_, m) in enumerate(blocks):
            handles.append(m.register_forward_pre_hook(pre_hook(k), with_kwargs=True))
        loss = _check_loss(loss_fn(model))
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    grads: dict[str, float] = {}
    no_grad: list[str] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            no_grad.append(name)
        else:
            grads[name] = float(p.grad.detach().double().norm())
    rows = []
    for k, (path, block) in enumerate(blocks):
        parts: dict[str, float] = {}
        cols: dict[str, list[float]] = {c: [] for c in (*COLUMNS, "other")}
        for child_name, child in block.named_children():
            vals = [grads[f"{path}.{child_name}.{n}"] for n, _ in child.named_parameters()
                    if f"{path}.{child_name}.{n}" in grads]
            if vals:
                parts[child_name] = _norm(vals)
                cols[_kind(child_name, child)].extend(vals)
        own = [grads[f"{path}.{n}"] for n, _ in block.named_parameters(recurse=False) if f"{path}.{n}" in grads]
        cols["other"].extend(own)
        every = [v for vs in cols.values() for v in vs]
        rows.append({"layer": k, "block": path, **{c: _norm(cols[c]) for c in COLUMNS}, "total": _norm(every),
                     "stream_grad": stream.get(k), "input_rms": rms.get(k), "parts": parts})
    return Snapshot(step=step, loss=float(loss.detach()), grad_norms=grads, layers=rows, no_grad=no_grad)


def _make_optimizer(optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        return torch.optim.Adam(params, lr=1e-3)
    if isinstance(optimizer, torch.optim.Optimizer):
        mine = {id(p) for p in model.parameters()}
        theirs = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in mine for p in theirs):
            raise InputError("the optimizer holds parameters that are not the model's; pass an optimizer built on "
                             "model.parameters(), or a factory such as lambda ps: torch.optim.SGD(ps, lr=0.1)")
        return optimizer
    if callable(optimizer):
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise InputError(f"optimizer(params) must return a torch.optim.Optimizer; got {type(opt).__name__}")
        return opt
    raise InputError(f"optimizer must be None, a torch.optim.Optimizer or a factory params → Optimizer; got "
                     f"{type(optimizer).__name__}")


def gradflow(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module], torch.Tensor], *, steps: int = 0,
             optimizer=None, train: bool = True, progress=False) -> GradFlow:
    """Gradient norms of every parameter and per block, at the start and after ``steps`` optimizer steps.

    ``loss_fn(model)`` runs the forward and returns a scalar loss. ``optimizer``: None (Adam, lr 1e-3), a
    ``torch.optim.Optimizer`` over the model's parameters (its state is restored afterwards) or a factory
    ``params → Optimizer``. ``train``: measure in training mode (default) or evaluation mode. ``progress``: True
    shows a status line on a terminal's stderr, a callable receives the messages. The model is left exactly as it
    was (see the module docstring).
    """
    from ..model import progress as progress_of
    from ..model import untouched
    from ..model.copies import BIG_MODEL_BYTES

    if not isinstance(model, torch.nn.Module):
        raise InputError(f"gradflow takes a torch.nn.Module; got a {type(model).__name__}")
    if not callable(loss_fn):
        raise InputError(f"loss_fn must be a callable loss_fn(model) -> scalar tensor; got {type(loss_fn).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise InputError(f"steps must be a non-negative integer; got {steps!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise InputError(f"{type(model).__name__} has no parameter with requires_grad=True: nothing to measure")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if steps and size > BIG_MODEL_BYTES:
        raise InputError(f"steps={steps} on a model of {size / 2**30:.1f} GiB: its parameters are too large to be "
                         "copied and restored; measure with steps=0, or train a copy yourself")
    blocks = blocks_of(model)
    notes = [] if blocks else ["no repeated blocks (ModuleList/Sequential elements) found: the layer table is empty"]
    opt_state = None
    saved = [(p, p.grad) for p in model.parameters()]
    snaps: list[Snapshot] = []
    losses: list[float] = []
    opt_name = None
    with untouched(model), progress_of(progress) as say:
        try:
            model.train(train)
            for p, _ in saved:
                p.grad = None
            say("gradients at the start")
            snaps.append(_measure(model, loss_fn, blocks, 0))
            if steps:
                opt = _make_optimizer(optimizer, model)
                opt_name = type(opt).__name__
                if opt is optimizer:
                    opt_state = copy.deepcopy(opt.state_dict())
                for p, _ in saved:
                    p.grad = None
                for i in range(steps):
                    say(f"training step {i + 1}/{steps}")
                    opt.zero_grad(set_to_none=True)
                    loss = _check_loss(loss_fn(model))
                    losses.append(float(loss.detach()))
                    if not math.isfinite(losses[-1]):
                        notes.append(f"the loss became {losses[-1]} at step {len(losses) - 1}; training stopped there")
                        break
                    loss.backward()
                    opt.step()
                for p, _ in saved:
                    p.grad = None
                say(f"gradients after {len(losses)} steps")
                snaps.append(_measure(model, loss_fn, blocks, len(losses)))
        except InputError:
            raise
        except Exception as exc:
            raise TargetError(f"gradflow failed on {type(model).__name__}: {type(exc).__name__}: {exc}") from exc
        finally:
            for p, g in saved:
                p.grad = g
            if opt_state is not None:
                optimizer.load_state_dict(opt_state)
    return GradFlow(model=type(model).__name__, snapshots=snaps, losses=losses, optimizer=opt_name,
                    blocks=[n for n, _ in blocks], notes=notes)
