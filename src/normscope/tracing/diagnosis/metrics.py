"""The metrics of one recorded entry: what ``diagnose`` judges, the TensorBoard sink writes and the report draws
(one formula for all three)."""

from __future__ import annotations

import math
from typing import Any

from ..store import is_number

ACTIVATIONS = ("layer_input", "norm_input", "norm_output", "sublayer_output", "residual_sum")


def rms(sumsq, n) -> float | None:
    return math.sqrt(sumsq / n) if n else None


def entry_metrics(e: dict[str, Any]) -> dict[str, Any]:
    st = e["stage"]
    if st in ACTIVATIONS or st == "grad":
        out = {"rms": rms(e["sumsq"], e["n"]), "max": e["max"], "nonfinite": e["nonfinite"] / max(e["n"], 1)}
        if "max_scale_rms" in e:
            out["scale_rms"] = e["max_scale_rms"]
        if "min_row_rms" in e:
            out["min_row_rms"] = e["min_row_rms"]
        return out
    if st == "attention_logits":
        ent = [s / r if r else None for s, r in zip(e["entropy_sum"], e["entropy_rows"], strict=False)]
        heads = e.get("nonfinite_heads")  # per head where recorded (a run written before: one count for all)
        ok = isinstance(heads, list) and len(heads) == len(e["max_logit"]) and all(map(is_number, heads))
        out = {"max_logit": e["max_logit"], "masked_rows": e["masked_rows"], "entropy": ent,
               "nonfinite": heads if ok else e["nonfinite"]}
        if "masked_samples" in e:  # samples whose every query row is masked (a run written before: not recorded)
            out["masked_samples"] = e["masked_samples"]
        if "focus_sum" in e:  # a run written before: not recorded
            out["focus"] = [max(f / r, FOCUS_FLOOR) if r else None
                            for f, r in zip(e["focus_sum"], e["focus_rows"], strict=False)]
        return out
    if st == "loss":
        return {"loss": e["sum"] / max(e["count"], 1), "nonfinite": e["nonfinite"]}
    if st == "update":
        u, p = rms(e["sumsq"], e["n"]), rms(e["param_sumsq"], e["n"])
        out = {"ratio": (u / p if p else (math.inf if u else 0.0)) if u is not None else None,
               "nonfinite": e["nonfinite"] / max(e["n"], 1)}
        if "max_lr" in e:
            out["lr"] = e["max_lr"]
            if is_number(e["max_lr"]) and e["max_lr"] > 0 and is_number(e.get("max")):
                out["step_lr"] = e["max"] / e["max_lr"]  # the largest parameter step, in learning rates
        return out
    return {}


#: a head's focus — how far its attention is from uniform, in nats: the mean over its sampled query rows of log(keys
#: that take part) − its softmax entropy (0: uniform; a head on one key of 32 reads log 32 = 3.5) — is read as at
#: least this: a head as uniform as float32 entropies can tell reads it, not 0 (a series that falls to exactly 0
#: has left its range, and a head that never focused must not read as one that stopped)
FOCUS_FLOOR = 1e-4

