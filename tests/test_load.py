"""normscope.load reads every JSON document normscope writes back into its result type, by its schema."""

from __future__ import annotations

import json

import pytest
import torch

import normscope
from normscope import InputError, NormSpec


def test_load_dispatches_on_the_schema(tmp_path):
    spec = NormSpec.preset("llama_rmsnorm")
    inf = normscope.infer(torch.nn.LayerNorm(16), shape=(2, 16))
    rep = normscope.check(torch.nn.LayerNorm(16), expect="torch_layernorm", shape=(2, 16), quick=True)
    for name, result in (("spec", spec), ("inference", inf), ("check", rep)):
        path = tmp_path / f"{name}.json"
        path.write_text(result.to_json())
        back = normscope.load(path)
        assert type(back) is type(result)
        assert back.to_dict() == result.to_dict()
    assert normscope.load(json.loads(spec.to_json())) == spec


def test_load_refuses_what_it_cannot_read(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(InputError, match="no 'schema' field"):
        normscope.load(bad)
    bad.write_text('{"schema": "normscope.trace/1"}')
    with pytest.raises(InputError, match="does not read.*normscope.diagnose"):
        normscope.load(bad)
    with pytest.raises(InputError, match="cannot read"):
        normscope.load(tmp_path / "missing.json")
