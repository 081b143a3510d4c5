"""Re-homing expert weights for the fused LoRA fold (``moe_widen``): which weights are widened
(frozen dense ones that own their storage, on a device the kernels run on), re-widening for a
larger rank, a stale buffer dropped after ``.to()``-style re-homing, and ``unwiden_experts``
giving contiguous storage back with the values unchanged. The fold's numbers: test_grouped_mlp.py
(kernel) and test_moe.py (stock vs patched models)."""

import pytest
import torch
from torch import nn

from fasttune.kernels.moe_wide import RANK_MULTIPLE
from fasttune.model_patches import moe_widen
from fasttune.model_patches.lora_widen import owns_storage
from fasttune.model_patches.moe_widen import WIDE_EXPERTS_ATTR, UnwidenExperts, wide_experts


class _Experts(nn.Module):
    def __init__(self, transposed=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shape = (3, 8, 6) if transposed else (3, 6, 8)  # in = 8, out = 6
        self.gate_up_proj = nn.Parameter(torch.randn(*shape, generator=g), requires_grad=False)


@pytest.mark.parametrize("transposed", [False, True])
def test_widens_a_frozen_weight_and_unwidens_it(transposed):
    experts = _Experts(transposed)
    before = experts.gate_up_proj.detach().clone()
    param = experts.gate_up_proj
    wide = wide_experts(experts, "gate_up_proj", 4, transposed)
    assert wide is not None and wide.extra == RANK_MULTIPLE and experts.gate_up_proj is param
    assert wide.buf.shape == ((3, 8 + RANK_MULTIPLE, 6 + RANK_MULTIPLE) if transposed else
                              (3, 6 + RANK_MULTIPLE, 8 + RANK_MULTIPLE))  # bordered: rows and columns
    assert wide.holds(param) and torch.equal(param, before) and not owns_storage(param)
    assert wide_experts(experts, "gate_up_proj", 16, transposed) is wide  # the border already fits
    bigger = wide_experts(experts, "gate_up_proj", 17, transposed)  # a larger adapter: re-widened from the view
    assert bigger is not wide and bigger.extra == 2 * RANK_MULTIPLE and torch.equal(param, before)
    UnwidenExperts(experts)()
    assert owns_storage(param) and torch.equal(param, before) and WIDE_EXPERTS_ATTR not in experts.__dict__


def test_what_is_not_widened(monkeypatch):
    experts = _Experts()
    experts.gate_up_proj.requires_grad_(True)  # trained (full fine-tuning): kept as it is
    assert wide_experts(experts, "gate_up_proj", 4, False) is None
    experts.gate_up_proj.requires_grad_(False)
    assert wide_experts(experts, "gate_up_proj", 0, False) is None  # no adapter
    view = _Experts()
    view.gate_up_proj.data = torch.zeros(2, 3, 6, 8)[0]  # a view into a larger buffer (a flat shard)
    assert wide_experts(view, "gate_up_proj", 4, False) is None
    monkeypatch.setattr(moe_widen, "use_triton", lambda *t: False)  # a CPU without Triton: the reference path
    assert wide_experts(experts, "gate_up_proj", 4, False) is None
    assert all(owns_storage(e.gate_up_proj) or e is view for e in (experts, view))


def test_a_rehomed_weight_drops_the_stale_buffer():
    experts = _Experts()
    wide = wide_experts(experts, "gate_up_proj", 4, False)
    experts.gate_up_proj.data = experts.gate_up_proj.data.contiguous()  # what .to() or a sharder does
    again = wide_experts(experts, "gate_up_proj", 4, False)
    assert again is not None and again is not wide and again.holds(experts.gate_up_proj)
