"""What to look at next for a series that left its range: the sentence each :class:`.Anomaly` carries as its
``next_check``, by stage and metric."""

from __future__ import annotations


def next_check(stage: str, metric: str, layer, site: str, head, ids) -> str:
    L = f"layer {layer}" if layer is not None else "the model"
    if stage == "data":
        who = f"samples {ids}" if ids else "the samples of this batch"
        what = (f"inspect {who}: their raw tokens/values and source shard; if they are corrupt, drop them and "
                "re-run this step")
        if site == "embedding":  # the lookup's output: the table's rows are parameters
            what += ("; if their ids are in range, the rows of the embedding table these ids select (a non-finite "
                     "or huge row reads here like a corrupt sample)")
        return what
    if metric == "masked_samples":
        return (f"the attention mask of this batch at {L}: a sample with every key of every query masked (an all-zero "
                "attention mask: an empty or all-padding sample) attends to nothing; check how its mask was built")
    if metric == "masked_rows":
        return (f"the attention mask at {L}: a query row with every key masked makes softmax 0/0 = NaN; check "
                "padding and sequence packing (a row of padding queries), or mask with a finite value")
    if stage == "attention_logits":
        h = f"head {head}" if head is not None else "its heads"
        if metric == "entropy":
            return (f"{L} {h} changed how its attention spreads (onto few keys, or out towards uniform): look at its max "
                    "logit and at the query/key projections")
        if metric == "focus":
            return (f"{L} {h} stopped attending to anything in particular (its attention went uniform): its query/key "
                    "projections (zeroed or scaled towards 0), the norm feeding them, and the attention mask")
        return (f"the query/key projections of {L} {h} (their update ratio and weight norms) and the norm feeding "
                "them; QK-norm or logit soft-capping bound this")
    if stage == "loss":
        who = f"samples {ids}" if ids else "the samples with the largest per-sample loss"
        return (f"earlier stages were within their range at this step: look at the targets/labels of {who}, at "
                "the loss computation (scaling, reduction, ignore_index), and at the learning rate of the steps "
                "before (one too high for this point of training makes the loss climb while no link leaves its "
                "range)")
    if stage == "grad":
        if metric == "nonfinite":
            return (f"the backward of {L} ({site}): re-run this step under torch.autograd.detect_anomaly() to name the "
                    "op; under float16 AMP check the loss scaler")
        return (f"the gradient of {L} ({site}) while the forward and the loss were in range: the backward itself "
                "(gradient accumulation and its scaling, zero_grad, a hook that edits gradients)")
    if stage == "update" and metric == "written":
        return (f"the code that writes the parameters of {L} ({site}) outside optimizer.step(): a checkpoint or "
                "adapter merged into the live model, an initialisation by name run again, an EMA or weight-averaging "
                "swap, a manual edit; compare its weights before and after this step")
    if stage == "update":
        what = (f"the optimizer's param group for {L} ({site}): its learning rate at this step (scheduler, warmup, a "
                "per-layer multiplier), Adam ε and second-moment state, and any code that writes the parameters")
        if metric == "nonfinite":  # the gradients were finite when the backward ended
            what += ("; and code that changes the gradients between backward() and step() (a hook, a loss scaler, "
                     "clipping, which spreads one non-finite gradient to every group it clips)")
        return what
    if stage == "norm_output" and metric == "scale_rms":
        return f"the scale γ of {site} in {L}: what wrote it (a checkpoint load, its updates, weight decay)"
    if stage in ("norm_input", "layer_input"):
        return f"the stream entering {L}: the residual sum of the layer before and the data at this step"
    if stage == "norm_output":
        return f"{site} in {L}: its input's per-row RMS (a collapsing σ/RMS amplifies) and its scale γ"
    return f"the {site or stage} sublayer of {L}: its weights (update stage), its precision, and the norm that feeds it"
