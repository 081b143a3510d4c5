"""lora_adapters.py: the adapters in the compute dtype, and X·[A_p; …]ᵀ per group of projections.

Against plain torch: the stacked A is the adapters' A's cast and stacked in call order (projections
without an adapter left out), XA its product with X, B cast per adapter and left to a widened group's
buffer (None) when the group runs widened; a checkpointed layer's recompute gets the forward's very
tensors back (``forward_reuse.py``).
"""

from __future__ import annotations

import torch

from fasttune.kernels.forward_reuse import ForwardReuse, entering, leaving
from fasttune.kernels.lora import BaseWeight
from fasttune.kernels.lora_adapters import adapters_of, b_as, cast_b, stack_a, stacked_xa


def _adapters(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a_q, b_q = torch.randn(4, 24, generator=g), torch.randn(40, 4, generator=g)
    a_v, b_v = torch.randn(6, 24, generator=g), torch.randn(8, 6, generator=g)
    return adapters_of((a_q, b_q, None, None, a_v, b_v), (2.0, 1.0, 0.5))


def test_stacked_a_and_xa_in_the_compute_dtype_skipping_projections_without_an_adapter():
    adapters = _adapters()
    assert adapters[1] is None and adapters[0][2] == 2.0 and adapters[2][2] == 0.5
    x2 = torch.randn(7, 24).bfloat16()
    xa, a = stacked_xa(x2, adapters)
    want_a = torch.cat([adapters[0][0], adapters[2][0]]).bfloat16()
    assert a.dtype == torch.bfloat16 and torch.equal(a, want_a) and torch.equal(stack_a(adapters, torch.bfloat16), a)
    assert xa.shape == (7, 10) and torch.equal(xa, x2 @ want_a.t())
    assert stacked_xa(x2, [None, None]) == (None, None) and stack_a([None], torch.float32) is None


def test_b_cast_per_adapter_and_left_to_a_widened_groups_buffer():
    adapters = _adapters(1)
    bases = [BaseWeight(torch.randn(40, 24)), BaseWeight(torch.randn(8, 24)), BaseWeight(torch.randn(8, 24))]
    bs = cast_b(bases, adapters, torch.bfloat16)
    assert bs[1] is None and torch.equal(bs[0], adapters[0][1].bfloat16())
    assert torch.equal(bs[2], adapters[2][1].bfloat16())
    assert b_as(adapters[0], bs[0], torch.bfloat16) is bs[0]
    assert torch.equal(b_as(adapters[0], bs[0], torch.float16), adapters[0][1].half())  # another dtype: cast now
    assert b_as(adapters[2], None, torch.float32) is adapters[2][1]


def test_a_recompute_gets_the_forwards_tensors_back():
    adapters = _adapters(2)
    bases = [BaseWeight(torch.randn(40, 24)), BaseWeight(torch.randn(8, 24)), BaseWeight(torch.randn(8, 24))]
    x2 = torch.randn(7, 24)
    reuse, out = ForwardReuse(), []
    for replay in (False, True):
        token = entering(reuse, replay)
        try:
            out.append((stacked_xa(x2.clone(), adapters), cast_b(bases, adapters, torch.bfloat16)))
        finally:
            leaving(token)
    (xa, a), bs = out[0]
    (xa2, a2), bs2 = out[1]
    assert xa2 is xa and a2 is a and all(u is v for u, v in zip(bs, bs2)) and reuse.hits == 2
