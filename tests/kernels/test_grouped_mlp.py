"""The routed expert MLP Function vs float64 autograd of the expert-by-expert reference: the output
and the gradient of x, the router weights and every projection tensor (weights, biases, LoRA A/B).

Cases: Qwen3-MoE/Mixtral layout (silu, gate/up halves) without and with LoRA on both projections,
gpt-oss layout (transposed weights, biases, interleaved clamped SwiGLU) with LoRA, GeGLU, top-1,
an expert that receives no token, frozen experts (no weight gradients asked), bf16. fp32 within
1e-5 relative (Frobenius), bf16 within 2× the error of the same math in plain bf16 torch. Frozen
weights held in NF4 (``NF4Weight``, bitsandbytes' quantize_4bit): the same output and gradients,
bit for bit, as the dense dequantised weights, on the kernel path and on the reference path."""

import pytest
import torch

from fasttune.kernels import grouped_mlp as grouped_mlp_mod
from fasttune.kernels import moe_reference as reference
from fasttune.kernels.backward_follows import backward_follows
from fasttune.kernels.grouped_mlp import ExpertGLU, ExpertProjection, grouped_mlp
from fasttune.kernels.moe_wide import WideExperts
from fasttune.kernels.nf4_weight import NF4Weight
from helpers.kernel_checks import check_in_norm

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

T, H, I, E, R = 19, 40, 24, 5, 4  # the last expert receives no token


def _case(device, dtype, *, k=2, transposed=False, lora=False, bias=False, kind="silu", seed=0, frozen=False):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.3, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_(grad)

    def proj(n_in, n_out):
        w = rnd(E, n_in, n_out, grad=not frozen) if transposed else rnd(E, n_out, n_in, grad=not frozen)
        return ExpertProjection(w, rnd(E, n_out) if bias else None, rnd(E, R, n_in) if lora else None,
                                rnd(E, n_out, R) if lora else None, 0.75, transposed)

    x = rnd(T, H, scale=1.0)
    index = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)]).to(device)
    weights = torch.rand(T, k, generator=g).to(device, dtype).requires_grad_()
    return x, index, weights, proj(H, 2 * I), proj(I, H), ExpertGLU(kind, 1.702, 0.4)


def _leaves(case):
    x, _, weights, gate_up, down, _ = case
    return [t for t in (x, weights, *gate_up[:4], *down[:4]) if isinstance(t, torch.Tensor) and t.requires_grad]


def _d64(t):
    return t if not isinstance(t, torch.Tensor) else t.detach().double().requires_grad_(t.requires_grad)


def _as64(case):
    x, index, weights, gate_up, down, glu = case
    d = _d64
    return d(x), index, d(weights), ExpertProjection(*map(d, gate_up)), ExpertProjection(*map(d, down)), glu


def _run(fn, case, dy):
    out = fn(*case)
    return [out, *torch.autograd.grad(out, _leaves(case), dy.to(out.dtype))]


CASES = {
    "silu": dict(),
    "silu_lora": dict(lora=True),
    "gpt_oss_lora_bias": dict(transposed=True, lora=True, bias=True, kind="clamped_swiglu"),
    "gelu_top1": dict(k=1, kind="gelu_tanh", lora=True),
    "frozen_experts_lora": dict(frozen=True, lora=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_matches_float64_reference(device, name):
    case = _case(device, torch.float32, seed=len(name), **CASES[name])
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(device)
    got = _run(grouped_mlp, case, dy)
    ref = _run(reference.grouped_mlp, _as64(case), dy.double())
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == torch.float32
        check_in_norm(a, b, what=f"output {i} of {name}")
    # the expert that received no token gets exact zero gradients
    for t, grad in zip(_leaves(case), got[1:]):
        if t.dim() == 3 and t.shape[0] == E:
            assert torch.equal(grad[E - 1], torch.zeros_like(grad[E - 1]))


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("name", ["silu_lora", "gpt_oss_lora_bias"])
def test_bf16_within_twice_torch_error(device, name, widen):
    """Plain, and with the weights widened (A and s·B in the border: one product per projection)."""
    case = _case(device, torch.bfloat16, seed=11, **CASES[name])
    case = _widened(case) if widen else case
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).to(device, torch.bfloat16)
    got = _run(grouped_mlp, case, dy)
    same = _run(_bf16_torch, case, dy)
    ref = _run(reference.grouped_mlp, _as64(case), dy.double())
    for i, (a, s, r) in enumerate(zip(got, same, ref)):
        check_in_norm(a, r, s, what=f"output {i} of {name}", lowp=torch.bfloat16)


def _bf16_torch(x, index, weights, gate_up, down, glu):
    """The stock expert loop in the inputs' dtype (bf16 products, bf16 activations)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.num_experts):
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        z = x[token]
        for p in (gate_up, down):
            w = p.weight[e] if p.transposed else p.weight[e].t()
            y = z @ w
            if p.lora_a is not None:
                y = y + p.scaling * ((z @ p.lora_a[e].t()) @ p.lora_b[e].t())
            if p.bias is not None:
                y = y + p.bias[e]
            z = reference._glu_math(*reference.split_gate_up(y, glu), glu) if p is gate_up else y
        out = out.index_add(0, token, z * weights[token, slot][:, None])
    return out


def _nf4(case, nested):
    """The case with both frozen weights quantised to NF4: (NF4 case, the same with the dense
    dequantised weights)."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    x, index, weights, gate_up, down, glu = case
    held, dense = [], []
    for p in (gate_up, down):
        packed, state = bnb_f.quantize_4bit(p.weight.detach().contiguous(), blocksize=64, compress_statistics=nested,
                                            quant_type="nf4")
        w = NF4Weight(packed, state)
        held.append(p._replace(weight=w))
        dense.append(p._replace(weight=w.dequantize()))
    return (x, index, weights, *held, glu), (x, index, weights, *dense, glu)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["frozen_experts_lora", "gpt_oss_lora_bias"])
