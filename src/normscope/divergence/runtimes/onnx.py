"""An ONNX candidate in ``diff``: its intermediate values mapped to the torch sites, and teacher forcing by subgraph.

The whole graph runs once on onnxruntime with every intermediate value exposed as an output; the exporter's
node-name scopes (``/m/encoder/layer.0/attention/output/LayerNorm/...``) map each value to a torch site
(``encoder.layer.0.attention.output.LayerNorm``, a wrapper prefix allowed): that is the propagated error.

The site's *own* error: the nodes of the site's scope are extracted as a model of their own (:class:`Subgraphs`),
its inputs being the values the scope consumes from outside (``Constant`` nodes outside the scope that feed it
are copied in, initializers are carried), its output the scope's last value; each input is fed with the
reference's tensor of the same shape among the torch call's arguments (teacher forcing). Where that mapping is
not one-to-one, or onnxruntime cannot build the subgraph, the site says why (``own_missing``) and is judged on
its propagated error. Sessions are cached per model, scope and input shapes (process-wide, a bounded LRU).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import InputError, TargetError
from ...report.numbers import sig
from ..candidate import GraphCandidate, NotMeasured
from ..execution import Memo, Record

#: the sessions of the last ONNX model's sites, by (model key, scope, output): a repeated diff of the same model
#: builds none; another model replaces them (their weights are not held twice over)
_CACHE: dict[tuple, Any] = {}


#: ops whose output is not a constant even when their inputs are
_VARIABLE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
             "If", "Loop", "Scan"}


def is_onnx(obj) -> bool:
    if isinstance(obj, bytes | bytearray):
        return True
    if isinstance(obj, str | Path):
        return str(obj).endswith(".onnx")
    return type(obj).__name__ == "ModelProto"


def _scope(node) -> str | None:
    """A node's scope, dotted (``m.encoder.layer.0.attention``), or None for a node the exporter did not scope."""
    if "/" not in node.name:
        return None
    return node.name.strip("/").rsplit("/", 1)[0].replace("/", ".")


class NotExtractable(Exception):
    """A site whose own error cannot be measured on the ONNX candidate; the message says why."""


def _load(model_obj):
    try:
        import onnx
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise InputError(f"an ONNX candidate needs onnx and onnxruntime ({exc})") from None
    if isinstance(model_obj, str | Path):
        path = Path(model_obj)
        if not path.is_file():
            raise InputError(f"no such ONNX file: {model_obj}")
        st = os.stat(path)
        proto = _parsed(lambda: onnx.load(str(path)), str(model_obj))
        return proto, str(model_obj), ("path", str(path.resolve()), st.st_mtime_ns, st.st_size)
    if isinstance(model_obj, bytes | bytearray):
        data = bytes(model_obj)
        proto = _parsed(lambda: onnx.load_from_string(data), "the ONNX bytes")
        return proto, "ONNX model (bytes)", ("sha1", hashlib.sha1(data).hexdigest())
    proto = onnx.ModelProto()
    proto.CopyFrom(model_obj)
    return proto, f"ONNX model {proto.graph.name or ''}".strip(), \
        ("sha1", hashlib.sha1(proto.SerializeToString()).hexdigest())


def _parsed(load, what: str):
    """The ModelProto ``load()`` parses, or one InputError naming ``what`` (a corrupt or non-ONNX file)."""
    try:
        proto = load()
    except Exception as exc:  # protobuf's DecodeError and friends
        raise InputError(f"{what}: not an ONNX model ({type(exc).__name__}: {exc})") from None
    if not proto.graph.node or not proto.ir_version:
        raise InputError(f"{what}: not an ONNX model (no graph nodes; is it an ONNX file?)")
    return proto


def scope_outputs(nodes: list[tuple[str | None, list[str], list[str]]], graph_out: set[str]) -> dict[str, list[str]]:
    """Scope → the values it hands out, in production order: produced by its nodes and read outside it (or a graph
    output). ``nodes``: (scope, inputs, outputs) in graph order, for any runtime's graph (ONNX, OpenVINO). A
    module returning several tensors (a rotary embedding's cos and sin) has several; a scope whose values are all
    read inside it falls back to its last node's first output (its parents' scopes end with that node too)."""
    produced: dict[str, str] = {}  # value → the scope of its producer
    order: list[str] = []
    scope_last: dict[str, str] = {}  # scope → the first output of its last node
    for sc, _, outputs in nodes:
        if sc is None:
            continue
        if outputs:
            parts = sc.split(".")
            for k in range(1, len(parts) + 1):
                scope_last[".".join(parts[:k])] = outputs[0]
        for o in outputs:
            if o:
                produced[o] = sc
                order.append(o)
    readers: dict[str, list[str | None]] = {}
    for sc, inputs, _ in nodes:
        for i in inputs:
            if i in produced:
                readers.setdefault(i, []).append(sc)

    def inside(sc: str | None, scope: str) -> bool:
        return sc is not None and (sc == scope or sc.startswith(scope + "."))

    out: dict[str, list[str]] = {}
    for v in order:
        sc = produced[v]
        parts = sc.split(".")
        for k in range(1, len(parts) + 1):
            scope = ".".join(parts[:k])
            if v in graph_out or any(not inside(r, scope) for r in readers.get(v, ())):
                out.setdefault(scope, []).append(v)
    for scope, last in scope_last.items():
        out.setdefault(scope, [last])
    return out


