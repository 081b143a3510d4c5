"""The shared additive bias (``mask_bias.py``): torch's own conversion of a boolean mask, bit for bit through sdpa
(forward and every gradient), aligned rows, and one bias per mask."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from fasttune.model_patches.mask_bias import ALIGN, SharedMaskBias, additive_bias, sdpa_dtype, shareable


def _padded_causal(batch: int, q: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(k // 2, k + 1, (batch,), generator=g)
    keys = torch.arange(k)[None, :] < lengths[:, None]
    causal = torch.arange(q)[:, None] + (k - q) >= torch.arange(k)[None, :]
    return (causal[None] & keys[:, None, :])[:, None]  # [batch, 1, q, k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [37, 64])
def test_sdpa_with_the_bias_is_sdpa_with_the_mask_bit_for_bit(dtype, k):
    batch, heads, q, d = 3, 4, k, 24
    mask = _padded_causal(batch, q, k, seed=k)
    bias = additive_bias(mask, dtype)
    assert bias.dtype == dtype and bias.shape == mask.shape
    assert all(s % ALIGN == 0 for s in bias.stride()[:-1]) and bias.stride(-1) == 1
    assert torch.equal(bias == 0, mask) and bool(torch.isneginf(bias[~mask]).all())
    g = torch.Generator().manual_seed(1)
    qkv = [torch.randn(batch, heads, n, d, generator=g).to(dtype).requires_grad_() for n in (q, k, k)]
    grad = torch.randn(batch, heads, q, d, generator=g).to(dtype)
    outs = []
    for m in (mask, bias):
        xs = [x.detach().clone().requires_grad_() for x in qkv]
        out = F.scaled_dot_product_attention(*xs, attn_mask=m)
        out.backward(grad)
        outs.append((out, *[x.grad for x in xs]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # and against float64 math: the bias is the mask
    x64 = [x.detach().double() for x in qkv]
    scores = x64[0] @ x64[1].transpose(-1, -2) / d ** 0.5 + bias.double()
    ref = scores.softmax(-1) @ x64[2]
    assert torch.allclose(outs[0][0].double(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_one_bias_per_mask_while_something_holds_it():
    shared = SharedMaskBias()
    mask = _padded_causal(2, 9, 9, seed=0)
    a = shared.get(mask, torch.float32)
    assert shared.get(mask, torch.float32) is a and shared.made == 1
    b = shared.get(mask, torch.bfloat16)
    assert b is not a and shared.made == 2  # another dtype
    other = shared.get(mask.clone(), torch.bfloat16)
    assert other is not b and shared.made == 3  # another mask: a new forward
    mask2 = mask.clone()
    c = shared.get(mask2, torch.bfloat16)
    mask2[0, 0, 0, 0] = False  # written in place: the bias no longer says what the mask does
    d = shared.get(mask2, torch.bfloat16)
    assert d is not c and shared.made == 5 and bool(torch.isneginf(d[0, 0, 0, 0]))
    assert shared.get(mask2, torch.bfloat16) is d  # held between calls: the cores keep aliases, not the tensor
    del mask2
    gc.collect()
    assert shared.get(mask.clone(), torch.bfloat16) is not d and shared.made == 6  # the mask died: a new one


def test_shareable_only_for_a_boolean_4d_mask_to_sdpa_in_training():
    q = torch.zeros(2, 4, 9, 8, requires_grad=True)
    mask = _padded_causal(2, 9, 9, seed=0)
    assert shareable(mask, "sdpa", q)
    assert not shareable(mask, "eager", q) and not shareable(None, "sdpa", q)
    assert not shareable(mask.float(), "sdpa", q) and not shareable(mask[:, 0], "sdpa", q)
    assert not shareable(mask, "sdpa", q.detach())
    assert sdpa_dtype(q) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sdpa_dtype(q) == torch.bfloat16