def test_nf4_weights_equal_their_dequantised_values(device, name, dtype, nested, monkeypatch, deterministic):
    """Bitwise against the dense weights; on CUDA under deterministic algorithms (the bias gradients'
    ``index_add_`` is atomic otherwise)."""
    case = _case(device, dtype, seed=7, **{**CASES[name], "frozen": True})
    held, dense = _nf4(case, nested)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    got, want = _run(grouped_mlp, held, dy), _run(grouped_mlp, dense, dy)
    assert len(got) == len(want) == 1 + len(_leaves(case))  # x, router weights, LoRA (and biases)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i}"
    if dtype == torch.float32:
        for i, (a, b) in enumerate(zip(got, _run(reference.grouped_mlp, _as64(dense), dy.double()))):
            check_in_norm(a, b, what=f"output {i} against float64")
    monkeypatch.setattr(grouped_mlp_mod, "use_triton", lambda *t: False)  # a CPU without Triton
    for i, (a, b) in enumerate(zip(_run(grouped_mlp, held, dy), _run(grouped_mlp, dense, dy))):
        assert torch.equal(a, b), f"reference path, output {i}"


@pytest.mark.parametrize("name", ["silu_lora", "gpt_oss_lora_bias", "frozen_experts_lora"])
def test_output_unused_skips_down_but_keeps_every_gradient(device, name, monkeypatch):
    """output_unused (a checkpoint recompute): the gate/up product alone (no GLU, no down product
    or sum over slots), a NaN output, and bitwise the gradients of a full call."""
    case = _case(device, torch.float32, seed=11, **CASES[name])
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(12)).to(device)
    full = _run(grouped_mlp, case, dy)
    products, glus = [], []
    real_mm, real_glu = grouped_mlp_mod.grouped_mm, grouped_mlp_mod.moe_glu
    monkeypatch.setattr(grouped_mlp_mod, "grouped_mm", lambda z, w, offs: products.append(w.shape[2]) or
                        real_mm(z, w, offs))
    monkeypatch.setattr(grouped_mlp_mod, "moe_glu", lambda *a: glus.append(1) or real_glu(*a))
    x, index, weights, gate_up, down, glu = case
    out = grouped_mlp(x, index, weights, gate_up, down, glu, output_unused=True)
    assert products == [2 * I, R, 2 * I] and glus == []  # the base gate/up product and its LoRA terms
    assert out.shape == full[0].shape and out.dtype == full[0].dtype and torch.isnan(out).all()
    products.clear()
    skipped = torch.autograd.grad(out, _leaves(case), dy)
    assert len(products) > 0  # the backward runs as a full call's does
    for i, (a, b) in enumerate(zip(full[1:], skipped)):
        # Bitwise on CPU; CUDA's index_add_ (the bias gradients' segment sums) adds atomically.
        same = torch.equal(a, b) if a.device.type == "cpu" else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert same, f"gradient {i} of {name}"