def _scope_outputs(g) -> dict[str, list[str]]:
    """:func:`scope_outputs` of an ONNX graph (its Constant nodes aside)."""
    nodes = [(None if node.op_type == "Constant" else _scope(node), list(node.input), list(node.output))
             for node in g.node]
    return scope_outputs(nodes, {o.name for o in g.output})


def run_candidate(model_obj, args, kwargs) -> tuple[dict[str, Any], dict[str, list[str]], str, Subgraphs]:
    """Every intermediate value of the ONNX graph run on onnxruntime, node scope → the values it hands out
    (:func:`_scope_outputs`), a description, and the :class:`Subgraphs` of the (unmodified) graph."""
    import onnx
    import onnxruntime as ort

    proto, desc, key = _load(model_obj)  # a private copy: its outputs are extended for this run, then restored
    g = proto.graph
    declared = len(g.output)
    existing = {o.name for o in g.output}
    initial = {i.name for i in g.initializer}
    for node in g.node:
        if node.op_type == "Constant" or not node.output:
            continue
        for o in node.output:
            if o and o not in existing and o not in initial:
                g.output.append(onnx.ValueInfoProto(name=o))
                existing.add(o)
    feeds = {}
    names = [i.name for i in g.input if i.name not in initial]
    flat = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    if isinstance(kwargs, dict):
        for k in names:
            if k in kwargs and isinstance(kwargs[k], torch.Tensor):
                feeds[k] = kwargs[k].numpy()
    if not feeds:
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if len(tensors) < len(names):
            raise InputError(f"the ONNX model takes {len(names)} inputs ({', '.join(names)}); "
                             f"got {len(tensors)} tensors")
        feeds = {n: t.numpy() for n, t in zip(names, tensors, strict=False)}
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), _options(), providers=["CPUExecutionProvider"])
        del g.output[declared:]
        outs = sess.run(None, feeds)
    except Exception as exc:
        raise TargetError(f"onnxruntime could not run the candidate: {type(exc).__name__}: {exc}") from None
    subgraphs = Subgraphs(proto, key)
    values = {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}
    subgraphs.meta = {k: (v.dtype, tuple(v.shape), _fingerprint(v)) for k, v in {**feeds, **values}.items()
                      if isinstance(v, np.ndarray)}
    return values, _scope_outputs(g), desc, subgraphs


def _fingerprint(v) -> np.ndarray:
    """16 elements of a value at fixed, evenly spread flat positions (float64): enough to tell which of several
    tensors of one shape a value is, without keeping it."""
    flat = np.asarray(v).reshape(-1)
    if flat.size == 0:
        return np.zeros(0)
    return flat[np.linspace(0, flat.size - 1, min(16, flat.size)).astype(np.int64)].astype(np.float64)


