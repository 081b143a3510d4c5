"""attention.py: one generic attention forward reproduces every family's; cache, hooks, fallbacks."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from fasttune import FastConfig, patch_model
from fasttune.model_patches.attention import (FastAttentionForward, attention_interface, attention_kwarg,
                                              check_attention, patch_attention, project_qkv_fused)
from fasttune.model_patches.families import FAMILIES
from fasttune.model_patches.families import resolve_classes
from fasttune.model_patches.report import FUSED, PatchReport
from helpers.compare import assert_grads_close, rel_err
from helpers.tiny_models import FAMILY_CASES, attention_layers, make_batch, tiny_model

# The generic attention (and MLP) forwards with the family's own apply_rotary_pos_emb and
# activation, as installed for the LoRA hooks alone: they must be the stock computation, operation
# for operation.
HOOK_ONLY = FastConfig(rms_norm=False, rope=False, mlp=False, cross_entropy=False, lora=True)


def _attention_forwards(model):
    return [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), FastAttentionForward)]


@pytest.mark.parametrize("model_type", FAMILY_CASES)
def test_generic_forward_is_the_stock_computation_bit_for_bit(model_type):
    stock = tiny_model(model_type, seed=1)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, HOOK_ONLY)
    assert dict(report.patched) == {"attention_hook": attention_layers(model_type), "mlp_hook": 2}
    assert [f.op for f in report.fallbacks] == (["attention_hook"] if model_type == "qwen3_5_text" else [])
    batch = make_batch(stock.config.vocab_size, seed=2)
    outs = []
    for model in (fast, stock):
        model.train()
        out = model(**batch)
        out.loss.backward()
        outs.append(out)
    assert torch.equal(outs[0].logits, outs[1].logits)
    for (name, a), b in zip(fast.named_parameters(), stock.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_sdpa_implementation_parity(device):
    stock = tiny_model("llama", seed=3).to(device)
    stock.set_attn_implementation("sdpa")
    assert stock.config._attn_implementation == "sdpa"
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    batch = make_batch(stock.config.vocab_size, seed=4, device=device)
    losses = []
    for model in (fast, stock):
        model.train()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel_err(*losses) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)


def _layer0_inputs(model, seq, start=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, seq, model.config.hidden_size, generator=g)
    pos = torch.arange(start, start + seq)[None]
    return hidden, model.model.rotary_emb(hidden, position_ids=pos)


def test_kv_cache_with_either_keyword_name_matches_stock():
    stock = tiny_model("qwen3", seed=5).eval()
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    caches = {}
    # transformers 5.24's attention takes ``cache``, 5.17's ``past_key_values``: stock gets its own name.
    stock_kw = "cache" if "cache" in inspect.signature(type(stock.model.layers[0].self_attn).forward).parameters \
        else "past_key_values"
    with torch.no_grad():
        for tag, model, kw in (("stock", stock, stock_kw), ("cache", fast, "cache"),
                               ("past_key_values", fast, "past_key_values")):
            attn, cache = model.model.layers[0].self_attn, DynamicCache(config=model.config)
            outs = []
            for start, seq in ((0, 5), (5, 1), (6, 1)):  # prefill, then two decode steps
                hidden, pos_emb = _layer0_inputs(model, seq, start, seed=start)
                out, _ = attn(hidden, position_embeddings=pos_emb, attention_mask=None, **{kw: cache})
                outs.append(out)
            caches[tag] = (outs, cache.layers[0].keys, cache.layers[0].values)
    ref_outs, ref_k, ref_v = caches.pop("stock")
    assert ref_k.shape[-2] == 7
    for tag, (outs, k, v) in caches.items():
        assert torch.allclose(k, ref_k, rtol=1e-5, atol=1e-6) and torch.equal(v, ref_v), tag
        for a, b in zip(outs, ref_outs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), tag


def test_lora_hooks_replace_the_projections():
    model = tiny_model("llama", seed=6).eval()
    patch_model(model, FastConfig())
    batch = make_batch(model.config.vocab_size, batch=4, seq=20, seed=7)  # > 64 rows: not a decode step
    with torch.no_grad():
        before = model(**batch).logits
    calls = []
    for fwd in _attention_forwards(model):
        qkv, o = fwd.project_qkv, fwd.project_o
        fwd.project_qkv = lambda m, h, _f=qkv: calls.append("qkv") or _f(m, h)
        fwd.project_o = lambda m, x, _f=o: calls.append("o") or _f(m, x)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)
    assert calls == ["qkv", "o"] * 2
    for fwd in _attention_forwards(model):
        fwd.project_o = lambda m, x: torch.zeros_like(m.o_proj(x))  # attention contributes nothing
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, before)


def test_fused_qkv_split_and_peft_layers():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("phi3", seed=8), LoraConfig(r=4, target_modules=["qkv_proj"],
                                                                  init_lora_weights=False))
    attn = model.get_base_model().model.layers[0].self_attn
    h = torch.randn(2, 3, model.config.hidden_size)
    q, k, v = project_qkv_fused(attn, h)
    full = attn.qkv_proj(h)  # the LoRA layer: base + adapter
    assert torch.equal(torch.cat([q, k, v], -1), full)
    assert q.shape[-1] == 4 * 24 and k.shape[-1] == v.shape[-1] == 2 * 24


def _llama_attention():
    return tiny_model("llama", seed=9).model.layers[0].self_attn


def test_check_attention_reasons():
    spec = FAMILIES["llama"]
    attn = _llama_attention()
    assert check_attention(attn, spec) is None
    del attn.num_key_value_groups
    assert "num_key_value_groups" in check_attention(attn, spec)
    qwen2 = tiny_model("qwen2", seed=9).model.layers[0].self_attn
    del qwen2.sliding_window
    assert "sliding_window" in check_attention(qwen2, FAMILIES["qwen2"])
    qwen3 = tiny_model("qwen3", seed=9).model.layers[0].self_attn
    del qwen3.q_norm
    assert "q_norm" in check_attention(qwen3, FAMILIES["qwen3"])
    for attr, why in (("is_sliding", "whether this layer applies RoPE"), ("sliding_window", "whether `is_sliding`")):
        exaone4 = tiny_model("exaone4", seed=9).model.layers[0].self_attn
        delattr(exaone4, attr)
        assert f"no `{attr}` attribute ({why}" in check_attention(exaone4, FAMILIES["exaone4"])

    class Old(nn.Module):
        def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                    cache_position=None, **kwargs):
            return hidden_states

    class NoRope(nn.Module):
        def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
            return hidden_states

    class NoKwargs(nn.Module):
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None):
            return hidden_states

    assert "cache_position" in check_attention(Old(), spec)
    assert "position_embeddings" in check_attention(NoRope(), spec)
    assert "**kwargs" in check_attention(NoKwargs(), spec)


@pytest.mark.parametrize("case, windows, rotating", [("exaone4", [8, None], [True, False]),
                                                     ("exaone4_no_window", [None, None], [True, True])])
def test_exaone4_window_and_rope_follow_is_sliding_only_where_a_window_is_set(case, windows, rotating):
    """EXAONE 4 holds config.sliding_window on every attention module: the attention function gets it on the
    sliding layers only (``module:sliding_window?is_sliding``), and with a window only those layers rotate
    (``rope_flag`` is_sliding, in force where ``rope_flag_when`` sliding_window is set); the kernel runs there."""
    model = tiny_model(case, seed=12)
    report = patch_model(model, FastConfig())
    seen = []
    for fwd in _attention_forwards(model):
        assert fwd._rotates(fwd.module) is rotating[fwd.module.layer_idx]
        real = fwd.eager
        fwd.eager = lambda m, *a, _real=real, **k: seen.append(k["sliding_window"]) or _real(m, *a, **k)
    model(**make_batch(model.config.vocab_size, seed=13)).loss.backward()
    assert seen == windows
    assert report.calls["rope", FUSED] == sum(rotating)
    attn = model.model.layers[1].self_attn
    assert attention_kwarg(attn, "module:sliding_window") == model.config.sliding_window  # unconditional
    assert attention_kwarg(attn, "module:sliding_window?is_sliding") is None  # a full-attention layer


def test_missing_family_functions_and_classes_are_reported():
    base = tiny_model("llama", seed=10)
    report = PatchReport("llama")
    no_eager = dataclasses.replace(FAMILIES["llama"], modeling_module="fasttune.model_patches.report")
    patch_attention(base, no_eager, resolve_classes(FAMILIES["llama"]), FastConfig(), report)
    patch_attention(base, FAMILIES["llama"], {}, FastConfig(), report)
    assert not report.patched and len(report.fallbacks) == 2
    assert "eager_attention_forward" in report.fallbacks[0].reason
    assert "LlamaAttention not found" in report.fallbacks[1].reason


def test_attention_interface_lookup_with_and_without_get_interface():
    def eager(*a, **k):
        return "eager"

    def sdpa(*a, **k):
        return "sdpa"

    registry = {"sdpa": sdpa}  # an older registry: plain indexing, eager not registered
    assert attention_interface(registry, "eager", eager) is eager
    assert attention_interface(registry, None, eager) is eager
    assert attention_interface(registry, "sdpa", eager) is sdpa

    class Interface(dict):
        def get_interface(self, name, default):
            return self.get(name, default)

    assert attention_interface(Interface(sdpa=sdpa), "sdpa", eager) is sdpa
    assert attention_interface(Interface(), "eager", eager) is eager


def test_forward_signature_is_the_stock_one():
    attn = _llama_attention()
    stock_sig = inspect.signature(attn.forward)
    report = PatchReport("llama")
    patch_attention(attn, FAMILIES["llama"], resolve_classes(FAMILIES["llama"]), FastConfig(), report)
    assert report.patched["rope"] == 1 and inspect.signature(attn.forward) == stock_sig


def test_cache_update_follows_the_stock_api():
    """5.24's forward takes ``cache`` and passes its kwargs to update; 5.17's takes
    ``past_key_values`` and does not: read off the stock signature, both names accepted."""

    class RecordingCache:
        def __init__(self):
            self.calls = []

        def update(self, k, v, layer_idx, *args, **kwargs):
            self.calls.append((layer_idx, args, kwargs))
            return k, v

    model = tiny_model("llama", seed=11).eval()
    patch_model(model, FastConfig())
    fwd = _attention_forwards(model)[0]
    assert fwd.cache_kwargs == ("cache" in inspect.signature(type(fwd.module).forward).parameters)
    hidden, pos_emb = _layer0_inputs(model, 40)  # 80 rows: the patched path, not a decode step's stock one
    for cache_kwargs, expected in ((True, {"kwargs": {"position_ids": None}}), (False, {})):
        fwd.cache_kwargs = cache_kwargs
        for name in ("cache", "past_key_values"):
            cache = RecordingCache()
            with torch.no_grad():
                fwd(hidden, pos_emb, None, position_ids=None, **{name: cache})
            assert cache.calls == [(0, (), expected)], (cache_kwargs, name)