def _widened(case, extra=R + 3):
    """The case with both weights re-homed as views of ``WideExperts`` buffers (borders wider than the
    rank: the padding rows and columns must stay zero)."""
    x, index, weights, gate_up, down, glu = case
    out = []
    for p in (gate_up, down):
        n_in, n_out = p.in_features, p.out_features
        shape = (E, n_in + extra, n_out + extra) if p.transposed else (E, n_out + extra, n_in + extra)
        wide = WideExperts(torch.zeros(shape, dtype=p.weight.dtype, device=p.weight.device), n_in, n_out, p.transposed)
        wide.weight_view().copy_(p.weight.detach())
        w = wide.weight_view().detach().requires_grad_(p.weight.requires_grad)  # a leaf that is the view
        out.append(p._replace(weight=w, wide=wide))
    return (x, index, weights, *out, glu)


def _count_wide_products(monkeypatch, case):
    """Records the contraction width of every grouped product that reads a widened buffer (a list to read later)."""
    bufs = {p.wide.buf.data_ptr() for p in case[3:5]}
    hits = []
    real_mm = grouped_mlp_mod.grouped_mm
    monkeypatch.setattr(grouped_mlp_mod, "grouped_mm", lambda z, w, offs: (hits.append(w.shape[1]) if w.data_ptr()
                                                                          in bufs else None) or real_mm(z, w, offs))
    return hits


