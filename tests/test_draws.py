"""Random weights for a model built only to be read (`normscope.model.draws`): fills done when read, with the
distribution asked for, reproducible under a seed; small tensors and generators drawn as usual; what the build
reads is values; ``share`` gives the large ones views of one block, which operators run on; a contract read from
such a build is the same as from torch's own draws."""

from __future__ import annotations

import contextlib

import pytest
import torch

from normscope.model import draws
from normscope.model.copies import untouched
from normscope.model.draws import BLOCK, LEAST, multiplied_in_pieces, shared_draws


def test_large_fills_have_the_distribution_asked_for_when_read():
    torch.manual_seed(0)
    with shared_draws() as mode:
        u = torch.empty(3_000_000).uniform_(-0.5, 1.5)
        n = torch.empty(1000, 3000).normal_(2.0, 0.02)
        b = torch.empty(4096, 64, dtype=torch.bfloat16).normal_()
        t = torch.nn.init.trunc_normal_(torch.empty(1000, 100), std=1.0, a=-0.5, b=0.5)
        scaled = torch.empty(1000, 100).normal_().mul_(3.0).add_(1.0)
        assert len(mode.pending) == 5  # recorded, not done
        lo, hi, mean = float(u.min()), float(u.max()), float(n.mean())  # read: done first
        assert not set(mode.pending) & {x.untyped_storage().data_ptr() for x in (u, n)}
    assert -0.5 <= lo and hi <= 1.5
    assert float(u.mean()) == pytest.approx(0.5, abs=0.01) and float(u.std()) == pytest.approx(2 / 12 ** 0.5, rel=0.01)
    assert mean == pytest.approx(2.0, abs=1e-3) and float(n.std()) == pytest.approx(0.02, rel=0.01)
    assert float(b.float().std()) == pytest.approx(1.0, rel=0.02)
    assert -0.5 <= float(t.min()) and float(t.max()) <= 0.5 and float(t.std()) > 0.2
    assert float(scaled.mean()) == pytest.approx(1.0, abs=0.02) and float(scaled.std()) == pytest.approx(3.0, rel=0.02)
    rows = n[:, :8]
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]  # no two rows alike


def test_what_the_build_writes_and_computes_is_kept():
    with shared_draws():
        emb = torch.nn.Embedding(100_000, 8, padding_idx=0)  # drawn, then its padding row zeroed
        table = torch.empty(2000, 64).normal_()
        table[:, ::2] = 7.0  # a write to part of it: done on values
        whole = torch.empty(2000, 64).normal_()
        whole.copy_(torch.ones(2000, 64))  # overwritten as a whole
        zeros = torch.zeros(1000, 100)
        twin = whole.clone()
    assert torch.equal(emb.weight[0], torch.zeros(8)) and float(emb.weight.detach()[1:].abs().sum()) > 0
    assert bool((table[:, ::2] == 7).all()) and float(table[:, 1::2].std()) == pytest.approx(1.0, rel=0.05)
    assert bool((whole == 1).all()) and bool((zeros == 0).all()) and torch.equal(twin, whole)


def test_a_seeded_build_is_reproducible():
    def build():
        torch.manual_seed(0)
        with shared_draws() as mode:
            model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(2)], torch.nn.Linear(512, 512))
            mode.share(model)
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(build(), build(), strict=True))


def test_small_tensors_and_given_generators_draw_as_torch_does():
    with shared_draws() as mode:
        state = torch.random.get_rng_state()
        small = torch.empty(LEAST - 1).normal_()
        torch.random.set_rng_state(state)
        assert torch.equal(small, torch.empty(LEAST - 1).normal_())
        x = torch.empty(LEAST * 2).normal_(generator=torch.Generator().manual_seed(1))
        assert not mode.pending
    assert torch.equal(x, torch.empty(LEAST * 2).normal_(generator=torch.Generator().manual_seed(1)))