def _options(threads: int = 0):
    """Quiet sessions whose worker threads sleep when idle: onnxruntime's default spin-wait after each run would
    take the cores from the torch reference running between the site's subgraphs."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def records(values, scope_out: dict[str, list[str]], ref_paths: list[str], record) -> list:
    """Candidate records keyed by torch path: scope == path, or scope ending in '.' + path (a wrapper prefix), or
    the path ending in '.' + scope (the exporter dropped a wrapper level) where that is unambiguous, else the scope
    matched by structure (:func:`structural`: a level skipped or renamed in the middle of the path);
    each record's ``module`` is (the ONNX scope it came from, the value's name) (teacher forcing extracts it). A
    scope that hands out several floating values keeps them all as ``alternatives``: the one the reference's output
    is compared with is chosen by shape and value when the reference runs (:func:`choose`)."""
    out = []
    # a scope that skips the path's leading levels (an exporter that drops a wrapper module: "decoder.layers.0"
    # for "model.decoder.layers.0") is the path's only when no other path ends with it
    claims: dict[str, list[str]] = {}
    for path in ref_paths:
        for scope in scope_out:
            if path and path.endswith("." + scope):
                claims.setdefault(scope, []).append(path)
    chosen: dict[str, str] = {}  # path → scope, by name
    for path in ref_paths:
        if not path:
            continue
        best = None
        for scope in scope_out:
            if (scope == path or scope.endswith("." + path)) and (best is None or len(scope) < len(best)):
                best = scope
        if best is None:
            skipped = [sc for sc, paths in claims.items() if paths == [path]]
            if skipped:
                best = max(skipped, key=len)
        if best is not None:
            chosen[path] = best
    taken = set(chosen.values())
    for path, scope in structural(list(scope_out), ref_paths, {sc: p for p, sc in chosen.items()}).items():
        if path not in chosen and scope not in taken:
            chosen[path] = scope
    for path in ref_paths:
        if path not in chosen:
            continue
        best = (chosen[path], scope_out[chosen[path]])
        options = []
        for name in best[1]:
            if name not in values:
                continue
            try:
                t = torch.from_numpy(np.asarray(values[name]).copy())
            except TypeError:
                continue
            if t.is_floating_point():
                options.append(((best[0], name), t))
        if options:
            r = record(path, 0, options[-1][0], options[-1][1])  # the last value by default, as before
            r.alternatives = options if len(options) > 1 else None
            out.append(r)
    return out


def structural(scopes: list[str], ref_paths: list[str], anchors: dict[str, str] | None = None) -> dict[str, str]:
    """Module path → scope, matched by the structure of both trees where the names do not match outright: an
    exporter whose scopes follow the *calls* leaves out a level the forward never called (OPT's causal LM calls
    ``self.model.decoder``: its scopes read ``decoder.layers.0`` under the wrapper for ``model.decoder.layers.0``),
    and a level may be renamed. Scopes are mapped from the outside in: a scope level is the module under its
    parent scope's module whose own name is that level's — its direct child, else the one descendant of that name
    (a skipped level); a level with no such module (a wrapper's, a renamed one) maps to nothing and its children
    are looked for under its parent's module. A renamed level that holds two or more mapped scopes is their
    deepest common module. ``anchors``: scopes already matched by name (scope → path). Never a guess: two
    candidates for a level, or two scopes for one path, leave it unmatched."""
    paths = [p for p in ref_paths if p]
    known = set(paths)
    by_last: dict[str, list[str]] = {}
    for p in paths:
        by_last.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    levels = sorted(set(scopes), key=lambda sc: sc.count("."))

    def descend(anchors: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        mapped: dict[str, str] = {}  # scope → path
        base: dict[str, str] = {"": ""}  # scope → the module its children are looked for under
        for scope in levels:
            parent, _, level = scope.rpartition(".")
            under = base.get(parent, "")
            if scope in anchors:
                hit = anchors[scope]
            else:
                direct = f"{under}.{level}" if under else level
                if direct in known:
                    hit = direct
                else:
                    found = [p for p in by_last.get(level, ()) if not under or p.startswith(under + ".")]
                    hit = found[0] if len(found) == 1 else None
            if hit is not None:
                mapped[scope] = hit
            base[scope] = hit if hit is not None else under
        return mapped, base

    anchors = dict(anchors or {})
    for _ in range(4):  # a renamed level found gives its children a module to be looked for under
        mapped, base = descend(anchors)
        renamed = {}
        for scope in reversed(levels):
            if scope in mapped:
                continue
            below = {mapped[sc] for sc in levels if sc in mapped and sc.rpartition(".")[0] == scope}
            common = _common(sorted(below)) if len(below) >= 2 else ""
            if common in known and common != base.get(scope.rpartition(".")[0], "") and common not in below:
                renamed[scope] = common
        if not renamed or all(anchors.get(k) == v for k, v in renamed.items()):
            mapped.update(renamed)
            break
        anchors.update(renamed)
    by_path: dict[str, list[str]] = {}
    for scope, path in mapped.items():
        by_path.setdefault(path, []).append(scope)
    return {path: scs[0] for path, scs in by_path.items() if len(scs) == 1}


def _common(paths: list[str]) -> str:
    """The longest dotted prefix every path shares ('' when none)."""
    parts = [p.split(".") for p in paths]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def choose(r, y: torch.Tensor) -> None:
    """Among a record's alternatives (a scope handing out several values), the one of the reference output's shape
    nearest it in value becomes the record's output and the subgraph it extracts."""
    if not r.alternatives:
        return
    same = [(key, t) for key, t in r.alternatives if list(t.shape) == list(y.shape)]
    if not same:
        return
    yd = y.detach().double().reshape(-1)
    scale = float(yd.norm()) or 1.0
    key, t = min(same, key=lambda kt: float((kt[1].double().reshape(-1) - yd).norm()) / scale)
    r.module, r.output, r.version, r.shape, r.alternatives = key, t, t._version, list(t.shape), None


class Subgraphs:
    """One torch site's ONNX nodes as a model of their own, run on the reference's inputs (teacher forcing)."""

    def __init__(self, proto, key: tuple):
        self.proto, self.key = proto, key
        g = proto.graph
        self.inits = {i.name: i for i in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.index = {id(n): i for i, n in enumerate(g.node)}
        self._constant: dict[str, bool] = {}
        self.scoped = [(_scope(n), n) for n in g.node]
        self.meta: dict[str, tuple[np.dtype, tuple[int, ...], np.ndarray]] = {}

    def extract(self, scope: str, out_name: str):
        """(the site's subgraph as a ModelProto, its input names in order); raises :class:`NotExtractable`."""
        import onnx
        from onnx import helper

        nodes = [n for sc, n in self.scoped if sc is not None and (sc == scope or sc.startswith(scope + "."))]
        produced = {o for n in nodes for o in n.output}
        if out_name not in produced:
            raise NotExtractable("the scope's output is produced outside it")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
            raise NotExtractable("the scope holds a control-flow node (If/Loop/Scan)")
        external: list[str] = []
        for n in nodes:
            for i in n.input:
                if i and i not in produced and i not in self.inits and i not in external:
                    external.append(i)
        consts: dict[int, Any] = {}
        inputs = []
        for name in external:
            if self.constant(name):  # a constant (or an Identity of a shared initializer) read from outside
                self._chain(name, consts)
            else:
                inputs.append(name)
        nodes = [consts[k] for k in sorted(consts)] + nodes
        missing = [n for n in inputs if n not in self.meta]
        if missing:
            raise NotExtractable(f"no value recorded for the scope's input {missing[0]!r}")
        used = {i for n in nodes for i in n.input}
        graph = helper.make_graph(
            nodes, f"site {scope}",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(self.meta[n][0]),
                                           [f"d{k}" for k in range(len(self.meta[n][1]))]) for n in inputs],
            [helper.make_tensor_value_info(out_name, helper.np_dtype_to_tensor_dtype(self.meta[out_name][0]),
                                           None)],
            [self.inits[n] for n in self.inits if n in used])
        model = helper.make_model(graph, opset_imports=list(self.proto.opset_import),
                                  ir_version=self.proto.ir_version)
        model.functions.extend(self.proto.functions)
        return model, inputs

    def constant(self, name: str) -> bool:
        """Whether a value depends on initializers and constants only (a graph input is not one)."""
        if name in self.inits:
            return True
        hit = self._constant.get(name)
        if hit is None:
            p = self.producer.get(name)
            self._constant[name] = False  # a cycle guard; graphs are acyclic
            hit = p is not None and p.op_type not in _VARIABLE and all(not i or self.constant(i) for i in p.input)
            self._constant[name] = hit
        return hit

    def _chain(self, name: str, into: dict[int, Any]) -> None:
        """The nodes that compute a constant value, keyed by their position in the graph."""
        p = self.producer.get(name)
        if p is None or self.index[id(p)] in into:
            return
        into[self.index[id(p)]] = p
        for i in p.input:
            if i and i not in self.inits:
                self._chain(i, into)

    def feeds(self, inputs: list[str], args, kwargs) -> list[np.ndarray]:
        """The reference's tensors for the subgraph's inputs (:func:`feeds`)."""
        return feeds(self.meta, inputs, args, kwargs)

    def run(self, scope: str, out_name: str, args, kwargs) -> np.ndarray:
        """The site's subgraph on the reference's inputs (the call's ``args``/``kwargs``): its output."""
        import onnxruntime as ort

        key = (self.key, scope, out_name)
        hit = _CACHE.get(key)
        if hit is None:
            if any(k[0] != self.key for k in _CACHE):
                _CACHE.clear()
            model, inputs = self.extract(scope, out_name)
            try:
                sess = ort.InferenceSession(model.SerializeToString(), _options(1), providers=["CPUExecutionProvider"])
            except Exception as exc:
                raise NotExtractable(f"onnxruntime cannot build the site's subgraph: {type(exc).__name__}: "
                                     f"{str(exc)[:200]}") from None
            hit = _CACHE[key] = (sess, inputs)
        sess, inputs = hit
        feeds = dict(zip(inputs, self.feeds(inputs, args, kwargs), strict=True))
        try:
            (out,) = sess.run([out_name], feeds)
        except Exception as exc:
            raise NotExtractable(f"onnxruntime failed on the site's subgraph: {type(exc).__name__}: "
                                 f"{str(exc)[:200]}") from None
        return out


