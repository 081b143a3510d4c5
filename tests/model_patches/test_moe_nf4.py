"""QLoRA MoE models with NF4 experts (``FastConfig.moe_experts_nf4``, model_patches/moe_nf4.py).

A tiny MoE model (hidden 128: bitsandbytes' CPU NF4 wants multiples of 64, NOTES §4) is saved and
loaded with ``BitsAndBytesConfig(load_in_4bit=True)``: attention becomes ``Linear4bit``, the
stacked 3-D experts stay dense until ``patch_model`` quantises them with bitsandbytes'
``quantize_4bit``. The oracle is the stock model (same PEFT wrappers, same ``Linear4bit`` layers)
whose expert parameters hold the *dequantised* NF4 values (bitsandbytes' own ``dequantize_4bit``):
the same function exactly, so fp32 loss ≤ 1e-6 relative and every trainable gradient ≤ 1e-5.
Counted calls (the report's ``calls``) show the grouped path ran on NF4 weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.kernels.nf4_weight import NF4Weight
from fasttune.model_patches.report import FUSED
from helpers.compare import assert_grads_close, rel_err
from helpers.nf4_moe import ATTENTION, EXPERT_PARAMS, SHAPES, dequantised_stock, load_4bit, nf4_weights
from helpers.tiny_models import make_batch, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

BLOCKS = {"qwen3_moe": 1, "gpt_oss": 1, "mixtral": 1, "qwen2_moe": 1}  # MoE layers of each tiny model (helpers.nf4_moe.SHAPES)

def moe_fallbacks(report) -> list:
    """Fallbacks of the MoE ops (the dense layer's 4-bit MLP without LoRA falls back on its own)."""
    return [f for f in report.fallbacks if f.op.startswith("moe") or f.op == "lora_moe"]


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


def _compare(stock, fast, seed, device, seq=13, grad_rtol=1e-5):
    batch = make_batch(stock.config.vocab_size, seq=seq, seed=seed, device=device)
    stock.train(), fast.train()
    out_fast, out_stock = _step(fast, batch), _step(stock, batch)
    assert rel_err(out_fast.loss, out_stock.loss) <= 1e-6
    assert_grads_close(fast, stock, grad_rtol)


def _experts_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
               if ".experts." in n and "lora_" not in n and "bias" not in n)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "mixtral", "qwen2_moe"])
def test_lora_on_experts_and_attention_with_nf4_experts(model_type, double_quant, device, tmp_path):
    base = load_4bit(model_type, tmp_path, device, double_quant=double_quant)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERT_PARAMS,
                        init_lora_weights=False)
    stock = get_peft_model(base, config)
    fast = copy.deepcopy(stock)
    dense_bytes = _experts_bytes(fast)
    report = patch_model(fast, FastConfig())
    blocks = BLOCKS[model_type]
    assert report.patched["moe_nf4"] == blocks and report.patched["lora_moe"] == blocks, str(report)
    assert moe_fallbacks(report) == [], str(report)
    held = nf4_weights(fast)
    assert len(held) == 2 * blocks and all(w.nested == double_quant and w.blocksize == 64 for w in held.values())
    # The dense expert weights are gone; NF4 holds them in ~1/7 of fp32's bytes (4 bits + the scales).
    assert not [n for n, _ in fast.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    assert _experts_bytes(fast) == sum(w.bytes_held() for w in held.values())
    assert _experts_bytes(fast) <= 0.15 * dense_bytes
    dequantised_stock(stock, fast)
    _compare(stock, fast, seed=18, device=device)
    assert report.calls["moe_nf4", FUSED] == blocks and report.calls["lora_moe", FUSED] == blocks
    trainable = [n for n, p in fast.named_parameters() if p.requires_grad]
    assert sum("experts" in n for n in trainable) == 4 * blocks and all(p.grad is not None for n, p in
                                                                        fast.named_parameters() if p.requires_grad)


def test_lora_on_attention_only_with_frozen_nf4_experts(device, tmp_path):
    base = load_4bit("qwen3_moe", tmp_path, device)
    stock = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["moe_nf4"] == 1 and "lora_moe" not in report.patched, str(report)
    assert moe_fallbacks(report) == [], str(report)
    dequantised_stock(stock, fast)
    # NF4 attention too: bitsandbytes' CPU 4-bit products and fasttune's dequantised fp32 ones round
    # differently; o_proj's lora_A gradient measured 1.1e-5 from stock on an AMD EPYC machine (2026-12-03),
    # the other gradients ≤ 1e-5.
    _compare(stock, fast, seed=19, device=device, grad_rtol=3e-5)
    assert report.calls["moe_nf4", FUSED] == 1 and report.calls["moe", FUSED] == 1


def test_stock_calls_get_dense_experts_for_that_call(device, tmp_path):
    """A call the grouped path does not take (a forward hook on the wrapped experts module) runs
    PEFT's forward on the dequantised weights, and the NF4 weights are back afterwards."""
    base = load_4bit("qwen3_moe", tmp_path, device)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS,
                        init_lora_weights=False)
    stock = get_peft_model(base, config)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    dequantised_stock(stock, fast)
    inner = fast.get_submodule("base_model.model.model.layers.0.mlp.experts.base_layer.base_layer")
    inner.register_forward_hook(lambda *a: None)
    _compare(stock, fast, seed=20, device=device)
    assert report.calls["moe_nf4", FUSED] == 0
    assert sum(v for (op, why), v in report.calls.items() if op == "moe_nf4" and why.startswith("dequantised")) == 1
    assert isinstance(inner.gate_up_proj, NF4Weight) and isinstance(inner.down_proj, NF4Weight)
    assert "gate_up_proj" not in inner._parameters


