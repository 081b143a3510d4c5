"""The MoE reference ops against independent formulations (the oracle must itself be right):
grouped products against one product per row, the expert MLP against a dense all-experts
computation masked by the routing, LoRA against the merged weight W + s·B A, and the CPU path
(no Triton) of the public functions against the reference."""

import torch

from fasttune.kernels import moe_reference as reference
from fasttune.kernels.moe_reference import ExpertGLU, ExpertProjection


def test_grouped_mm_is_a_product_per_row():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 0, 2, 2, 2, 2, 2, 2, 2])
    offs = torch.tensor([2, 2, 9], dtype=torch.int32)
    want = torch.stack([x[r] @ w[ids[r]] for r in range(9)])
    assert torch.allclose(reference.grouped_mm(x, w, offs), want)
    wg = reference.grouped_mm_wgrad(x, want, offs, 3)
    assert torch.equal(wg[1], torch.zeros(5, 4, dtype=torch.float64))
    assert torch.allclose(wg[2], x[2:].t() @ want[2:])


def test_grouped_mlp_is_dense_experts_masked_by_routing():
    g = torch.Generator().manual_seed(1)
    T, H, I, E, R = 6, 8, 5, 4, 2
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gu = ExpertProjection(rnd(E, 2 * I, H), None, rnd(E, R, H), rnd(E, 2 * I, R), 0.5)
    dn = ExpertProjection(rnd(E, H, I), None, rnd(E, R, I), rnd(E, H, R), 2.0)
    x = rnd(T, H)
    index = torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [3, 1], [0, 3]])  # expert 2 unused
    weights = torch.rand(T, 2, generator=g, dtype=torch.float64)
    merged = lambda p: p.weight + p.scaling * p.lora_b @ p.lora_a  # noqa: E731  PEFT's delta per expert
    dense = []
    for e in range(E):
        gate, up = (x @ merged(gu)[e].t()).chunk(2, dim=-1)
        dense.append((torch.nn.functional.silu(gate) * up) @ merged(dn)[e].t())
    dense = torch.stack(dense, dim=1)  # [T, E, H]
    route = torch.zeros(T, E, dtype=torch.float64).scatter(1, index, weights)
    want = (route[:, :, None] * dense).sum(1)
    assert torch.allclose(reference.grouped_mlp(x, index, weights, gu, dn, ExpertGLU("silu")), want)


def test_clamped_swiglu_reads_interleaved_columns():
    gu = torch.tensor([[1.0, 2.0, 20.0, -30.0]])  # gate 1, up 2 | gate 20 → 7, up -30 → -7
    h = reference.moe_glu(gu, torch.tensor([2.0]), ExpertGLU("clamped_swiglu", 1.702, 7.0))
    want = torch.tensor([[2 * 3 * torch.sigmoid(torch.tensor(1.702)), 2 * -6 * 7 * torch.sigmoid(torch.tensor(7 * 1.702))]])
    assert torch.allclose(h, want)
