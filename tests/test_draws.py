"""Random weights drawn as windows of one block (`normscope.model.draws`): the distribution asked for, reproducible
under a seed, small tensors and generators drawn as usual, torch's methods restored, and a contract read from a
build with values the same as with torch's own draws."""

from __future__ import annotations

import contextlib

import pytest
import torch

from normscope.model import draws
from normscope.model.draws import LEAST, window_draws


def test_large_fills_have_the_distribution_asked_for():
    torch.manual_seed(0)
    with window_draws():
        u = torch.empty(3_000_000).uniform_(-0.5, 1.5)
        n = torch.empty(1000, 3000).normal_(2.0, 0.02)
        b = torch.empty(4096, 64, dtype=torch.bfloat16).normal_()
    assert -0.5 <= float(u.min()) and float(u.max()) <= 1.5
    assert float(u.mean()) == pytest.approx(0.5, abs=0.01) and float(u.std()) == pytest.approx(2 / 12 ** 0.5, rel=0.01)
    assert float(n.mean()) == pytest.approx(2.0, abs=1e-3) and float(n.std()) == pytest.approx(0.02, rel=0.01)
    assert float(b.float().std()) == pytest.approx(1.0, rel=0.02)
    rows = n[:, :8]
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]  # no two rows alike


def test_a_seeded_build_is_reproducible_and_torch_is_restored():
    methods = (torch.Tensor.uniform_, torch.Tensor.normal_)

    def build():
        torch.manual_seed(0)
        with window_draws():
            return torch.nn.Linear(512, 512).weight.detach().clone()

    assert torch.equal(build(), build())
    assert (torch.Tensor.uniform_, torch.Tensor.normal_) == methods


def test_small_tensors_and_given_generators_draw_as_torch_does():
    normal = torch.Tensor.normal_
    with window_draws():
        state = torch.random.get_rng_state()
        small = torch.empty(LEAST - 1).normal_()
        torch.random.set_rng_state(state)
        assert torch.equal(small, normal(torch.empty(LEAST - 1)))
        x = torch.empty(LEAST * 2).normal_(generator=torch.Generator().manual_seed(1))
    assert torch.equal(x, torch.empty(LEAST * 2).normal_(generator=torch.Generator().manual_seed(1)))


def test_a_contract_read_with_values_is_the_same_as_with_torchs_draws(tmp_path, monkeypatch):
    """BART's forward reads a value (it does not run on the meta device): read from a build with random weights."""
    transformers = pytest.importorskip("transformers")
    from normscope.artifacts import contract

    transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                            max_position_embeddings=64).save_pretrained(tmp_path)
    with_windows = contract(tmp_path / "config.json")
    assert any("random weights on the CPU" in n for n in with_windows.notes), with_windows.notes
    monkeypatch.setattr(draws, "window_draws", contextlib.nullcontext)
    plain = contract(tmp_path / "config.json")
    assert [s.__dict__ for s in with_windows.sites] == [s.__dict__ for s in plain.sites]
