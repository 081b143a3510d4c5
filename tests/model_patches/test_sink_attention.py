"""gpt-oss's attention sinks through flex attention (``model_patches/sink_attention.py``).

CPU: the rescale o · sigmoid(lse − σ) against gpt-oss's own eager math in float64 (forward and the
gradients of q, k, v and the sinks, through o and lse), and the switch to flex attention and its undo.
Flex attention has no CPU backward, so the patched model's training step runs in the ``gpu`` tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.model_patches import attention as attention_mod
from fasttune.model_patches.attention import OP_SINKS
from fasttune.model_patches.report import FUSED
from fasttune.model_patches.sink_attention import FLEX, renormalize_by_sinks
from helpers.compare import assert_grads_close, rel_err
from helpers.tiny_models import make_batch, tiny_model

HAS_CUDA = torch.cuda.is_available()


def _mask(seq: int, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility [S, S]: key j visible to query i."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    keep = j <= i
    return keep & (i - j < window) if window else keep


def _eager_with_sinks(q, k, v, sinks, keep):
    """gpt-oss's eager attention: the sink as an extra softmax column, dropped after the softmax."""
    scores = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
    col = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, col.to(scores.dtype)], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def _rescaled(q, k, v, sinks, keep):
    """Attention without the sinks (o and lse, as flex attention returns them), then the rescale."""
    scores = (q.float() @ k.float().transpose(-1, -2)).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
    return renormalize_by_sinks(out, lse, sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_rescale_equals_softmax_with_a_sink_column(dtype, window):
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 19, 8
    leaves = [torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3)] + [torch.randn(h, dtype=torch.float64)]
    leaves[3][0] = 4.0  # a sink that dominates some rows: the rescale far from 1
    keep = _mask(s, window)

    ref_in = [t.clone().requires_grad_() for t in leaves]
    ref = _eager_with_sinks(*ref_in, keep)
    dout = torch.randn_like(ref)
    ref.backward(dout)

    ours_in = [t.to(dtype).requires_grad_() for t in leaves]
    ours = _rescaled(*ours_in, keep)
    assert ours.dtype == dtype
    ours.backward(dout.to(dtype))

    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert rel_err(ours, ref) <= tol
    for name, a, r in zip("qkv", ours_in[:3], ref_in[:3]):
        assert rel_err(a.grad, r.grad) <= tol, name
    assert rel_err(ours_in[3].grad, ref_in[3].grad) <= tol  # the sinks train
    assert ref_in[3].grad.abs().min() > 0