def feeds(meta: dict[str, tuple[np.dtype, tuple[int, ...], np.ndarray]], inputs: list[str], args, kwargs,
          nested: bool = False) -> list[np.ndarray]:
    """The reference's tensors for a site's inputs (any runtime's graph): each input (``meta``: its dtype, shape and
    fingerprint in the candidate's run) takes the tensor of the torch call with its shape and kind (floating or
    not); where several have that shape, the one whose values match what the candidate computed there (16 sampled
    elements: nearest by far, ‖Δ‖/‖r‖ < 0.05 and 10× nearer than the next). ``nested``: the tensors inside a tuple
    or list argument count too (a rotary embedding's ``(cos, sin)``). Raises :class:`NotExtractable` when no
    tensor, or no clear one, matches."""
    tensors = []
    for t in list(args) + list((kwargs or {}).values()):
        if isinstance(t, torch.Tensor):
            tensors.append(t)
        elif nested and isinstance(t, list | tuple):
            tensors.extend(v for v in t if isinstance(v, torch.Tensor))
    out = []
    for name in inputs:
        dtype, shape, fp = meta[name]
        floating = np.issubdtype(dtype, np.floating)
        match = [t for t in tensors if tuple(t.shape) == shape and t.is_floating_point() == floating]
        if len(match) > 1:
            dist = sorted((_distance(fp, t), i) for i, t in enumerate(match))
            (best, i), second = dist[0], dist[1][0]
            if not (best < 0.05 and second > 10 * best):
                raise NotExtractable(f"input {name} {list(shape)} matches {len(match)} of the call's tensors by "
                                     f"shape and none clearly by value (nearest {sig(best, 2)}, next {sig(second, 2)})")
            match = [match[i]]
        if not match:
            raise NotExtractable(f"input {name} {list(shape)} has no tensor of its shape in the torch call")
        out.append(match[0].detach().to("cpu").numpy().astype(dtype, copy=False))
    return out


