"""The oracle itself: reference.py against Hugging Face's own modules and unchunked float64 math."""

import pytest
import torch
import torch.nn.functional as F

from fasttune.kernels import reference as ref


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_loss_equals_full_logits_cross_entropy(reduction):
    h = _rand(37, 12).requires_grad_()
    w = _rand(70, 12, seed=1).requires_grad_()
    y = torch.randint(0, 70, (37,), generator=torch.Generator().manual_seed(2))
    y[::5] = -100
    loss = ref.fused_linear_cross_entropy(h, w, y, reduction=reduction, label_smoothing=0.1, chunk_rows=8)
    full = F.cross_entropy(h @ w.t(), y, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss, full)
    (gh, gw) = torch.autograd.grad(loss.sum(), (h, w))
    (fh, fw) = torch.autograd.grad(full.sum(), (h, w))
    torch.testing.assert_close(gh, fh)
    torch.testing.assert_close(gw, fw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_on_logits_equals_torch(reduction):
    """reference.cross_entropy (the CPU path of kernels.cross_entropy.cross_entropy) is
    F.cross_entropy in float32, plus the soft-cap, z-loss and num_items_in_batch it adds."""
    x = _rand(23, 50, dtype=torch.float32).requires_grad_()
    y = torch.randint(0, 50, (23,), generator=torch.Generator().manual_seed(3))
    y[::4] = -100
    loss = ref.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1)
    full = F.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss, full)
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), x)[0], torch.autograd.grad(full.sum(), x)[0])
    z = 5.0 * torch.tanh(x / 5.0)
    lse = z.logsumexp(-1)
    per_row = F.cross_entropy(z, y, reduction="none") + torch.where(y != -100, 1e-3 * lse ** 2, 0.0)
    capped = ref.cross_entropy(x, y, reduction=reduction, softcap=5.0, z_loss=1e-3, num_items_in_batch=7)
    torch.testing.assert_close(capped, per_row if reduction == "none" else per_row.sum() / 7)
    assert ref.cross_entropy(x, torch.full_like(y, -100), num_items_in_batch=0).item() == 0.0  # 0 reads as 1


def test_logprobs_equal_log_softmax_with_temperature():
    h, w = _rand(9, 6), _rand(40, 6, seed=1)
    y = torch.randint(0, 40, (9,))
    lp, ent = ref.fused_linear_logprobs(h, w, y, temperature=0.7, return_entropy=True, chunk_rows=4)
    full = torch.log_softmax((h @ w.t()) / 0.7, -1)
    torch.testing.assert_close(lp, full.gather(1, y[:, None]).squeeze(1))
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2"])
def test_rms_norm_equals_hf_modules(family):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    x = _rand(5, 24, dtype=torch.float32)
    module = {"llama": LlamaRMSNorm(24), "gemma": GemmaRMSNorm(24), "olmo2": Olmo2RMSNorm(24)}[family]
    with torch.no_grad():
        module.weight.normal_()
    offset, casting = {"llama": (0.0, "llama"), "gemma": (1.0, "gemma"), "olmo2": (0.0, "gemma")}[family]
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    for dtype in (torch.float32, torch.bfloat16):
        m = module.to(dtype)
        xd = x.to(dtype)
        assert torch.equal(ref.rms_norm(xd, m.weight, eps, offset=offset, casting=casting), m(xd))


def test_rope_equals_hf_apply_rotary_pos_emb_including_partial_rotary():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    q, k = _rand(2, 4, 7, 16, dtype=torch.float32), _rand(2, 2, 7, 16, dtype=torch.float32, seed=1)
    ang = _rand(2, 7, 8, dtype=torch.float32, seed=2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for a, b in zip(ref.apply_rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(a, b)
    cos_p, sin_p = torch.cat([ang[..., :4].cos()] * 2, -1), torch.cat([ang[..., :4].sin()] * 2, -1)
    for a, b in zip(ref.apply_rope(q, k, cos_p, sin_p), phi3_rope(q, k, cos_p, sin_p)):
        assert torch.equal(a, b)
    table_c, table_s = cos[0], sin[0]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)  # packed documents restart positions
    a_q, _ = ref.apply_rope(q, k, table_c, table_s, position_ids=pos)
    b_q, _ = apply_rotary_pos_emb(q, k, table_c[pos], table_s[pos])
    assert torch.equal(a_q, b_q)


def test_gated_activations_and_lora_math():
    g, u = _rand(4, 10), _rand(4, 10, seed=1)
    torch.testing.assert_close(ref.swiglu(g, u), F.silu(g) * u)
    torch.testing.assert_close(ref.geglu(g, u, "tanh"), F.gelu(g, approximate="tanh") * u)
    torch.testing.assert_close(ref.geglu(g, u, "none"), F.gelu(g) * u)
    x, w, a, b = _rand(3, 6), _rand(5, 6, seed=1), _rand(2, 6, seed=2), _rand(5, 2, seed=3)
    torch.testing.assert_close(ref.lora_linear(x, w, a, b, 0.5), x @ w.t() + 0.5 * x @ a.t() @ b.t())
    with pytest.raises(ValueError, match="activation"):
        ref.lora_mlp(x, (w, None, None, 1.0), (w, None, None, 1.0), (w.t(), None, None, 1.0), activation="relu")