@pytest.mark.parametrize("name", list(CASES))
def test_widened_weights_fp32_match_float64_reference(device, name, monkeypatch):
    """LoRA's A and s·B in the widened weight's border (one product per projection, forward and input
    gradient): the same math."""
    case = _widened(_case(device, torch.float32, seed=len(name) + 3, **CASES[name]))
    hits = _count_wide_products(monkeypatch, case)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(15)).to(device)
    got = _run(grouped_mlp, case, dy)
    extra = case[3].wide.extra
    bordered = case[3].lora_a is not None  # with an adapter, the dz products are bordered too
    assert hits == [H + extra, I + extra] + ([H + extra, 2 * I + extra] if bordered else [H, 2 * I])
    ref = _run(reference.grouped_mlp, _as64(case), dy.double())
    for i, (a, b) in enumerate(zip(got, ref)):
        check_in_norm(a, b, what=f"output {i} of widened {name}")
    for p in case[3:5]:  # the border holds A and s·B (zero without an adapter), the padding stays zero
        want = torch.zeros_like(p.wide.buf)
        m = want.transpose(1, 2) if p.transposed else want  # [E, out + R, in + R]
        n_in, n_out = p.in_features, p.out_features
        m[:, :n_out, :n_in] = p.weight.detach().transpose(1, 2) if p.transposed else p.weight.detach()
        if p.lora_a is not None:
            m[:, n_out:n_out + R, :n_in] = p.lora_a.detach()
            m[:, :n_out, n_in:n_in + R] = p.lora_b.detach() * p.scaling
        assert torch.equal(p.wide.buf, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_fresh_adapter_equals_no_adapter_bit_for_bit(device, dtype):
    """B = 0 (a fresh adapter) and the adapters off (DPO's reference pass) give the same output
    and input gradient, bit for bit, on the widened products; and after a call without adapters the
    border is reloaded (a stale zero border would drop the LoRA terms)."""
    lora = _widened(_case(device, dtype, seed=21, **CASES["gpt_oss_lora_bias"]))
    x, index, weights, gate_up, down, glu = lora
    fresh = [p._replace(lora_b=torch.zeros_like(p.lora_b)) for p in (gate_up, down)]
    off = [p._replace(lora_a=None, lora_b=None) for p in (gate_up, down)]
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(22)).to(device, dtype)
    outs = []
    for projections in (fresh, off):
        xx = x.detach().requires_grad_()
        out = grouped_mlp(xx, index, weights.detach(), *projections, glu)
        outs.append((out, torch.autograd.grad(out, xx, dy)[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    again = grouped_mlp(x.detach(), index, weights.detach(), gate_up, down, glu)
    plain = grouped_mlp(x.detach(), index, weights.detach(), *[p._replace(wide=None) for p in (gate_up, down)], glu)
    check_in_norm(again, plain, what="LoRA after a pass without adapters", rtol=1e-5 if dtype == torch.float32
                  else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_without_autograd_equals_the_functions_output(device, dtype, monkeypatch):
    """No gradient asked for (a checkpointed layer's forward): the same output bit for bit, without the
    autograd Function (its gate/up product is freed before the down product's output exists)."""
    x, index, weights, gate_up, down, glu = _case(device, dtype, seed=31, **CASES["gpt_oss_lora_bias"])
    want = grouped_mlp(x, index, weights, gate_up, down, glu)
    assert want.grad_fn is not None
    applied = []
    real = grouped_mlp_mod.GroupedMLPFunction.apply
    monkeypatch.setattr(grouped_mlp_mod.GroupedMLPFunction, "apply", lambda *a: applied.append(1) or real(*a))
    with torch.no_grad():
        got = grouped_mlp(x, index, weights, gate_up, down, glu)
    assert not applied and got.grad_fn is None and torch.equal(got, want.detach())


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("name", ["silu_lora", "frozen_experts_lora", "gpt_oss_lora_bias"])
def test_recompute_frees_gate_up_in_backward_with_the_same_numbers(device, name, widen, deterministic):
    """Inside ``backward_follows`` (a recompute back-propagated at once) the gate/up activations ride on ctx, not
    among autograd's saved tensors, and the backward frees them: output and every gradient bit for bit those of a
    plain call (deterministic algorithms: CUDA's index_add_ of the bias gradients is atomic); a second backward
    through the node raises instead of reading freed activations."""
    case = _case(device, torch.float32, seed=41, **CASES[name])
    case = _widened(case) if widen else case
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(42)).to(device)
    want = _run(grouped_mlp, case, dy)
    with backward_follows():
        out = grouped_mlp(*case)
    k = case[1].shape[1]
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert not [t for t in saved if t.shape == (T * k, 2 * I)], "gate/up activations among the saved tensors"
    got = [out, *torch.autograd.grad(out, _leaves(case), dy, retain_graph=True)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs from a plain call's"
    # (widened: autograd's version check on the reloaded border buffer speaks first)
    with pytest.raises(RuntimeError, match="modified by an inplace operation" if widen else "backward ran twice"):
        torch.autograd.grad(out, _leaves(case), dy)
    out = grouped_mlp(*case)  # outside the block: saved as usual
    assert [t for t in out.grad_fn.saved_tensors if t is not None and t.shape == (T * k, 2 * I)]


@pytest.mark.parametrize("num_experts", [5, 256, 300])
def test_routing_sorts_stably_and_counts_rows_per_expert(device, num_experts):
    """The sort by expert (one-byte keys up to 256 experts, int32 beyond): the stable order of the
    flat slots, and each expert's inclusive row end."""
    g = torch.Generator().manual_seed(num_experts)
    index = torch.randint(0, num_experts, (97, 3), generator=g)
    index[0, 0] = num_experts - 1
    expert, perm, offs = grouped_mlp_mod._route(index.to(device), num_experts)
    want = torch.sort(index.reshape(-1), stable=True)
    assert torch.equal(perm.cpu(), want.indices) and torch.equal(expert.cpu().long(), want.values)
    counts = torch.bincount(index.reshape(-1), minlength=num_experts)
    assert offs.dtype == torch.int32 and torch.equal(offs.cpu().long(), counts.cumsum(0))


def test_bad_inputs_name_the_argument(device):
    x, index, weights, gate_up, down, glu = _case(device, torch.float32)
    with pytest.raises(ValueError, match="top_k_weights"):
        grouped_mlp(x, index, weights[:, :1], gate_up, down, glu)
    with pytest.raises(ValueError, match="top_k_index"):
        grouped_mlp(x, index.float(), weights, gate_up, down, glu)
    with pytest.raises(ValueError, match="gate_up.weight"):
        grouped_mlp(x[:, :7], index, weights, gate_up, down, glu)
    with pytest.raises(ValueError, match="lora_a and lora_b"):
        grouped_mlp(x, index, weights, gate_up._replace(lora_a=torch.ones(E, R, H, device=device)), down, glu)
    with pytest.raises(ValueError, match="glu.kind"):
        grouped_mlp(x, index, weights, gate_up, down, ExpertGLU("relu"))


@pytest.mark.gpu
@pytest.mark.parametrize("widen", [False, True])
def test_qwen3_30b_a3b_layer_shape_bf16(widen):
    """One Qwen3-30B-A3B MoE layer (128 experts, top-8, 2048 → 768), 2,048 tokens, LoRA r=16 on both
    projections (plain, and widened: A and s·B in a 16-wide border, torch's grouped GEMM on the
    strided operands): output and every gradient within 2× plain bf16 torch's error of float64."""
    global T, H, I, E, R
    saved = (T, H, I, E, R)
    T, H, I, E, R = 2048, 2048, 768, 128, 16
    try:
        case = _case("cuda", torch.bfloat16, k=8, lora=True, seed=3)
        if widen:
            case = _widened(case, extra=16)
        dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        got = _run(grouped_mlp, case, dy)
        same = _run(_bf16_torch, case, dy)
        ref = _run(reference.grouped_mlp, _as64(case), dy.double())
        for i, (a, s, r) in enumerate(zip(got, same, ref)):
            check_in_norm(a, r, s, what=f"output {i}", lowp=torch.bfloat16)
    finally:
        T, H, I, E, R = saved