def test_rescale_keeps_a_row_without_weight_at_zero():
    """A row flex attention leaves empty (lse = −inf, o = 0) stays 0, not NaN."""
    out = torch.zeros(1, 2, 3, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    assert torch.equal(renormalize_by_sinks(out, lse, torch.zeros(2)), out)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU-only machine's behaviour")
def test_cpu_machine_keeps_eager_attention_without_a_fallback():
    model = tiny_model("gpt_oss", seed=1)
    report = patch_model(model, FastConfig())
    assert model.config._attn_implementation == "eager"
    assert OP_SINKS not in report.patched and not [f for f in report.fallbacks if f.op == OP_SINKS], str(report)


def test_switch_to_flex_and_back(monkeypatch):
    """With the device check passed (CUDA in real use), the instance switches to flex attention,
    counts each layer, and unpatch restores eager; flex_sinks=False and non-sink families never switch."""
    monkeypatch.setattr(attention_mod, "_device_type", lambda base: "cuda")
    model = tiny_model("gpt_oss", seed=1)
    report = patch_model(model, FastConfig())
    assert model.config._attn_implementation == FLEX
    assert report.patched[OP_SINKS] == model.config.num_hidden_layers and OP_SINKS in report.counted, str(report)
    twin = copy.deepcopy(model)  # TRL's reference model: its undo restores the copy itself
    unpatch_model(twin)
    assert twin.config._attn_implementation == "eager" and model.config._attn_implementation == FLEX
    unpatch_model(model)
    assert model.config._attn_implementation == "eager"

    report = patch_model(model, FastConfig(flex_sinks=False))
    assert model.config._attn_implementation == "eager" and OP_SINKS not in report.patched
    llama = tiny_model("llama", seed=1)
    report = patch_model(llama, FastConfig())
    assert llama.config._attn_implementation == "eager" and OP_SINKS not in report.patched


def test_other_attention_implementations_are_kept(monkeypatch):
    monkeypatch.setattr(attention_mod, "_device_type", lambda base: "cuda")
    model = tiny_model("gpt_oss", seed=1)
    model.config._attn_implementation = "kernels-community/vllm-flash-attn3"
    report = patch_model(model, FastConfig())
    assert model.config._attn_implementation == "kernels-community/vllm-flash-attn3"
    assert [f.reason for f in report.fallbacks if f.op == OP_SINKS] == [
        "attn_implementation is 'kernels-community/vllm-flash-attn3' (kept)"]


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [None, "offload"])
def test_gpt_oss_on_flex_matches_eager_stock(checkpointing):
    """fp32 on CUDA: LoRA on attention and the experts, both layer types (sliding and full); the
    patched model runs flex attention (every layer's call counted fused) with the stock loss within
    1e-5 and every gradient (the sinks' included) within 1e-4; unpatch goes back to eager."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        init_lora_weights=False)
    stock = get_peft_model(tiny_model("gpt_oss", seed=3, output_router_logits=False), config).to("cuda")
    for name, p in stock.named_parameters():
        p.requires_grad_(p.requires_grad or name.endswith("sinks"))
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(checkpointing=checkpointing))
    assert fast.config._attn_implementation == FLEX, str(report)
    batch = make_batch(stock.config.vocab_size, batch=2, seq=150, seed=4, device="cuda")
    stock.train(), fast.train()
    out_fast, out_stock = _step(fast, batch), _step(stock, batch)
    layers = stock.config.num_hidden_layers
    assert report.calls[OP_SINKS, FUSED] == layers * (2 if checkpointing else 1)
    assert rel_err(out_fast.loss, out_stock.loss) <= 1e-5
    assert_grads_close(fast, stock, 1e-4)
    unpatch_model(fast)
    assert fast.config._attn_implementation == "eager"


@pytest.mark.gpu
def test_sink_flex_attention_bf16_at_least_as_close_to_float64_as_eager():
    """bf16, the attention op alone (sliding window, GQA, two flex blocks): sink_flex_attention's output
    and its q/k/v/sink gradients at most 2× gpt-oss's eager bf16 distance from float64 (+ 1e-3).

    (End to end, a tiny bf16 gpt-oss is no criterion: its top-2 of 4 experts flip on rounding noise. On
    the CPU, a flex-like rounding of the attention alone, more precise than eager's bf16 softmax, put
    two expert gradients 5.9% from fp32 where stock's were 1.7%, for one of three seeds.)"""
    from types import SimpleNamespace

    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from fasttune.model_patches.sink_attention import sink_flex_attention

    torch.manual_seed(0)
    b, hq, hkv, s, d, window = 2, 8, 2, 300, 64, 128
    leaves = [torch.randn(b, h, s, d, dtype=torch.float64, device="cuda") for h in (hq, hkv, hkv)]
    leaves.append(torch.randn(hq, dtype=torch.float64, device="cuda"))
    keep = _mask(s, window).cuda()
    dout = torch.randn(b, s, hq, d, dtype=torch.float64, device="cuda")

    ref_in = [t.clone().requires_grad_() for t in leaves]
    rep = hq // hkv
    ref = _eager_with_sinks(ref_in[0] * d ** -0.5, ref_in[1].repeat_interleave(rep, 1),
                            ref_in[2].repeat_interleave(rep, 1), ref_in[3], keep).transpose(1, 2)
    ref.backward(dout)

    def run(fn):
        xs = [t.to(torch.bfloat16).requires_grad_() for t in leaves]
        module = SimpleNamespace(training=True, num_key_value_groups=rep, sinks=xs[3])
        out = fn(module, *xs)
        out.backward(dout.to(out.dtype))
        return [out] + [x.grad for x in xs]

    block = create_block_mask(lambda b_, h_, qi, ki: (ki <= qi) & (qi - ki < window), None, None, s, s, device="cuda")
    additive = torch.zeros(s, s, device="cuda").masked_fill(~keep, float("-inf")).to(torch.bfloat16)[None, None]
    flex = run(lambda m, q, k, v, sk: sink_flex_attention(m, q, k, v, block, scaling=d ** -0.5, s_aux=sk)[0])
    eager = run(lambda m, q, k, v, sk: eager_attention_forward(m, q, k, v, additive, scaling=d ** -0.5)[0])
    want = [ref] + [t.grad for t in ref_in]
    for name, f, e, r in zip(("out", "dq", "dk", "dv", "dsinks"), flex, eager, want):
        assert rel_err(f, r) <= 2 * rel_err(e, r) + 1e-3, (name, rel_err(f, r), rel_err(e, r))


@pytest.mark.gpu
def test_gpt_oss_greedy_generation_on_flex_matches_eager_stock():
    """Prefill (fused, on flex) and cached decode steps (the stock forward, on transformers' flex path)
    give stock eager's greedy tokens in fp32. (No router logits: transformers 5.17's own gpt-oss
    generate fails computing the auxiliary loss over the decode step's mask.)"""
    stock = tiny_model("gpt_oss", seed=7, output_router_logits=False).to("cuda")
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert fast.config._attn_implementation == FLEX
    stock.eval(), fast.eval()
    prompt = make_batch(stock.config.vocab_size, batch=2, seq=40, seed=30, device="cuda")
    kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        a = fast.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], **kw)
        b = stock.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], **kw)
    assert torch.equal(a, b)
    assert report.calls[OP_SINKS, FUSED] == stock.config.num_hidden_layers  # the prefill
