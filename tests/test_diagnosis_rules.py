"""``diagnose`` as a pipeline whose rules are data: the table is what the pipeline runs, and what the docs show."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trace_models import train

from normscope.tracing import diagnose
from normscope.tracing.diagnosis import INCIDENT_KINDS, RULES, incidents, markdown
from normscope.tracing.diagnosis.rules import Rule

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trace.md"


def test_docs_show_every_rule_as_the_code_states_it():
    assert markdown(RULES) in DOCS.read_text(), (
        "docs/trace.md's rule table differs from normscope.tracing.diagnosis.RULES: paste markdown(RULES) in its place")


def test_every_rule_says_what_it_reads_its_direction_threshold_and_report():
    stages = ("incident", "localization", "drift", "note")
    assert [r.stage for r in RULES] == sorted((r.stage for r in RULES), key=stages.index)  # pipeline order
    for r in RULES:
        assert r.stage in stages and r.reads and r.direction and r.threshold and r.reports, r
        assert (r.find is not None) == (r.stage == "incident"), r  # the incidents' finders run from the table
    assert INCIDENT_KINDS == tuple(dict.fromkeys(r.name for r in RULES if r.stage == "incident"))


def test_a_rule_added_to_the_table_is_run_and_reported(tmp_path, monkeypatch):
    """A new incident rule touches one place: its row. Its finder runs, its incident is localized and reported."""
    train(tmp_path, steps=30)
    assert not diagnose(tmp_path).incidents

    def find(view):
        return [incidents.Trigger(20, "test_rule", "loss", 1.0, 1.0, "raised by the test's rule", None)]

    extra = Rule("test_rule", "incident", "nothing", "up", "always", "the test's incident", find)
    monkeypatch.setattr(incidents, "INCIDENT_RULES", (*incidents.INCIDENT_RULES, extra))
    d = diagnose(tmp_path)
    assert [(i.kind, i.step, i.evidence) for i in d.incidents] == [("test_rule", 20, "raised by the test's rule")]


def test_rules_sharing_a_finder_run_it_once(tmp_path, monkeypatch):
    train(tmp_path, steps=12)
    calls = []
    shared = [r.find for r in incidents.INCIDENT_RULES if r.name == "grad_spike"][0]

    def counted(view):
        calls.append(1)
        return shared(view)

    rules = tuple(dataclasses.replace(r, find=counted) if r.find is shared else r for r in incidents.INCIDENT_RULES)
    assert sum(r.find is counted for r in rules) == 3  # loss, gradient and update spikes: one threshold for all
    monkeypatch.setattr(incidents, "INCIDENT_RULES", rules)
    diagnose(tmp_path)
    assert calls == [1]
