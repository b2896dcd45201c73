"""Canonical norm-site names shared by every artifact.

The same norm is ``model.layers.3.input_layernorm`` in a Hugging Face checkpoint, ``blk.3.attn_norm`` in a
GGUF file and ``/model/layers.3/input_layernorm/...`` in an ONNX export. All of them become
``layers.3.attn_norm``: ``layers.{i}.{slot}`` inside a block, ``final_norm`` / ``embed_norm`` outside.

Slots and the role each implies:

- ``attn_norm`` / ``ffn_norm`` (``pre``): on the residual stream, feeding attention / the MLP;
- ``attn_branch_norm`` / ``ffn_branch_norm`` (``branch``): on a sublayer's output before the residual add
  (Gemma 2/3 ``post_*``, OLMo-2 ``post_*``, GGUF ``post_attention_norm`` / ``post_ffw_norm``);
- ``attn_post_norm`` / ``ffn_post_norm`` (``post``): on the residual sum (BERT's ``LayerNorm``s, GGUF
  ``attn_output_norm`` / ``layer_output_norm``);
- ``q_norm`` / ``k_norm`` (``qk``); ``final_norm`` (``final``); ``embed_norm`` (``embedding``).

When a scan has measured every site's role and layer (one residual stream), names come from the structure
alone (:func:`structural_names`): within a block, the n-th norm of a role in forward order takes that role's
n-th slot — the first pre norm is ``attn_norm``, the last ``ffn_norm``, one between them ``cross_attn_norm``
(an encoder–decoder's cross-attention); ``final_norm`` and ``embed_norm`` outside. The tables below name the
sites of files that state no dataflow (a GGUF, an HF config of a known architecture, an ONNX graph).
Hugging Face's ``post_attention_layernorm`` is the MLP's *pre* norm in Llama but a *branch* norm in
Gemma 2/3 and OLMo-2: a role, when known, decides; otherwise the block's other norms do (a
``pre_feedforward_layernorm`` beside it, or no ``input_layernorm``, makes it a branch norm).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

SLOT_ROLES = {
    "attn_norm": "pre",
    "ffn_norm": "pre",
    "attn_branch_norm": "branch",
    "ffn_branch_norm": "branch",
    "attn_post_norm": "post",
    "ffn_post_norm": "post",
    "q_norm": "qk",
    "k_norm": "qk",
    "final_norm": "final",
    "embed_norm": "embedding",
}

# a path inside a block → slot (exact match of the part after ``layers.{i}.``)
_BLOCK = {
    # Hugging Face
    "input_layernorm": "attn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_branch_norm",
    "ln_1": "attn_norm",
    "ln_2": "ffn_norm",
    "attention.output.LayerNorm": "attn_post_norm",
    "output.LayerNorm": "ffn_post_norm",
    "attention_norm": "attn_norm",
    "norm1": "attn_norm",
    "norm2": "ffn_norm",
    "ln_attn": "attn_norm",  # Falcon-40B's parallel pair
    "ln_mlp": "ffn_norm",
    # GGUF (llama.cpp names tensors by role)
    "post_attention_norm": "attn_branch_norm",
    "post_ffw_norm": "ffn_branch_norm",
    "attn_output_norm": "attn_post_norm",
    "layer_output_norm": "ffn_post_norm",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "attn_norm_2": "ffn_norm",  # llama.cpp's falcon: ln_mlp
}
_BLOCK.update({slot: slot for slot in SLOT_ROLES if slot not in ("final_norm", "embed_norm")})
_AMBIGUOUS = "post_attention_layernorm"
# the last component of a path inside a block → slot (attention submodules are named many ways)
_LAST = {"q_norm": "q_norm", "k_norm": "k_norm", "q_layernorm": "q_norm", "k_layernorm": "k_norm",
         "query_norm": "q_norm", "key_norm": "k_norm"}
# top-level paths (exact, or the end of a dotted path)
_TOP = {
    "norm": "final_norm",
    "ln_f": "final_norm",
    "final_layernorm": "final_norm",
    "final_layer_norm": "final_norm",
    "norm_f": "final_norm",
    "output_norm": "final_norm",
    "final_norm": "final_norm",
    "embeddings.LayerNorm": "embed_norm",
    "token_embd_norm": "embed_norm",
    "embed_norm": "embed_norm",
    "emb_ln": "embed_norm",
}

_CONTAINER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block|blk)\.(\d+)\.(.+)$")
_BLOCK_ITSELF = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block|blk)\.(\d+)$")
_PARAM_SUFFIX = re.compile(r"\.(weight|bias|scale|w|b|g|gamma|beta)$")


def module_path(name: str) -> str:
    """A module path from a tensor name (``...input_layernorm.weight``) or an ONNX node scope (``/a/b.0/c``)."""
    name = name.strip()
    if "/" in name:
        parts = [p for p in name.split("/") if p]
        name = ".".join(parts)
    return _PARAM_SUFFIX.sub("", name)


def match_paths(sources: Iterable[str], paths: Iterable[str]) -> dict[str, str]:
    """Each module path of ``sources`` (where a contract's sites sit in the model it describes) → the one path of
    ``paths`` (a checkpoint's tensor names without ``.weight``) that is the same module, by structure alone.

    A path equal to a source is that module. Otherwise a checkpoint saved from another class of the same model
    holds every module under one added or dropped prefix (``vit.layernorm`` for a classifier around
    ``layernorm``; ``layers.0.input_layernorm`` for the base of ``model.layers.0.input_layernorm``): a source takes
    the path of the prefix that lines up the most sources. Last, a block list stored under another name than the
    model's (transformers builds a ViT's ``encoder.layer.N`` as ``layers.N``): a source in block N takes the path
    with the same block index and the same path inside the block, once each of the model's block lists
    corresponds to one of the checkpoint's — the one that lines up strictly the most of its sources. Each source
    takes at most one path and each path one source; a tie, or a source that matches nothing, is left out: never
    guessed.
    """
    sources, paths = list(dict.fromkeys(sources)), set(paths)
    out = {src: src for src in sources if src in paths}
    rest = [src for src in sources if src not in out]
    by_last: dict[str, list[str]] = {}
    for path in paths:
        by_last.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    candidates: dict[str, list[tuple[tuple[str, str], str]]] = {}  # source → [(prefix change, path)]
    for src in rest:
        for path in by_last.get(src.rsplit(".", 1)[-1], []):
            if path.endswith("." + src):
                candidates.setdefault(src, []).append((("add", path[:-len(src)]), path))
            elif src.endswith("." + path):
                candidates.setdefault(src, []).append((("drop", src[:-len(path)]), path))
    votes: dict[tuple[str, str], int] = {}
    for found in candidates.values():
        for key, _ in found:
            votes[key] = votes.get(key, 0) + 1
    used = set(out.values())
    for src, found in candidates.items():
        top = max(votes[key] for key, _ in found)
        best = [path for key, path in found if votes[key] == top]
        if len(best) == 1 and best[0] not in used:
            out[src] = best[0]
            used.add(best[0])
    _match_renamed_blocks([src for src in sources if src not in out], [p for p in paths if p not in used], out)
    return out


def _block_key(path: str) -> tuple[str, int, str] | None:
    """(where the block list lives, the block index, the path inside the block), or None outside any block."""
    m = _CONTAINER.search(path)
    return None if m is None else (path[:m.start(1)], int(m.group(1)), m.group(2))


def _match_renamed_blocks(sources: list[str], paths: list[str], out: dict[str, str]) -> None:
    """The last step of :func:`match_paths`: block lists renamed, each of the model's to one of the checkpoint's."""
    by_key: dict[tuple[int, str], list[tuple[str, str]]] = {}  # (index, inside) → [(list, path)]
    for path in paths:
        if (key := _block_key(path)) is not None:
            by_key.setdefault(key[1:], []).append((key[0], path))
    votes: dict[tuple[str, str], int] = {}
    for src in sources:
        if (key := _block_key(src)) is not None:
            for head, _ in by_key.get(key[1:], []):
                votes[(key[0], head)] = votes.get((key[0], head), 0) + 1
    renamed: dict[str, str] = {}  # the model's block list → the checkpoint's
    while votes:  # a pair with strictly the most votes in its row and its column; then without both
        best = [(mine, theirs) for (mine, theirs), n in votes.items()  # others in its row or column: fewer
                if all(m < n for (a, b), m in votes.items() if (a == mine) != (b == theirs))]
        if not best:
            break
        for mine, theirs in best:
            renamed[mine] = theirs
        votes = {(a, b): n for (a, b), n in votes.items() if a not in renamed and b not in renamed.values()}
    used = set(out.values())
    for src in sources:
        key = _block_key(src)
        if key is None or key[0] not in renamed:
            continue
        hits = [path for head, path in by_key.get(key[1:], []) if head == renamed[key[0]]]
        if len(hits) == 1 and hits[0] not in used:
            out[src] = hits[0]
            used.add(hits[0])


def split_block(path: str) -> tuple[int | None, str]:
    """(block index, the rest of the path) — or (None, path) outside any numbered block."""
    m = _CONTAINER.search(path)
    if not m:
        return None, path
    return int(m.group(1)), m.group(2)


def canonicalize(paths: Iterable[str], roles: Mapping[str, str | None] | None = None
                 ) -> dict[str, tuple[str, int | None, str | None]]:
    """Module path → (canonical name, layer, role implied by the name or given in ``roles``).

    Paths the table does not know keep their block-relative name (``layers.2.my_norm``) or their full
    path, with the role from ``roles`` or None.
    """
    paths = list(paths)
    roles = roles or {}
    by_block: dict[int, set[str]] = {}
    for p in paths:
        layer, rest = split_block(p)
        if layer is not None:
            by_block.setdefault(layer, set()).add(rest.rsplit(".", 1)[-1])
    out: dict[str, tuple[str, int | None, str | None]] = {}
    for p in paths:
        given = roles.get(p)
        layer, rest = split_block(p)
        if layer is None and (m := _BLOCK_ITSELF.search(p)):  # a functional norm in a block's own forward
            out[p] = (f"layers.{m.group(1)}", int(m.group(1)), given)
            continue
        if layer is None:
            slot = _TOP.get(p)
            if slot is None:
                slot = next((s for key, s in _TOP.items() if p.endswith("." + key)), None)
            if slot is None:
                out[p] = (p, None, given)
            else:
                out[p] = (slot, None, given or SLOT_ROLES[slot])
            continue
        last = rest.rsplit(".", 1)[-1]
        slot = _BLOCK.get(rest) or _LAST.get(last)
        if slot is None and last == _AMBIGUOUS:
            if given in ("pre", "branch"):
                slot = "ffn_norm" if given == "pre" else "attn_branch_norm"
            else:
                siblings = by_block.get(layer, set())
                branch = "pre_feedforward_layernorm" in siblings or "input_layernorm" not in siblings
                slot = "attn_branch_norm" if branch else "ffn_norm"
        if slot is None:
            out[p] = (f"layers.{layer}.{rest}", layer, given)
        else:
            out[p] = (f"layers.{layer}.{slot}", layer, given or SLOT_ROLES[slot])
    return out


_ROLE_SLOTS = {"pre": ("attn_norm", "ffn_norm"), "branch": ("attn_branch_norm", "ffn_branch_norm"),
               "post": ("attn_post_norm", "ffn_post_norm"), "qk": ("q_norm", "k_norm")}
_TOP_SLOTS = {"final": "final_norm", "embedding": "embed_norm"}


def structural_names(sites: list[tuple[str, int | None, str | None, str]]
                     ) -> dict[str, tuple[str, int | None, str | None]] | None:
    """(module path, layer, role, stream prefix) in forward order → {path: (canonical name, layer, role)} from
    the structure alone; None when a site's role is unknown or a name would repeat (the tables decide then).
    The prefix names the residual stream of a model with several (``encoder.``, ``decoder.``; ``""`` with one)."""
    if any(role is None for _, _, role, _ in sites):
        return None
    count: dict[tuple[str, int, str], int] = {}
    total: dict[tuple[str, int, str], int] = {}
    for _, layer, role, prefix in sites:
        if layer is not None:
            total[(prefix, layer, role)] = total.get((prefix, layer, role), 0) + 1
    out: dict[str, tuple[str, int | None, str | None]] = {}
    for path, layer, role, prefix in sites:
        if path in out:
            continue
        if layer is None:
            slot = _TOP_SLOTS.get(role)
            name = prefix + slot if slot else canonicalize([path], {path: role})[path][0]
        elif role in _ROLE_SLOTS:
            key = (prefix, layer, role)
            k, n = count.get(key, 0), total[key]
            count[key] = k + 1
            first, last = _ROLE_SLOTS[role]
            if role == "qk" and n > 2:
                return None
            slot = first if k == 0 else last if k == n - 1 else "cross_" + first + ("" if n == 3 else f"_{k}")
            name = f"{prefix}layers.{layer}.{slot}"
        else:  # a norm of no residual role (inside a sublayer): its name, as the tables give it, in its stream
            name = prefix + canonicalize([path], {path: role})[path][0]
        out[path] = (name, layer, role)
    if len({name for name, _, _ in out.values()}) != len(out):
        return None
    return out


def stream_prefixes(streams: list[dict]) -> dict[int, str]:
    """Stream index → the prefix of its canonical names: ``""`` for a model with one stream, else where its
    blocks live without their container (``encoder.block`` → ``encoder.``), or ``stream1.`` when those repeat."""
    if len(streams) <= 1:
        return {s.get("stream", 0): "" for s in streams}
    heads = {s.get("stream", i): (s.get("path") or "").rpartition(".")[0] for i, s in enumerate(streams)}
    if "" in heads.values() or len(set(heads.values())) != len(heads):
        return {i: f"stream{i}." for i in heads}
    return {i: h + "." for i, h in heads.items()}


_ORDER = ("embed_norm", "attn_norm", "q_norm", "k_norm", "attn_branch_norm", "attn_post_norm", "cross_attn_norm",
          "cross_attn_branch_norm", "cross_attn_post_norm", "ffn_norm", "ffn_branch_norm", "ffn_post_norm",
          "final_norm")


def site_order(name: str) -> tuple:
    """A sort key putting sites in the order a forward pass meets them (embedding, blocks, final)."""
    layer, rest = split_block(name)
    slot = _ORDER.index(rest) if rest in _ORDER else len(_ORDER)
    if layer is None:
        return (0 if rest == "embed_norm" else 2, 0, slot, name)
    return (1, layer, slot, name)


def stream_of(name: str) -> str:
    """The stream prefix of a canonical name (``decoder.layers.0.attn_norm`` → ``decoder.``; ``""`` for none)."""
    m = re.match(r"(.*?)(?:layers\.\d+\.|final_norm$|embed_norm$)", name)
    return m.group(1) if m else ""


def slot_of(name: str) -> str:
    """The slot of a canonical name (``layers.3.attn_norm`` → ``attn_norm``)."""
    layer, rest = split_block(name)
    return rest if layer is not None else name


def placement_of(names: Iterable[str]) -> str | None:
    """The block design the canonical slots describe: pre, post, sandwich, reordered, parallel or mixed."""
    designs = set()
    blocks: dict[int, set[str]] = {}
    for n in names:
        layer, rest = split_block(n)
        if layer is not None:
            blocks.setdefault(layer, set()).add(rest)
    for slots in blocks.values():
        pre = slots & {"attn_norm", "ffn_norm"}
        branch = slots & {"attn_branch_norm", "ffn_branch_norm"}
        post = slots & {"attn_post_norm", "ffn_post_norm"}
        if post and not pre and not branch:
            designs.add("post")
        elif branch and pre and not post:
            designs.add("sandwich")
        elif branch and not pre and not post:
            designs.add("reordered")
        elif pre == {"attn_norm"} and not branch and not post:
            designs.add("parallel")
        elif pre == {"attn_norm", "ffn_norm"} and not branch and not post:
            designs.add("pre")
        else:
            designs.add("mixed")
    if not designs:
        return None
    return designs.pop() if len(designs) == 1 else "mixed"