def test_shared_parameters_are_views_of_one_block_that_operators_run_on():
    torch.manual_seed(0)
    with shared_draws() as mode:
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096),
                                    torch.nn.Linear(4096, 8192), torch.nn.Embedding(300_000, 64))
        mode.share(model)
    weights = [m.weight for m in model]
    linear, table = weights[:3], weights[3]
    assert len({w.untyped_storage().data_ptr() for w in linear}) == 1
    assert linear[0].untyped_storage().nbytes() == BLOCK * 4
    assert all(w.is_contiguous() for w in linear[:2])  # a matrix that fits the block is a window of it
    assert linear[2].stride()[0] < 4096 and table.stride()[0] < 64  # larger ones' rows overlap
    assert mode.shared_bytes == sum(w.numel() * 4 for w in weights)
    for w in (linear[2], table):
        rows = w[:, :16].detach()
        assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]  # no two rows alike
    big = linear[2].detach()
    bound = 1 / 4096 ** 0.5  # nn.Linear's own init: uniform in ±1/√fan_in
    assert float(big.abs().max()) <= bound and float(big.std()) == pytest.approx(bound / 3 ** 0.5, rel=0.02)
    assert float(table.std()) == pytest.approx(1.0, rel=0.02)
    x = torch.randn(2, 4096)
    expected = x @ big.detach().contiguous().T + model[2].bias.detach()
    assert torch.allclose(model[2](x), expected, atol=1e-5)
    ids = torch.tensor([0, 299_999])
    assert torch.equal(model[3](ids), table.detach()[ids])
    bias = model[0].bias
    with untouched(model):  # the scan's undo copies no block (draws, not values anyone gave); the rest it restores
        with torch.no_grad():
            big[0, 0] = 5.0
            bias[0] = 5.0
    assert float(big[0, 0]) == 5.0 and float(bias[0]) != 5.0


def test_a_matrix_whose_rows_overlap_is_multiplied_a_piece_at_a_time(monkeypatch):
    torch.manual_seed(0)
    with shared_draws() as mode:
        model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 8192))
        mode.share(model)
    big = model[2].weight.detach()
    assert big.stride()[0] < big.shape[1]  # its rows overlap
    whole = big.contiguous()
    pieces = []
    real = draws._in_pieces

    def in_pieces(a, b):
        pieces.append((a.shape, b.shape))
        return real(a, b)

    monkeypatch.setattr(draws, "_in_pieces", in_pieces)
    monkeypatch.setattr(draws, "PIECE", 1 << 20)  # several pieces
    x = torch.randn(3, 5, 2048)
    with torch.no_grad():
        expected = torch.nn.functional.linear(model[1](model[0](x)), whole, model[2].bias)
        with multiplied_in_pieces(model):
            out = model(x)
            left = big @ torch.ones(4096, 2)  # the matrix on the left of a product
            scaled = torch.addmm(torch.ones(8192), torch.ones(2, 4096), big.T, beta=2.0, alpha=0.5)
    assert len(pieces) == 3
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(left, whole @ torch.ones(4096, 2), atol=1e-4)
    assert torch.allclose(scaled, 2.0 + 0.5 * whole.sum(1).expand(2, -1), atol=1e-4)

    plain = torch.nn.Linear(64, 64)
    with multiplied_in_pieces(plain):  # no shared matrix: nothing intercepted
        plain(torch.randn(2, 64))
    assert not pieces[3:]


def test_a_kernel_whose_output_channels_overlap_is_convolved_a_piece_at_a_time(monkeypatch):
    torch.manual_seed(0)
    with shared_draws() as mode:
        model = torch.nn.Sequential(torch.nn.Conv2d(512, 1024, 3, padding=1), torch.nn.Conv2d(1024, 2048, 3, stride=2))
        mode.share(model)
    kernel = model[1].weight.detach()
    assert kernel.stride()[0] < kernel[0].numel()  # its output channels' kernels overlap
    monkeypatch.setattr(draws, "PIECE", 1 << 20)
    x = torch.randn(1, 512, 9, 9)
    with torch.no_grad():
        hidden = torch.nn.functional.conv2d(x, model[0].weight.detach().contiguous(), model[0].bias, padding=1)
        expected = torch.nn.functional.conv2d(hidden, kernel.contiguous(), model[1].bias, stride=2)
        with multiplied_in_pieces(model):
            out = model(x)
    assert torch.allclose(out, expected, atol=1e-4)


def test_a_contract_read_with_shared_draws_is_the_same_as_with_torchs_draws(tmp_path, monkeypatch):
    """BART's forward reads a value (it does not run on the meta device): read from a build with random weights,
    with blocks small enough that its weights share them."""
    transformers = pytest.importorskip("transformers")
    from normscope.artifacts import contract

    transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                            max_position_embeddings=64).save_pretrained(tmp_path)
    made = []
    real = draws.SharedDraws.share

    def share(self, model):
        real(self, model)
        made.append(self.shared_bytes)

    monkeypatch.setattr(draws, "BLOCK", 1 << 17)
    monkeypatch.setattr(draws.SharedDraws, "share", share)
    shared = contract(tmp_path / "config.json")
    assert any("random weights on the CPU" in n for n in shared.notes), shared.notes
    assert made and made[0] >= 8 * 1024 * 64 * 4  # the feed-forward weights at least

    class Plain:
        def share(self, model):
            pass

    monkeypatch.setattr(draws, "shared_draws", lambda: contextlib.nullcontext(Plain()))
    plain = contract(tmp_path / "config.json")
    assert [s.__dict__ for s in shared.sites] == [s.__dict__ for s in plain.sites]