@pytest.mark.parametrize("double_quant", [False, True])
def test_greedy_generation_matches_dequantised_stock(device, tmp_path, double_quant, monkeypatch):
    """Prefill and every decode step run the grouped path on NF4 weights; a decode step dequantises
    only the experts its tokens hit (each expert's codes start on a scale block here: with double
    quant, on a second-level block too, hence the wider experts)."""
    base = load_4bit("qwen3_moe", tmp_path, device, double_quant=double_quant, moe_intermediate_size=128)
    stock = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                            target_parameters=EXPERT_PARAMS, init_lora_weights=False))
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    dequantised_stock(stock, fast)
    calls = {"whole": 0, "hit": 0}
    for method, key in (("dequantize", "whole"), ("dequantize_experts", "hit")):
        def counted(self, *a, _fn=getattr(NF4Weight, method), _key=key, **k):
            calls[_key] += 1
            return _fn(self, *a, **k)

        monkeypatch.setattr(NF4Weight, method, counted)
    stock.eval(), fast.eval()
    prompt = make_batch(stock.config.vocab_size, batch=2, seq=40, seed=30, device=device)  # 80 rows: prefill whole
    # No auxiliary loss while decoding: transformers 5.17 computes it at every step from the prompt's mask
    # and one step's router logits, and fails there (stock too); 5.24 does not.
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0, output_router_logits=False)
    with torch.no_grad():
        a = fast.generate(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], **kw)
        b = stock.generate(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], **kw)
    assert torch.equal(a, b)
    assert report.calls["moe_nf4", FUSED] == 4  # the prefill and three decode steps
    assert calls == {"whole": 2, "hit": 6}  # the prefill's two weights whole; per decode step, hit experts only


def test_off_auto_and_unpatch(device, tmp_path):
    base = load_4bit("qwen3_moe", tmp_path, device)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS))
    off = copy.deepcopy(model)
    report = patch_model(off, FastConfig(moe_experts_nf4="off"))
    assert "moe_nf4" not in report.patched and moe_fallbacks(report) == [] and not nf4_weights(off), str(report)

    report = patch_model(model, FastConfig())
    held = {n: w.dequantize() for n, w in nf4_weights(model).items()}
    with pytest.raises(RuntimeError, match="held in NF4"):
        model.merge_and_unload()  # PEFT's in-place merge cannot add into 4-bit codes
    unpatch_model(model)
    assert not nf4_weights(model)
    for name, values in held.items():
        p = model.get_parameter(name)
        assert torch.equal(p, values) and not p.requires_grad


def test_repatching_keeps_the_same_codes(device, tmp_path):
    """patch_model unpatches first: the restored dense experts take their NF4 codes back (double
    quant would drift if the dequantised values were quantised again), unless they were written."""
    base = load_4bit("qwen3_moe", tmp_path, device, double_quant=True)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS))
    patch_model(model, FastConfig())
    first = nf4_weights(model)
    report = patch_model(model, FastConfig())
    assert report.patched["moe_nf4"] == 1 and nf4_weights(model) == first
    unpatch_model(model)
    name = next(iter(first))
    model.get_parameter(name).data += 1.0  # written since (as PEFT's merge writes): quantised afresh
    patch_model(model, FastConfig())
    again = nf4_weights(model)
    assert again[name] is not first[name] and all(again[n] is first[n] for n in first if n != name)


def test_auto_leaves_dense_models_and_fp4_bases_alone(device, tmp_path):
    dense = tiny_model("qwen3_moe", seed=1, **SHAPES["qwen3_moe"]).to(device)
    report = patch_model(dense, FastConfig())
    assert "moe_nf4" not in report.patched and moe_fallbacks(report) == [], str(report)
    # "on" with trainable experts (full fine-tuning): they stay dense, reported.
    report = patch_model(tiny_model("qwen3_moe", seed=1).to(device), FastConfig(moe_experts_nf4="on"))
    assert [(f.op, "trainable" in f.reason) for f in moe_fallbacks(report)] == [("moe_nf4", True)], str(report)
    fp4 = load_4bit("qwen3_moe", tmp_path, device, quant_type="fp4")
    report = patch_model(fp4, FastConfig())
    fallbacks = moe_fallbacks(report)
    assert [f.op for f in fallbacks] == ["moe_nf4"] and "fp4" in fallbacks[0].reason, str(report)


