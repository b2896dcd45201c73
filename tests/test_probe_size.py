"""A site with a large activation is inferred on a smaller input: only axes the module computes independently are
cut, and the contract is the one inferred on the recorded shape."""

import pytest
import torch
from torch import nn

from normscope import infer, scan
from normscope.sites.probe_size import BUDGET, CUT_TO, same_layout, smaller_shape


class WholeAxisScale(nn.Module):
    """Divides by the RMS over axis 1 with no other dependence: axis 1 must not be cut."""

    def forward(self, x):
        return x / x.pow(2).mean(dim=1, keepdim=True).add(1e-5).sqrt()


CASES = [
    # (module, recorded shape, expected probe shape)
    (nn.BatchNorm2d(32).eval(), (1, 32, 512, 512), (1, 32, CUT_TO, CUT_TO)),  # running statistics: rows independent
    (nn.LayerNorm(64).eval(), (4, 4096, 64), (4, CUT_TO, 64)),  # the sequence axis
    (nn.GroupNorm(8, 32).eval(), (2, 32, 64, 64), (2, 32, 64, 64)),  # the statistics read H and W; C shapes γ
    (nn.InstanceNorm1d(16, affine=True).eval(), (1, 16, 8192), (1, 16, 8192)),  # the statistics read the length
    (WholeAxisScale().eval(), (2, 4096, 16), (2, 4096, CUT_TO)),  # the last axis is independent
    (nn.LayerNorm(64).eval(), (2, 8, 64), (2, 8, 64)),  # small: probed as recorded
]


@pytest.mark.parametrize("module,shape,expected", CASES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module)
                         else None)
def test_only_independent_axes_are_cut(module, shape, expected):
    probed, evidence = smaller_shape(module, shape, torch.float32)
    assert probed == expected
    assert (evidence is None) == (probed == shape)
    if evidence is not None:
        assert evidence["measured"]["recorded_shape"] == list(shape)
        cut = [a["axis"] for a in evidence["measured"]["axes"] if "cut_to" in a]
        assert cut == [a for a in range(len(shape)) if probed[a] != shape[a]]


def test_sixteen_bit_and_training_are_probed_as_recorded():
    shape = (1, 32, 64, 64)
    assert smaller_shape(nn.BatchNorm2d(32).eval(), shape, torch.bfloat16) == (shape, None)
    assert smaller_shape(nn.BatchNorm2d(32).train(), shape, torch.float32) == (shape, None)


@pytest.mark.parametrize("module,shape", [(nn.BatchNorm2d(24).eval(), (1, 24, 96, 96)),
                                          (nn.LayerNorm(32, eps=1e-6).eval(), (2, 2048, 32))])
def test_contract_on_the_smaller_input_is_the_recorded_ones(module, shape):
    probed, _ = smaller_shape(module, shape, torch.float32)
    assert probed != shape and torch.Size(probed).numel() <= BUDGET
    small, whole = infer(module, shape=probed), infer(module, shape=shape)
    assert small.spec == whole.spec
    assert same_layout(small.spec, shape, probed)


def test_a_layout_shaped_by_a_cut_axis_is_not_the_same():
    # γ over the last two axes: cutting one changes the parameters' shape
    spec = infer(nn.LayerNorm((16, 16)), shape=(2, 16, 16)).spec
    assert not same_layout(spec, (2, 16, 16), (2, 16, 8))
    assert same_layout(spec, (64, 16, 16), (8, 16, 16))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16, eps=1e-3)
        self.gn = nn.GroupNorm(4, 16)

    def forward(self, x):
        return self.gn(torch.relu(self.bn(self.conv(x))))


def test_scan_reports_the_probe_shape_and_holds_the_site_to_its_whole_activation():
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2)
    result = scan(model, torch.randn(1, 3, 160, 160), progress=False)
    sites = {s.name: s for s in result.sites}
    bn, gn = sites["bn"], sites["gn"]
    assert bn.spec.eps == pytest.approx(1e-3, rel=1e-3) and bn.spec.batch_stats == "running"
    assert bn.evidence["probe_shape"]["measured"]["probe_shape"] == [1, 16, CUT_TO, 160]
    assert bn.activation["ok"] and bn.shape == (1, 16, 160, 160)
    assert "probe_shape" not in gn.evidence and gn.spec.groups == 4
