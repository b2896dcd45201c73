"""normscope.tracing.sinks.TensorBoardSink: the event files hold, under navigable tags, the same numbers as the
trace's JSONL (read back through read_run/diagnose); NaNs are written, not raised; a missing tensorboard package is
one clear error before the run; a failing sink never breaks training."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys

import pytest
import torch
from trace_models import B, nan_gradient_at, train  # the traced AdamW run on the 3-layer test decoder

from normscope.errors import InputError
from normscope.tracing import diagnose, read_run
from normscope.tracing.sinks import TensorBoardSink, record_scalars

needs_tb = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                              reason="tensorboard is not installed (pip install tensorboard; it is in the dev extra)")

STEPS = 10
ACT = ("layer_input", "norm_input", "norm_output", "sublayer_output", "residual_sum")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    return ea


def expected_series(entry):
    """(tag, metric, head) of every series ``diagnose`` judges in one entry, spelled out by hand."""
    st, layer, site = entry["stage"], entry["layer"], entry["site"]
    where = "/".join(p for p in ("" if layer is None else f"layer{layer}", site) if p)
    out = []
    if st in ACT:
        out += [(f"{m}/{st}/{where}", m, None) for m in ("rms", "max")]
        if st == "norm_output":
            out.append((f"scale_rms/{st}/{where}", "scale_rms", None))
        if st == "norm_input":
            out.append((f"min_row_rms/{st}/{where}", "min_row_rms", None))
    elif st == "attention_logits":
        out += [(f"{m}/{where}/head{h}", m, h) for m in ("max_logit", "masked_rows", "masked_samples", "entropy",
                                                         "focus")
                for h in range(len(entry["max_logit"]))]
        # non-finite logits per head
        return out + [(f"nonfinite/{st}/{where}/head{h}", "nonfinite", h) for h in range(len(entry["max_logit"]))]
    elif st == "loss":
        out.append(("loss", "loss", None))
    elif st == "grad":
        out += [(f"grad_{m}/{where}", m, None) for m in ("rms", "max")]
    elif st == "update":
        out.append((f"update_ratio/{where}", "ratio", None))
        out.append((f"update_lr/{where}", "lr", None))
        out.append((f"update_step_lr/{where}", "step_lr", None))  # the largest step, in learning rates
    out.append(("/".join(p for p in ("nonfinite", st, where) if p), "nonfinite", None))
    return out


@needs_tb
def test_scalars_equal_the_trace(tmp_path):
    tb = TensorBoardSink(tmp_path / "tb", flush_secs=1)
    seen, mutated = [], []

    class Watch:  # hands each record to the TensorBoard sink and checks that the sink left it as it was
        def write(self, rec):
            snap = copy.deepcopy(rec)
            tb.write(rec)
            seen.append(rec["kind"])
            if rec != snap:
                mutated.append(rec["kind"])

        def close(self):
            tb.close()

    _, tr = train(tmp_path / "run", steps=STEPS, sinks=[Watch()])
    assert not tr.disabled and not tr.errors and not mutated
    assert seen == ["header"] + ["step"] * STEPS + ["end"]
    d = diagnose(tmp_path / "run")
    ea = events(tmp_path / "tb")

    # every series diagnose judges is a scalar tag, and nothing else is (besides the per-sample counts)
    want = {t: (e["stage"], m, e["layer"], e["site"], h) for e in d.records[-1]["entries"]
            for t, m, h in expected_series(e)}
    tags = set(ea.Tags()["scalars"])
    assert tags - set(want) == {"samples/embedding/nonfinite_samples", "samples/loss/nonfinite_samples",
                                "trace/tracer_ms"}
    assert set(want) <= tags
    # per block: layer input 3, norm input/output 2·4 + 2·4, attention 6·4 heads, sublayer and residual
    # outputs 4·3, grad 4 groups·3, update 4·4 (83); outside: ln_f 4 + 4, loss 2, grad 4·3, update 4·4 (38)
    assert len(want) == 3 * 83 + 38
    for t in ("loss", "rms/residual_sum/layer1/mlp", "max/layer_input/layer0", "max_logit/layer2/head3",
              "entropy/layer0/head1", "masked_rows/layer1/head0", "masked_samples/layer2/head1",
              "grad_rms/layer0/attn", "grad_max/wte",
              "update_ratio/layer2/mlp", "nonfinite/grad/layer1/mlp", "nonfinite/attention_logits/layer0/head2",
              "rms/norm_output/ln_f", "scale_rms/norm_output/layer0/ln_1", "min_row_rms/norm_input/layer2/ln_2",
              "nonfinite/loss"):
        assert t in want, t
    # and each holds the JSONL's numbers, step by step (the JSONL keeps 7 significant digits, the sink float32)
    for t, (stage, metric, layer, site, head) in want.items():
        xs, ys = d.series(stage, metric, layer, site, head)
        got = ea.Scalars(t)
        assert [s.step for s in got] == xs == list(range(STEPS)), t
        assert [s.value for s in got] == pytest.approx(ys, rel=2e-6, abs=1e-30), t

    # the formulas, recomputed here from the raw sufficient statistics of read_run
    _, records, _ = read_run(tmp_path / "run")
    for rec in records:
        k = rec["step"]
        by = {(e["stage"], e["layer"], e["site"]): e for e in rec["entries"]}
        e = by[("residual_sum", 1, "mlp")]
        assert ea.Scalars("rms/residual_sum/layer1/mlp")[k].value == pytest.approx(math.sqrt(e["sumsq"] / e["n"]),
                                                                                  rel=2e-6)
        e = by[("update", 2, "attn")]
        assert ea.Scalars("update_ratio/layer2/attn")[k].value == pytest.approx(
            math.sqrt(e["sumsq"] / e["param_sumsq"]), rel=2e-6)
        assert ea.Scalars("update_step_lr/layer2/attn")[k].value == pytest.approx(e["max"] / e["max_lr"], rel=2e-6)
        e = by[("attention_logits", 0, "")]
        assert ea.Scalars("entropy/layer0/head2")[k].value == pytest.approx(e["entropy_sum"][2] / e["entropy_rows"][2],
                                                                           rel=2e-6)
        assert ea.Scalars("max_logit/layer0/head2")[k].value == pytest.approx(e["max_logit"][2], rel=2e-6)
        assert ea.Scalars("loss")[k].value == pytest.approx(by[("loss", None, "")]["sum"], rel=2e-6)
        assert ea.Scalars("samples/loss/nonfinite_samples")[k].value == 0
        assert ea.Scalars("trace/tracer_ms")[k].value == pytest.approx(rec["tracer_ms"], rel=2e-6) and rec["tracer_ms"] > 0
        # per-sample histograms: every sample, its largest value
        losses, emb = rec["samples"]["loss"]["loss"], rec["samples"]["embedding"]
        h = ea.Histograms("samples/loss")[k].histogram_value
        assert h.num == B and h.max == pytest.approx(max(losses), rel=2e-6) and h.min == pytest.approx(min(losses),
                                                                                                     rel=2e-6)
        rms = [math.sqrt(s / n) for s, n in zip(emb["sumsq"], emb["n"], strict=True)]
        h = ea.Histograms("samples/embedding/rms")[k].histogram_value
        assert h.num == B and h.max == pytest.approx(max(rms), rel=2e-6)
    assert [s.step for s in ea.Histograms("samples/embedding/max")] == list(range(STEPS))
    assert {"trace/header/text_summary", "trace/end/text_summary"} <= set(ea.Tags()["tensors"])
    header = ea.Tensors("trace/header/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"h.2"' in header and '"GPT"' in header
    # the record's own wall time (the JSONL rounds it to 7 digits, so compare with the sink's own view)
    assert ea.Scalars("loss")[0].wall_time == pytest.approx(records[0]["time"], rel=1e-6)


def test_record_scalars_of_other_records_and_missing_values():
    assert record_scalars({"kind": "header"}) == {}
    rec = {"kind": "step", "step": 0, "entries": [
        {"stage": "attention_logits", "layer": 0, "site": "", "max_logit": [1.0, 2.0], "masked_rows": [0, 3],
         "entropy_sum": [1.5, 0.0], "entropy_rows": [3, 0], "nonfinite": 0},
        {"stage": "layer_input", "layer": 1, "site": "", "sumsq": 0.0, "n": 0, "max": 0.0, "nonfinite": 0}]}
    got = record_scalars(rec)
    assert got["entropy/layer0/head0"] == 0.5 and "entropy/layer0/head1" not in got  # no rows: no entropy
    assert got["masked_rows/layer0/head1"] == 3 and "rms/layer_input/layer1" not in got  # no elements: no RMS
    assert got["max/layer_input/layer1"] == 0.0


@needs_tb
def test_nonfinite_values_are_written_not_raised(tmp_path):
    # a NaN gradient behind the MLP of block 1 at step 3: the update, then every activation, go NaN
    _, tr = train(tmp_path / "run", nan_gradient_at(3), steps=5, sinks=[TensorBoardSink(tmp_path / "tb")])
    assert not tr.disabled
    ea = events(tmp_path / "tb")
    bad = [s.value for s in ea.Scalars("nonfinite/grad/layer1/mlp")]
    assert bad[:3] == [0, 0, 0] and bad[3] == pytest.approx(4224 / 8352)
    loss = [s.value for s in ea.Scalars("loss")]
    assert all(math.isfinite(v) for v in loss[:4]) and math.isnan(loss[4])
    d = diagnose(tmp_path / "run")
    assert math.isnan(d.series("loss", "loss")[1][4])
    assert ea.Scalars("samples/loss/nonfinite_samples")[4].value == B
    assert [h.step for h in ea.Histograms("samples/loss")] == [0, 1, 2, 3]  # no finite sample left at step 4


def test_missing_tensorboard_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without the package sees
    with pytest.raises(InputError, match=r"needs the tensorboard package.*pip install tensorboard"):
        TensorBoardSink(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


@needs_tb
def test_bad_arguments_and_no_file_before_the_first_record(tmp_path):
    for bad in (0, -1, "10", True, float("nan")):
        with pytest.raises(InputError, match="flush_secs"):
            TensorBoardSink(tmp_path / "tb", flush_secs=bad)
    with pytest.raises(InputError, match="log_dir"):
        TensorBoardSink(3)
    with pytest.raises(InputError, match="max_queue"):
        TensorBoardSink(tmp_path / "tb", max_queue=0)
    sink = TensorBoardSink(tmp_path / "tb")  # e.g. built on a rank that never gets a record
    sink.close()
    assert not (tmp_path / "tb").exists()


@needs_tb
def test_a_failing_sink_never_breaks_training(tmp_path, monkeypatch, caplog):
    ref, _ = train(tmp_path / "ref", steps=4)
    (tmp_path / "afile").write_text("not a folder")
    with caplog.at_level("WARNING", logger="normscope.trace"):
        model, tr = train(tmp_path / "run", steps=4, sinks=[TensorBoardSink(tmp_path / "afile")])
    assert tr.disabled == {"sink 0"} and tr.errors[0]["step"] == 0 and "afile" in tr.errors[0]["error"]
    assert "sink 0" in caplog.text
    d = diagnose(tmp_path / "run")
    assert d.steps == [0, 1, 2, 3] and d.complete and not d.incidents and d.disabled == ["sink 0"]
    assert d.verdict == "inconclusive" and len(d.undecided) == 1 and "only 4 recorded" in d.undecided[0]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)  # training went on exactly as without the sink

    # the writer failing mid-run: the steps before it are in the event file, the run goes on to its end
    from torch.utils.tensorboard import FileWriter

    real, calls = FileWriter.add_summary, []

    def flaky(self, *a, **k):
        calls.append(1)
        if len(calls) == 4:  # header, steps 0-1, then step 2 fails
            raise OSError("no space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(FileWriter, "add_summary", flaky)
    _, tr = train(tmp_path / "run2", steps=5, sinks=[TensorBoardSink(tmp_path / "tb2")])
    assert tr.disabled == {"sink 0"} and tr.errors[0]["step"] == 2 and len(calls) == 4
    assert diagnose(tmp_path / "run2").steps == [0, 1, 2, 3, 4]
    assert [s.step for s in events(tmp_path / "tb2").Scalars("loss")] == [0, 1]


@needs_tb
def test_recorded_steps_only(tmp_path):
    train(tmp_path / "run", steps=6, every=3, sinks=[TensorBoardSink(tmp_path / "tb")])
    assert [s.step for s in events(tmp_path / "tb").Scalars("rms/layer_input/layer0")] == [0, 3]