def test_bad_option_names_the_argument():
    with pytest.raises(ValueError, match="moe_experts_nf4"):
        FastConfig(moe_experts_nf4="nf4")
    with pytest.raises(TypeError, match="moe_experts_nf4"):
        FastConfig(moe_experts_nf4=True)


def test_adapter_save_pretrained_holds_the_lora_weights_only(device, tmp_path):
    """PEFT's ``save_pretrained`` of the adapter: the same file as the stock model's (the NF4 buffers
    are no LoRA weights), and it loads back onto a fresh 4-bit base with NF4 experts."""
    from peft import PeftModel
    from safetensors.torch import load_file

    base = load_4bit("qwen3_moe", tmp_path / "base", device)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS,
                        init_lora_weights=False)
    stock = get_peft_model(base, config)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    stock.save_pretrained(tmp_path / "stock")
    fast.save_pretrained(tmp_path / "fast")
    a, b = (load_file(tmp_path / n / "adapter_model.safetensors") for n in ("fast", "stock"))
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)

    again = PeftModel.from_pretrained(load_4bit("qwen3_moe", tmp_path / "base2", device), tmp_path / "fast")
    report = patch_model(again, FastConfig())
    assert report.patched["moe_nf4"] == 1 and report.patched["lora_moe"] == 1, str(report)
    batch = make_batch(fast.config.vocab_size, seq=13, seed=21, device=device)
    fast.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, fast(**batch).logits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_30b_a3b_layers_with_nf4_experts_at_real_size(dtype):
    """Two Qwen3-30B-A3B layers (hidden 2048, 128 experts, top-8, 768 per expert), experts in NF4
    (blocksize 64, double quant), LoRA r=16 on attention and experts, 2×512 tokens.

    The oracle is the stock model holding the dequantised NF4 values. fp32: loss within 1e-5 and
    every gradient within 1e-4 of stock. bf16: fasttune's bf16 run is at least as close to the fp32
    stock run as stock's bf16 run is (2× its distance + 1e-2 relative), loss and every gradient
    (test_moe.py's real-size test says why bf16 against bf16 is no criterion). The experts hold at
    most 0.3× their dense bf16 bytes."""
    pytest.importorskip("bitsandbytes")  # the GPU image has none unless its wheel is carried
    from helpers.compare import grad_errors

    shape = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                 mlp_only_layers=[], output_router_logits=True)
    config = LoraConfig(r=16, lora_alpha=16, target_modules=ATTENTION, target_parameters=EXPERT_PARAMS,
                        init_lora_weights=False)
    base = get_peft_model(tiny_model("qwen3_moe", seed=9, **shape), config)
    fast = copy.deepcopy(base).to("cuda", dtype)
    dense_bytes = 2 * 128 * 3 * 768 * 2048 * 2  # two layers of bf16 experts
    report = patch_model(fast, FastConfig(moe_experts_nf4="on"))
    assert report.patched["moe_nf4"] == 2 and report.patched["lora_moe"] == 2, str(report)
    held = nf4_weights(fast)
    assert sum(w.bytes_held() for w in held.values()) <= 0.3 * dense_bytes
    # The oracle: the same model with the dequantised NF4 values as dense experts.
    ref = base.to("cuda", torch.float32)
    with torch.no_grad():
        for name, w in held.items():
            ref.get_parameter(name).copy_(w.dequantize())
    stock = copy.deepcopy(ref).to(dtype)
    batch = make_batch(shape["vocab_size"], batch=2, seq=512, seed=19, device="cuda")
    stock.train(), fast.train()
    torch.cuda.reset_peak_memory_stats()
    out_fast = _step(fast, batch)
    peak_fast = torch.cuda.max_memory_allocated()
    out_stock = _step(stock, batch)
    assert report.calls["moe_nf4", FUSED] == 2 and report.calls["lora_moe", FUSED] == 2
    print(f"\n{dtype}: loss fast {out_fast.loss.item():.6f} stock {out_stock.loss.item():.6f}; "
          f"experts held {sum(w.bytes_held() for w in held.values()) / 2**20:.0f} MiB "
          f"(bf16 dense {dense_bytes / 2**20:.0f} MiB); peak during the fast step {peak_fast / 2**30:.2f} GiB")
    if dtype == torch.float32:
        assert rel_err(out_fast.loss, out_stock.loss) <= 1e-5
        assert_grads_close(fast, stock, 1e-4)
        return
    ref.train()
    out_ref = _step(ref, batch)
    assert rel_err(out_fast.loss, out_ref.loss) <= 2 * rel_err(out_stock.loss, out_ref.loss) + 1e-2
    stock_err, fast_err = grad_errors(stock, ref), grad_errors(fast, ref)
    bad = {n: (fast_err[n], stock_err[n]) for n in stock_err if not fast_err[n] <= 2 * stock_err[n] + 1e-2}
    assert not bad, f"{len(bad)} gradients farther from fp32 than 2× stock bf16 + 1e-2: {dict(list(bad.items())[:5])}"
