"""``WideExperts``: the buffer layouts, the tail B is loaded into (stale columns cleared when the
rank shrinks or the adapter goes), ``holds`` after the parameter is re-homed, bad ranks named."""

import copy

import pytest
import torch

from fasttune.kernels.moe_wide import WideExperts


def test_tail_load_and_holds():
    buf = torch.zeros(3, 5, 4 + 8)
    wide = WideExperts(buf, 4, transposed=False)
    weight = torch.nn.Parameter(torch.randn(3, 5, 4), requires_grad=False)
    wide.weight_view().copy_(weight)
    weight.data = wide.weight_view()
    assert wide.holds(weight) and wide.extra == 8
    assert wide.kn().shape == (3, 12, 5)
    wide.load(torch.ones(3, 5, 6))
    assert buf[:, :, 4:10].eq(1).all() and buf[:, :, 10:].eq(0).all()
    wide.load(torch.full((3, 5, 2), 2.0))  # a smaller rank: the stale columns are cleared
    assert buf[:, :, 4:6].eq(2).all() and buf[:, :, 6:].eq(0).all()
    wide.load(None)
    assert buf[:, :, 4:].eq(0).all() and torch.equal(buf[:, :, :4], weight)
    weight.data = weight.data.contiguous()
    assert not wide.holds(weight)


def test_transposed_layout_puts_b_transposed_under_the_weight():
    wide = WideExperts(torch.zeros(3, 4 + 8, 5), 4, transposed=True)
    assert wide.weight_view().shape == (3, 4, 5) and wide.weight_view().stride() == (60, 5, 1)
    assert wide.kn().shape == (3, 12, 5)
    b = torch.randn(3, 5, 3)
    wide.load(b)
    assert torch.equal(wide.buf[:, 4:7], b.transpose(1, 2)) and wide.buf[:, 7:].eq(0).all()


def test_bad_rank_and_buffer_are_named_and_deepcopy_drops_it():
    wide = WideExperts(torch.zeros(2, 3, 4 + 4), 4, transposed=False)
    with pytest.raises(ValueError, match="rank 5"):
        wide.load(torch.ones(2, 3, 5))
    with pytest.raises(ValueError, match="in_features"):
        WideExperts(torch.zeros(2, 3, 8), 8, transposed=False)
    with pytest.raises(ValueError, match="contiguous"):
        WideExperts(torch.zeros(2, 8, 3).transpose(1, 2), 4, transposed=False)
    assert copy.deepcopy({"w": wide}) == {"w": None}
