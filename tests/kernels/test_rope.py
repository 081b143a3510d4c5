"""RoPE kernel vs float64 math and the same-dtype reference (HF's formula), outputs and gradients.

fp32: within 1e-6 relative of the reference (HF's own fp32 formula) and float64. bf16/fp16:
|kernel − ref64| ≤ 2·|torch_same_dtype − ref64| + 1 ulp elementwise (the kernel rounds once, HF
rounds each product). Also: in-place semantics, GQA, partial rotary, packed position ids.
"""

import pytest
import torch

from fasttune.kernels import reference
from fasttune.kernels.rope import apply_rope

from helpers.kernel_checks import check_elementwise

B, S, DH = 2, 13, 24


def check(out, ref64, same, name):
    """fp32: within 1e-6 relative of float64 and of HF's fp32 formula; else the 2×-torch rule + 1 ulp."""
    lowp = None if out.dtype == torch.float32 else out.dtype
    check_elementwise(out, ref64, same, what=name, lowp=lowp, rtol=1e-6, fp32_vs_same=True)


def tables(rows, rot, dtype, device, seed=0, dup=True):
    """cos/sin of angles; dup: HF-style duplicated halves, else independent halves (the kernel
    does not assume duplication)."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(rows, rot // 2, generator=g) * 40
    emb = torch.cat((ang, ang if dup else torch.rand(rows, rot // 2, generator=g) * 40), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def run(rope, q_src, k_src, cos, sin, pos, weights):
    """q, k as transposed views of [B, S, H, Dh] activations (non-leaf, so rotated in place),
    rotated, then a weighted-sum loss; returns (q_rot, k_rot, dq_src, dk_src)."""
    q, k = (q_src * 1).transpose(1, 2), (k_src * 1).transpose(1, 2)
    qr, kr = rope(q, k, cos, sin, pos)
    loss = (qr * weights[0].to(qr.dtype)).sum() + (kr * weights[1].to(kr.dtype)).sum()
    return (qr, kr) + torch.autograd.grad(loss, (q_src, k_src))


def make(dtype, hq, hk, rot, device, cos_batch=B, pos=None, table_rows=None, dup=True):
    g = torch.Generator().manual_seed(1)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    q_src = mk(B, S, hq, DH).to(dtype).requires_grad_()
    k_src = mk(B, S, hk, DH).to(dtype).requires_grad_()
    weights = tuple(w.to(dtype) for w in (mk(B, hq, S, DH), mk(B, hk, S, DH)))
    if pos is None:
        cos, sin = tables(cos_batch * S, rot, dtype, device, dup=dup)
        cos, sin = cos.view(cos_batch, S, rot), sin.view(cos_batch, S, rot)
    else:
        cos, sin = tables(table_rows, rot, dtype, device, dup=dup)
    return q_src, k_src, cos, sin, weights


def compare(dtype, hq, hk, rot, device, cos_batch=B, pos=None, table_rows=None, dup=True):
    q_src, k_src, cos, sin, weights = make(dtype, hq, hk, rot, device, cos_batch, pos, table_rows, dup)
    got = run(apply_rope, q_src, k_src, cos, sin, pos, weights)
    same = run(reference.apply_rope, q_src, k_src, cos, sin, pos, weights)
    d = lambda t: t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    ref64 = run(reference.apply_rope, d(q_src), d(k_src), d(cos), d(sin), pos, tuple(map(d, weights)))
    for name, a, s, r in zip(["q", "k", "dq", "dk"], got, same, ref64):
        check(a, r, s, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("hq,hk", [(6, 6), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_rope_matches(device, dtype, hq, hk):
    compare(dtype, hq, hk, DH, device)


@pytest.mark.parametrize("hq,hk,rot", [(6, 2, DH), (8, 2, 16)], ids=["gqa3", "gqa4_partial"])
def test_gradients_through_projection_views(device, hq, hk, rot):
    """HF's graph: q = (x @ Wq).view(B, S, H, Dh).transpose(1, 2), rotated in place; fp32 grads of
    x, Wq, Wk match the reference graph and float64 tightly."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, 16, generator=g).to(device).requires_grad_()
    wq = (torch.randn(hq * DH, 16, generator=g) * 0.3).to(device).requires_grad_()
    wk = (torch.randn(hk * DH, 16, generator=g) * 0.3).to(device).requires_grad_()
    cos, sin = tables(S, rot, torch.float32, device)
    cos, sin = cos[None], sin[None]
    wts = torch.randn(B, hq, S, DH, generator=g).to(device), torch.randn(B, hk, S, DH, generator=g).to(device)

    def graph(rope, x, wq, wk, cos, sin):
        q = (x @ wq.t()).view(B, S, hq, DH).transpose(1, 2)
        k = (x @ wk.t()).view(B, S, hk, DH).transpose(1, 2)
        qr, kr = rope(q, k, cos, sin)
        loss = (qr * wts[0].to(qr.dtype)).sum() + (kr * wts[1].to(kr.dtype)).sum()
        return (qr, kr) + torch.autograd.grad(loss, (x, wq, wk))

    got = graph(apply_rope, x, wq, wk, cos, sin)
    same = graph(reference.apply_rope, x, wq, wk, cos, sin)
    d = lambda t: t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    ref64 = graph(reference.apply_rope, d(x), d(wq), d(wk), d(cos), d(sin))
    for name, a, s, r in zip(["q", "k", "dx", "dwq", "dwk"], got, same, ref64):
        check(a, r, s, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_partial_rotary_and_broadcast_cos(device, dtype):
    compare(dtype, 6, 2, 16, device, cos_batch=1, dup=False)  # Dr = 16 < Dh = 24, cos [1, S, Dr]
    compare(dtype, 4, 4, 10, device, dup=False)  # half = 5: not a power of two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_packed_position_ids(device, dtype):
    # two documents per row, positions restarting at 0; table of 40 positions
    pos = torch.tensor([list(range(5)) + list(range(8)), list(range(13))], device=device)
    compare(dtype, 6, 2, 16, device, pos=pos, table_rows=40, dup=False)
    compare(dtype, 6, 3, DH, device, pos=pos[1:].to(torch.int32), table_rows=13)  # [1, S] int32


def _qk(device, dtype=torch.float32, leaf=False):
    g = torch.Generator().manual_seed(3)
    qs = torch.randn(B, S, 4, DH, generator=g).to(device, dtype).requires_grad_()
    ks = torch.randn(B, S, 2, DH, generator=g).to(device, dtype).requires_grad_()
    if leaf:
        return qs, ks, qs.transpose(1, 2), ks.transpose(1, 2)
    return qs, ks, (qs * 1).transpose(1, 2), (ks * 1).transpose(1, 2)


def test_in_place_semantics(device):
    cos, sin = tables(S, DH, torch.float32, device)
    cos, sin = cos[None], sin[None]
    qs, ks, q, k = _qk(device)
    expect_q, expect_k = reference.apply_rope(q.detach(), k.detach(), cos, sin)
    q_before = q.detach().clone()
    ptr, version = q.data_ptr(), q._version
    qr, kr = apply_rope(q, k, cos, sin)
    assert qr.data_ptr() == ptr and q._version > version  # rotated in place, version bumped
    assert torch.allclose(q.detach(), expect_q, atol=1e-6) and not torch.allclose(q.detach(), q_before)
    assert torch.allclose(kr.detach(), expect_k, atol=1e-6)
    dq, dk = torch.autograd.grad((qr.sum() * 2 + (kr ** 2).sum()), (qs, ks))
    ref_q, ref_k = reference.apply_rope(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
    rq, rk = torch.autograd.grad((ref_q.sum() * 2 + (ref_k ** 2).sum()), (qs, ks))
    assert torch.allclose(dq, rq, atol=1e-5) and torch.allclose(dk, rk, atol=1e-5)


def test_out_of_place_when_unsafe_or_asked(device):
    cos, sin = tables(S, DH, torch.float32, device)
    cos, sin = cos[None], sin[None]
    qs, ks, q, k = _qk(device, leaf=True)  # views of leaves that require grad: never written
    before = qs.detach().clone()
    qr, kr = apply_rope(q, k, cos, sin)
    assert torch.equal(qs.detach(), before) and qr.data_ptr() != q.data_ptr()
    assert qr.stride() == q.stride()  # fresh output keeps q's layout
    dq, = torch.autograd.grad(qr.sum() + kr.sum(), (qs,))
    rq, = torch.autograd.grad(sum(t.sum() for t in reference.apply_rope(q, k, cos, sin)), (qs,))
    assert torch.allclose(dq, rq, atol=1e-6)
    _, _, q, k = _qk(device)
    before = q.detach().clone()
    qr, _ = apply_rope(q, k, cos, sin, inplace=False)
    assert torch.equal(q.detach(), before)
    with torch.no_grad():  # no autograd at all: in place
        qr, _ = apply_rope(q, k, cos, sin)
        assert qr.data_ptr() == q.data_ptr()


def test_pre_rotation_value_saved_elsewhere_fails_loudly(device):
    cos, sin = tables(S, DH, torch.float32, device)
    cos, sin = cos[None], sin[None]
    x = torch.randn(B, S, 4, DH, device=device, requires_grad=True)
    q = x.exp()  # exp saves its output for backward
    k = torch.randn(B, 2, S, DH, device=device)
    qr, _ = apply_rope(q.transpose(1, 2), k, cos, sin)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        qr.sum().backward()


def test_only_q_used(device):
    """k's output unused: its gradient is None through the Function."""
    cos, sin = tables(S, DH, torch.float32, device)
    cos, sin = cos[None], sin[None]
    qs, ks, q, k = _qk(device)
    qr, _ = apply_rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((qr * qr).sum(), (qs, ks), allow_unused=True)
    ref_q, _ = reference.apply_rope(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
    rq, = torch.autograd.grad((ref_q * ref_q).sum(), (qs,))
    assert torch.allclose(dq, rq, atol=1e-5) and (dk is None or not dk.any())


def test_bad_inputs(device):
    q = torch.randn(B, 4, S, DH, device=device)
    k = torch.randn(B, 2, S, DH, device=device)
    cos = torch.randn(B, S, DH, device=device)
    with pytest.raises(TypeError, match="q must be"):
        apply_rope(q.double(), k, cos, cos)
    with pytest.raises(ValueError, match="q and k must be"):
        apply_rope(q[0], k, cos, cos)
    with pytest.raises(ValueError, match="share B, S and Dh"):
        apply_rope(q, k[:, :, :5], cos, cos)
    with pytest.raises(ValueError, match="even"):
        apply_rope(q, k, cos[..., :7], cos[..., :7])
    with pytest.raises(ValueError, match="even"):
        apply_rope(q, k, torch.randn(B, S, 26, device=device), torch.randn(B, S, 26, device=device))
    with pytest.raises(ValueError, match="one shape"):
        apply_rope(q, k, cos, cos[..., :8])
    with pytest.raises(ValueError, match="cos/sin must be"):
        apply_rope(q, k, cos[:, :5], cos[:, :5])
    with pytest.raises(TypeError, match="position_ids must be"):
        apply_rope(q, k, cos[0], cos[0], torch.zeros(B, S, device=device))
    with pytest.raises(ValueError, match="position_ids must be"):
        apply_rope(q, k, cos[0], cos[0], torch.zeros(B, S + 1, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="share memory"):
        apply_rope(q, q, cos, cos)


@pytest.mark.gpu
def test_rope_8b_shape():
    g = torch.Generator().manual_seed(0)
    b, s, dh = 4, 4096, 128
    q = torch.randn(b, s, 32, dh, generator=g).cuda().bfloat16().transpose(1, 2)
    k = torch.randn(b, s, 8, dh, generator=g).cuda().bfloat16().transpose(1, 2)
    cos, sin = tables(b * s, dh, torch.bfloat16, "cuda")
    cos, sin = cos.view(b, s, dh), sin.view(b, s, dh)
    same = reference.apply_rope(q, k, cos, sin)
    ref64 = reference.apply_rope(q.double(), k.double(), cos.double(), sin.double())
    got = apply_rope(q.clone(), k.clone(), cos, sin)
    for name, a, sm, r in zip("qk", got, same, ref64):
        check(a, r, sm, name)
    dy = (torch.randn(b, s, 32, dh, generator=g).cuda().bfloat16().transpose(1, 2),
          torch.randn(b, s, 8, dh, generator=g).cuda().bfloat16().transpose(1, 2))
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    gq, gk = torch.autograd.grad(apply_rope(q1 * 1, k1 * 1, cos, sin), (q1, k1), dy)
    sq, sk = torch.autograd.grad(reference.apply_rope(q1, k1, cos, sin), (q1, k1), dy)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    rq, rk = torch.autograd.grad(reference.apply_rope(q64, k64, cos.double(), sin.double()), (q64, k64),
                                 tuple(t.double() for t in dy))
    check(gq, rq, sq, "dq")
    check(gk, rk, sk, "dk")
