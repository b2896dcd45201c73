"""Write every file the README's commands use, into a folder (default: the current one), so each command runs as
printed from there:

- ``gemma3/config.json`` — a 2-layer Gemma 3 config (vocabulary 1024): ``normscope scan gemma3/config.json``;
- ``llama/`` — a 2-layer Llama checkpoint (ε = 1e-5, norm weights drawn around 1, safetensors) and
  ``llama-eps.gguf`` — the same weights in a GGUF written with ε = 1e-6, the historical converter bug:
  ``normscope contract llama llama-eps.gguf``;
- ``runs/exp1`` — a traced training run of a tiny Llama on the characters of the Python standard library's source,
  whose layer-1 ``post_attention_layernorm`` γ is overwritten ×20 at step 40: ``normscope diagnose runs/exp1``.

Needs the ``hf`` extra (transformers, safetensors) and the ``gguf`` package (both in ``dev``).
Run: ``python examples/readme_files.py [FOLDER] [--skip-run]``; about half a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)

#: Hugging Face norm names inside a decoder block → the slot llama.cpp's GGUF gives them
GGUF_BLOCK = {"input_layernorm": "attn_norm", "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm"}


def gemma3_config(folder: Path) -> Path:
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(**SMALL, head_dim=8, vocab_size=1024)
    cfg.save_pretrained(folder / "gemma3")
    return folder / "gemma3" / "config.json"


def llama_checkpoint(folder: Path, seed: int = 1) -> Path:
    """A 2-layer Llama with its norm weights drawn around 1 (trained-looking γ), saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, vocab_size=64, rms_norm_eps=1e-5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.05)
    model.save_pretrained(folder / "llama")
    return folder / "llama"


def to_gguf(model_dir: Path, path: Path, arch: str, eps: float, add_one: bool = False,
            drop: str | None = None) -> Path:
    """A model's norm weights written to a GGUF as llama.cpp's converter writes them (Gemma: γ stored as 1 + w),
    with ``eps`` as the file's RMSNorm ε; ``drop`` leaves one tensor out."""
    import gguf
    from safetensors.numpy import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    sandwich = "pre_feedforward_layernorm" in " ".join(weights)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_layer_norm_rms_eps(eps)
    for key, value in sorted(weights.items()):
        if "norm" not in key:
            continue
        module = key.removesuffix(".weight")
        if module == "model.norm":
            name = "output_norm"
        else:
            i, rest = module.removeprefix("model.layers.").split(".", 1)
            if rest == "post_attention_layernorm":
                slot = "post_attention_norm" if sandwich else "ffn_norm"
            else:
                slot = GGUF_BLOCK[rest]
            name = f"blk.{i}.{slot}"
        if name == drop:
            continue
        w.add_tensor(name + ".weight", (value + 1 if add_one else value).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def stdlib_text(vocab: int = 128) -> torch.Tensor:
    """The characters of the standard library's source (the first ~400 KB), folded into ``vocab`` symbols."""
    data = bytearray()
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += p.read_bytes()
        if len(data) > 400_000:
            break
    return torch.tensor(list(data), dtype=torch.long) % vocab


def traced_run(run_dir: Path, steps: int = 64, fault_at: int = 40, seed: int = 0) -> Path:
    """A tiny Llama (SDPA, grouped-query attention) trained on real text with a linear warm-up, traced; at step
    ``fault_at`` its layer-1 post-attention RMSNorm γ is overwritten ×20 (a bad checkpoint load)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import normscope

    vocab, t, b = 128, 48, 8
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=t)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 16))
    text = stdlib_text(vocab)
    g = torch.Generator().manual_seed(1000 + seed)
    with normscope.trace(model, run_dir) as tr:
        for step in range(steps):
            at = torch.randint(0, text.numel() - t - 1, (b,), generator=g)
            window = torch.stack([text[i:i + t + 1] for i in at.tolist()])
            if step == fault_at:
                with torch.no_grad():
                    model.model.layers[1].post_attention_layernorm.weight.mul_(20.0)
            logits = model(input_ids=window[:, :t]).logits
            losses = F.cross_entropy(logits.float().transpose(1, 2), window[:, 1:], reduction="none").mean(1)
            losses.mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            tr.step(step, loss=losses.mean().item(), sample_ids=at.tolist(), losses=losses.tolist())
    return run_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default=".", help="where to write (default: the current folder)")
    p.add_argument("--skip-run", action="store_true", help="leave out the traced training run (runs/exp1)")
    args = p.parse_args(argv)
    import importlib.util

    missing = [m for m in ("transformers", "safetensors", "gguf") if importlib.util.find_spec(m) is None]
    if missing:  # `make demo` installs the core only; `make test` installs the dev extras these come with
        raise SystemExit(f"the tour's files need {', '.join(missing)} (the hf and gguf extras): run `make test` "
                         "once (it installs the dev extras), or `.venv/bin/pip install -e '.[hf,gguf]'`")
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [gemma3_config(folder), llama_checkpoint(folder)]
    written.append(to_gguf(folder / "llama", folder / "llama-eps.gguf", "llama", 1e-6))
    if not args.skip_run:
        if (folder / "runs" / "exp1").exists():
            raise SystemExit(f"{folder / 'runs' / 'exp1'} exists: remove it or pass --skip-run (a trace is never "
                             "overwritten)")
        written.append(traced_run(folder / "runs" / "exp1"))
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
