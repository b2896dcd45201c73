"""The shape layer: resolved axes, grouping, parameter broadcast and slicing, parameter and statistics shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from normscope import check, reference
from normscope.errors import InputError
from normscope.groups import Groups
from normscope.layout import Layout, broadcast, param_shape, sizes, stats_shape, take, view_shape
from normscope.nn import Norm
from normscope.spec import NormSpec


@st.composite
def spec_and_shape(draw):
    """A random spec (axes spelled negative or not, optional groups, parameters along any axes) and a shape it fits."""
    ndim = draw(st.integers(1, 4))
    shape = list(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    axes = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    signs = draw(st.lists(st.booleans(), min_size=len(axes), max_size=len(axes)))
    given_axes = [a - ndim if neg else a for a, neg in zip(axes, signs, strict=True)]
    groups = group_axis = None
    if draw(st.booleans()):
        i = draw(st.integers(0, len(axes) - 1))
        groups = draw(st.integers(1, 3))
        shape[axes[i]] = groups * draw(st.integers(1, 3))
        group_axis = given_axes[i]  # as the spec lists it (a spec requires group_axis among its axes, spelled alike)
    gamma, beta = draw(st.booleans()), draw(st.booleans())
    param_axes = draw(st.lists(st.integers(-ndim, ndim - 1), max_size=ndim, unique_by=lambda a: a % ndim)) \
        if (gamma or beta) else []
    spec = NormSpec(axes=given_axes, groups=groups, group_axis=group_axis, gamma=gamma, beta=beta,
                    param_axes=param_axes, batch_stats=draw(st.sampled_from((None, "batch", "running"))))
    return spec, tuple(shape)


@given(spec_and_shape())
def test_layout_resolves_axes_and_counts(case):
    spec, shape = case
    lay = Layout.of(spec, shape)
    ndim = len(shape)
    assert lay.axes == tuple(sorted(a % ndim for a in spec.axes))
    assert lay.kept_axes == tuple(a for a in range(ndim) if a not in lay.axes)
    assert lay.param_axes == tuple(sorted(a % ndim for a in spec.param_axes))
    assert lay.stats_axes == tuple(a for a in lay.kept_axes if a != 0)
    assert sorted(lay.param_grad_axes + lay.param_axes) == list(range(ndim))
    assert lay.param_shape == param_shape(shape, spec) == tuple(shape[a] for a in lay.param_axes)
    assert lay.stats_shape == stats_shape(shape, spec)
    assert lay.stats_shape == (tuple(shape[a] for a in lay.stats_axes) if spec.batch_stats else ())
    # one statistic per slice of the grouped shape: count × statistics = all elements
    statistics = math.prod(lay.grouped_shape) // lay.count
    per_group = spec.groups or 1
    assert lay.count * statistics == math.prod(shape)
    assert lay.count == math.prod(shape[a] for a in lay.axes) // per_group
    assert math.prod(lay.grouped_shape) == math.prod(shape)


@given(spec_and_shape())
def test_grouped_reshape_agrees_with_group_labels(case):
    """Reducing the grouped shape over reduce_axes visits exactly the positions groups.py labels as one group."""
    spec, shape = case
    lay = Layout.of(spec, shape)
    g = Groups.of(spec, shape)
    assert g.size == lay.count
    labels = lay.group(g.labels)
    lo = labels.min(axis=lay.reduce_axes)
    hi = labels.max(axis=lay.reduce_axes)
    np.testing.assert_array_equal(lo, hi)  # each reduced slice is one group
    assert np.unique(lo).size == lo.size == g.count  # and different slices are different groups
    x = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    np.testing.assert_array_equal(lay.ungroup(lay.group(x)), x)
    sums = lay.group(x).sum(axis=lay.reduce_axes, keepdims=True)
    np.testing.assert_array_equal(lay.ungroup(np.broadcast_to(sums, lay.grouped_shape)), g.spread(g.sum(x)))


@given(spec_and_shape(), st.integers(0, 2**32 - 1))
def test_broadcast_and_take_are_inverse(case, seed):
    spec, shape = case
    lay = Layout.of(spec, shape)
    rng = np.random.default_rng(seed)
    v = rng.normal(size=lay.param_shape)
    full = np.broadcast_to(lay.expand(v, lay.param_axes, "gamma"), shape)
    np.testing.assert_array_equal(take(full, lay.param_axes), v)
    # a flattened parameter of the right size is the same parameter
    np.testing.assert_array_equal(broadcast(v.ravel(), shape, lay.param_axes), lay.expand(v, lay.param_axes, "g"))
    # the full map varies along the parameter axes only
    for a in range(len(shape)):
        if a not in lay.param_axes:
            np.testing.assert_array_equal(full, np.broadcast_to(full.take([0], axis=a), shape))
    # torch tensors take the same view shape
    t = torch.from_numpy(v).reshape(view_shape(shape, lay.param_axes))
    np.testing.assert_array_equal(torch.broadcast_to(t, shape).numpy(), full)


def test_broadcast_rejects_wrong_sizes_and_keeps_none():
    with pytest.raises(InputError, match=r"gamma has shape \(5,\).*must have shape \(4,\).*axes \[2\]"):
        broadcast(np.ones(5), (2, 3, 4), (2,), "gamma")
    assert broadcast(None, (2, 3), (1,)) is None
    given_values = np.arange(4.0)
    broadcast(given_values, (2, 4), (1,))
    np.testing.assert_array_equal(given_values, np.arange(4.0))  # nothing the caller passed is modified


def test_take_reads_index_zero_off_the_axes():
    full = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(take(full, (1,)), full[0, :, 0])
    np.testing.assert_array_equal(take(full, (0, 2)), full[:, 0, :])
    assert take(torch.from_numpy(full), (2,)).shape == (4,)
    assert sizes((2, 3, 4), (2, 0)) == (4, 2)
    assert view_shape((2, 3, 4), (0, 2)) == (2, 1, 4)


def test_groupnorm_layout_by_hand():
    lay = Layout.of(NormSpec.preset("torch_groupnorm", groups=2), (3, 4, 5, 6))
    assert lay.grouped_shape == (3, 2, 2, 5, 6)
    assert lay.reduce_axes == (2, 3, 4)
    assert lay.count == 2 * 5 * 6
    assert (lay.groups, lay.group_axis) == (2, 1)
    assert lay.param_shape == (4,) and lay.stats_shape == ()
    bn = Layout.of(NormSpec.preset("torch_batchnorm"), (8, 3, 5, 5))
    assert bn.stats_axes == (1,) and bn.stats_shape == (3,) and bn.count == 8 * 25


def test_layout_errors():
    with pytest.raises(InputError, match="0-d"):
        Layout.of(NormSpec(), ())
    with pytest.raises(InputError, match="5 channels.*multiple of groups"):
        Layout.of(NormSpec.preset("torch_groupnorm", groups=2), (2, 5, 2, 2))


def test_groups_of_an_indivisible_grouping_is_an_input_error():
    # before the layout, Groups.of let NumPy fail with "invalid entry in coordinates array" (a ValueError
    # that check() did not turn into its "the expected contract does not fit shape" error)
    spec = NormSpec.preset("torch_groupnorm", groups=2)
    with pytest.raises(InputError, match="multiple of groups"):
        Groups.of(spec, (2, 5, 3, 3))
    with pytest.raises(InputError, match=r"does not fit shape \(2, 5, 3, 3\): axis 1 has 5 channels"):
        check(lambda x: x, expect=spec, shape=(2, 5, 3, 3), framework="numpy")


def test_reference_reexports_the_shapes():
    assert "param_shape" in reference.__all__ and "stats_shape" in reference.__all__
    assert reference.param_shape is param_shape and reference.stats_shape is stats_shape


def test_module_refuses_an_input_its_parameters_do_not_fit():
    # a LayerNorm built for 8 features on inputs with 1: γ used to broadcast the output to (2, 8)
    module = Norm(NormSpec.preset("torch_layernorm"), 8, dtype=torch.float64)
    with pytest.raises(InputError, match=r"weight has shape \(8,\).*needs \(1,\)"):
        module(torch.ones(2, 1, dtype=torch.float64))
    assert module(torch.ones(2, 8, dtype=torch.float64)).shape == (2, 8)