def _distance(fp: np.ndarray, t: torch.Tensor) -> float:
    """‖fingerprint(t) − fp‖ / ‖fingerprint(t)‖ (inf when either is not finite)."""
    flat = t.detach().reshape(-1)
    idx = torch.from_numpy(np.linspace(0, flat.numel() - 1, min(16, flat.numel())).astype(np.int64))
    ref = flat[idx].to("cpu", torch.float64).numpy() if flat.numel() else np.zeros(0)
    with np.errstate(all="ignore"):
        d = float(np.linalg.norm(ref - fp) / max(np.linalg.norm(ref), 1e-30))
    return d if np.isfinite(d) else np.inf


class Site:
    """One ONNX site (its scope and output value) of a :class:`Subgraphs`: what ``diff`` infers the candidate's
    contract from at a norm site that diverges."""

    def __init__(self, subgraphs: Subgraphs, scope: str, out_name: str):
        self.subgraphs, self.scope, self.out_name = subgraphs, scope, out_name

    def proto(self):
        return self.subgraphs.extract(self.scope, self.out_name)[0]


class OnnxCandidate(GraphCandidate):
    """An ONNX model on onnxruntime; a site's own output is its nodes extracted as a subgraph of their own."""

    bound_suffix = " (ONNX: the site's subgraph on the reference's input)"
    runner = " on onnxruntime"

    def __init__(self, proto):
        super().__init__("", "float32")
        self.proto = proto
        self.subgraphs = None

    def run(self, args, kwargs) -> None:
        self.values, self.scopes, self.desc, self.subgraphs = run_candidate(self.proto, args, kwargs)
        declared = self.subgraphs.proto.graph.output
        self.final = self.values.get(declared[0].name) if len(declared) else None

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        try:
            with torch.no_grad():
                yc = torch.from_numpy(self.subgraphs.run(*r.module, args, kw))
        except NotExtractable as exc:
            raise NotMeasured(None, missing=str(exc)) from None
        return yc, self.dtype, Site(self.subgraphs, *r.module)


def is_candidate(obj) -> bool:
    return is_onnx(obj)


def candidate(obj, reference, ref_dtype: str, stack) -> OnnxCandidate:
    return OnnxCandidate(obj)
