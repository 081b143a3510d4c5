"""NF4Weight: a frozen weight of any shape held as bitsandbytes NF4 codes in uint8 buffers.

Against bitsandbytes itself (quantize_4bit → dequantize_4bit, its flat CPU call): bit for bit for
stacked 3-D expert weights, nested or not, every dtype. The module behaves as a holder should:
``model.to(dtype)`` moves but never rounds its scales, ``copy.deepcopy`` and ``state_dict``
carry it, it reads like the dense tensor (shape, dtype, device, dim, numel), it holds far fewer
bytes than the dense tensor, and an in-place use of ``.data`` (PEFT's merge) is refused by name.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fasttune.kernels.nf4_weight import NF4Weight

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _quantize(w, nested, blocksize=64):
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    packed, state = bnb_f.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    return packed, state, bnb_f


def _bnb_dequantize(bnb_f, packed, state):
    if packed.is_cuda:
        return bnb_f.dequantize_4bit(packed, state)
    flat = copy.copy(state)
    flat.shape = torch.Size([math.prod(state.shape)])
    with torch.compiler.set_stance("force_eager"):
        return bnb_f.dequantize_4bit(packed, flat).reshape(state.shape)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_bitsandbytes(device, dtype, nested):
    torch.manual_seed(1)
    for shape in ((4, 64, 96), (3, 96, 21)):  # 3·96·21 values: the last block is partial
        w = torch.randn(shape, dtype=dtype, device=device)
        packed, state, bnb_f = _quantize(w, nested)
        held = NF4Weight(packed, state)
        out = held.dequantize()
        assert out.shape == shape and out.dtype == dtype and not out.requires_grad
        assert torch.equal(out, _bnb_dequantize(bnb_f, packed, state))
        buf = torch.empty(shape, dtype=dtype, device=device)
        assert held.dequantize(out=buf) is buf and torch.equal(buf, out)
        assert all(b.dtype == torch.uint8 for b in held.buffers())


@pytest.mark.parametrize("nested", [False, True])
def test_dequantize_experts_is_the_whole_weight_sliced(device, nested):
    torch.manual_seed(4)
    # 5 experts of 256·128 values: 512 blocks of 64 each, two second-level blocks of 256
    held = NF4Weight(*_quantize(torch.randn(5, 256, 128, device=device), nested)[:2])
    whole = held.dequantize()
    for ids in ([3], [0, 2, 4], [4, 1], list(range(5))):
        ids = torch.tensor(ids, device=device)
        assert torch.equal(held.dequantize_experts(ids), whole[ids])
    # an expert whose codes start inside a block (or a second-level block): the caller goes whole
    odd = NF4Weight(*_quantize(torch.randn(3, 40, 20, device=device), nested)[:2])  # 800 values: 12.5 blocks
    assert odd.dequantize_experts(torch.tensor([1], device=device)) is None
    if nested:
        part = NF4Weight(*_quantize(torch.randn(3, 64, 64, device=device), nested)[:2])  # 64 blocks per expert
        assert part.dequantize_experts(torch.tensor([1], device=device)) is None


def test_reads_like_the_dense_tensor_and_holds_fewer_bytes(device):
    w = torch.randn(4, 64, 96, dtype=torch.bfloat16, device=device)
    held = NF4Weight(*_quantize(w, nested=True)[:2])
    assert held.shape == w.shape and held.dtype == w.dtype and held.device == w.device
    assert held.dim() == held.ndim == 3 and held.numel() == w.numel() and held.size(1) == 64
    assert not held.requires_grad and list(held.parameters()) == []
    n = w.numel()
    # 4 bits a value + one 8-bit scale per 64 values + the second level (256 fp32 codes, fp32 scales, offset)
    assert held.bytes_held() == n // 2 + n // 64 + 256 * 4 + 4 * -(-(n // 64) // 256) + 4
    assert held.bytes_held() <= 0.28 * n * w.element_size()
    assert "blocksize=64" in repr(held) and "nested=True" in repr(held)


def test_module_casts_move_but_never_round_the_scales(device):
    torch.manual_seed(2)
    w = torch.randn(3, 64, 64, device=device)
    holder = nn.Module()
    holder.w = NF4Weight(*_quantize(w, nested=False)[:2])
    before = holder.w.dequantize()
    holder.to(torch.bfloat16)  # model.to(dtype): floating buffers would be rounded
    assert torch.equal(holder.w.dequantize(), before) and holder.w.dtype == torch.float32
    twin = copy.deepcopy(holder)
    assert torch.equal(twin.w.dequantize(), before) and twin.w.packed.data_ptr() != holder.w.packed.data_ptr()
    state = holder.state_dict()
    assert set(state) == {"w.packed", "w.absmax"}
    fresh = nn.Module()
    fresh.w = NF4Weight(*_quantize(torch.zeros_like(w), nested=False)[:2])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.w.dequantize(), before)


def test_in_place_data_and_bad_states_are_refused(device):
    w = torch.randn(2, 64, 64, device=device)
    packed, state, _ = _quantize(w, nested=False)
    held = NF4Weight(packed, state)
    with pytest.raises(RuntimeError, match="held in NF4.*save_merged.*unpatch_model"):
        held.data += 1  # PEFT's ParamWrapper.merge
    fp4 = copy.copy(state)
    fp4.quant_type = "fp4"
    with pytest.raises(ValueError, match="quant_type"):
        NF4Weight(packed, fp4)
    with pytest.raises(ValueError, match="packed holds"):
        NF4Weight(packed[:10], state)
    wrong = copy.copy(state)
    wrong.dtype = torch.int8
    with pytest.raises(TypeError, match="quant_state.dtype"):
        NF4Weight(packed, wrong)
