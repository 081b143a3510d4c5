"""``WideExperts``: the bordered buffer's layouts, the products it gives (forward and input gradient
against plain float64 math, both layouts), the border loads (stale rows and columns cleared when the
rank shrinks or the adapter goes), ``holds`` after the parameter is re-homed, bad input named."""

import copy

import pytest
import torch

from fasttune.kernels.moe_wide import WideExperts

E, IN, OUT, R = 3, 4, 5, 8


def _wide(transposed: bool, dtype=torch.float64):
    shape = (E, IN + R, OUT + R) if transposed else (E, OUT + R, IN + R)
    wide = WideExperts(torch.zeros(shape, dtype=dtype), IN, OUT, transposed)
    g = torch.Generator().manual_seed(int(transposed))
    weight = torch.nn.Parameter(torch.randn(wide.weight_view().shape, generator=g, dtype=dtype), requires_grad=False)
    wide.weight_view().copy_(weight)
    weight.data = wide.weight_view()
    return wide, weight


@pytest.mark.parametrize("transposed", [False, True])
def test_bordered_products_give_lora_forward_and_input_gradient(transposed):
    """[z | z Aᵀ | 0] · forward_weight = z Wᵀ + s z Aᵀ Bᵀ and [dY | s dY B | 0] ·
    backward_weight = dY W + s (dY B) A, per expert, against float64 math on the separate factors."""
    wide, weight = _wide(transposed)
    g = torch.Generator().manual_seed(5)
    r, s = 6, 0.75
    a, b = torch.randn(E, r, IN, generator=g, dtype=torch.float64), torch.randn(E, OUT, r, generator=g,
                                                                                dtype=torch.float64)
    wide.load(a, b, s)
    w_oi = weight.transpose(1, 2) if transposed else weight  # W [E, out, in]
    z, dy = torch.randn(7, IN, generator=g, dtype=torch.float64), torch.randn(7, OUT, generator=g, dtype=torch.float64)
    for e in range(E):
        rank = z @ a[e].t()
        z_ext = torch.cat((z, rank, torch.zeros(7, R - r, dtype=torch.float64)), 1)
        torch.testing.assert_close(z_ext @ wide.forward_weight()[e], z @ w_oi[e].t() + s * rank @ b[e].t())
        dyb = dy @ wide.scaled_lora_b()[e]
        torch.testing.assert_close(dyb, s * dy @ b[e])
        dy_ext = torch.cat((dy, dyb, torch.zeros(7, R - r, dtype=torch.float64)), 1)
        torch.testing.assert_close(dy_ext @ wide.backward_weight()[e], dy @ w_oi[e] + dyb @ a[e])
    assert torch.equal(wide.lora_a(), a)


@pytest.mark.parametrize("transposed", [False, True])
def test_border_loads_clear_stale_rows_and_columns_and_keep_the_weight(transposed):
    wide, weight = _wide(transposed)
    before = weight.detach().clone()
    assert wide.holds(weight) and wide.extra == R and weight.shape == ((E, IN, OUT) if transposed else (E, OUT, IN))
    assert wide.forward_weight().shape == (E, IN + R, OUT)
    assert wide.backward_weight().shape == (E, OUT + R, IN)
    wide.load(torch.ones(E, 6, IN), torch.ones(E, OUT, 6), 2.0)
    nonzero = wide.buf.ne(0).sum().item()
    assert nonzero == weight.ne(0).sum().item() + E * 6 * (IN + OUT)
    wide.load(torch.full((E, 2, IN), 3.0), torch.full((E, OUT, 2), 1.0), 0.5)  # a smaller rank: stale parts cleared
    assert wide.lora_a().eq(3).all() and wide.scaled_lora_b().eq(0.5).all()
    assert wide.buf.ne(0).sum().item() == weight.ne(0).sum().item() + E * 2 * (IN + OUT)
    wide.load(None, None)
    assert torch.equal(weight, before) and wide.buf.ne(0).sum().item() == weight.ne(0).sum().item()
    assert wide.lora_a().shape == (E, 0, IN)
    weight.data = weight.data.contiguous()
    assert not wide.holds(weight)


def test_bad_rank_and_buffer_are_named_and_deepcopy_drops_it():
    wide = WideExperts(torch.zeros(2, 3 + 4, 5 + 4), 5, 3, transposed=False)
    with pytest.raises(ValueError, match="rank 5"):
        wide.load(torch.ones(2, 5, 5), torch.ones(2, 3, 5))
    with pytest.raises(ValueError, match="come together"):
        wide.load(torch.ones(2, 2, 5), None)
    with pytest.raises(ValueError, match="R ≥ 1"):
        WideExperts(torch.zeros(2, 3, 5), 5, 3, transposed=False)
    with pytest.raises(ValueError, match="R ≥ 1"):
        WideExperts(torch.zeros(2, 3 + 4, 5 + 2), 5, 3, transposed=False)  # borders of different widths
    with pytest.raises(ValueError, match="contiguous"):
        WideExperts(torch.zeros(2, 9, 7).transpose(1, 2), 5, 3, transposed=False)
    assert copy.deepcopy({"w": wide}) == {"w": None}
