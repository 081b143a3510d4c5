"""Vision-language models on the fast path: Qwen2.5-VL, Qwen2-VL and Gemma 3 (``*ForConditionalGeneration``).

Stock vs patched copies of one tiny random VLM (tests/_lib/helpers/tiny_vlms.py: two-layer GQA
language tower, a small vision tower, images from the family's own image processor built from its
defaults), fp32. Each batch holds two rows of different lengths, one image each, right padded
(left for generation), prompt and padding labels ignored. What is checked:

- the language tower takes its text family's path (norms, RoPE, GLU, fused loss head, residual
  norms where the layer is pre-norm), counted at run time; the report names the vision tower as
  stock except its RMSNorms, and nothing else as stock;
- loss ≤ 1e-6 and every trainable gradient ≤ 1e-5 relative (vision tower, projector and
  embeddings included in full fine-tuning); gradients that are zero in exact math (SigLIP's key
  bias: ~1e-9 absolute noise in both runs) are compared against 1e-4 of the largest gradient norm;
- Qwen's 3-D RoPE: the rows' positions really differ per section (the image tokens' height/width
  positions), so the kernel rotates with per-row cos/sin built from them;
- LoRA on the language tower (fused, counted by spies), and with the vision tower too (PEFT's path there);
- checkpointing of decoder layers and vision blocks: the same gradients;
- greedy generation with an image in a left-padded prompt: the same tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.compare import assert_grads_close, rel_err
from helpers.spies import count_fused_lora, model_patch_counts
from helpers.tiny_vlms import IMAGE_ID, VLM_TYPES, tiny_vlm, vlm_batch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.model_patches.families import FAMILIES
from fasttune.model_patches.vision import OP, OP_CHECKPOINTING

LAYERS = 2
# RMSNorms: language tower (per layer + final), and those of the vision tower / projector.
NORMS = {"qwen2_5_vl": (2, 2 * 2 + 1), "qwen2_vl": (2, 0), "gemma3": (6, 1)}
PRE_NORM = {"qwen2_5_vl", "qwen2_vl"}
LANGUAGE_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
VISION_TARGETS = (r".*(language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                  r"|visual.*\.(qkv|proj|gate_proj|up_proj|down_proj))")


def expected_counts(model_type: str, lora: bool = False) -> dict[str, int]:
    per_layer, vision = NORMS[model_type]
    counts = {"rms_norm": LAYERS * per_layer + 1 + vision, "rope": LAYERS, "mlp": LAYERS, "cross_entropy": 1}
    if model_type in PRE_NORM:
        counts["residual_norms"] = LAYERS
    if lora:
        counts.update(lora_qkv=LAYERS, lora_o=LAYERS, lora_mlp=LAYERS)
    return counts


def _only_vision_fallback(report) -> None:
    assert [fb.op for fb in report.fallbacks] == [OP], str(report)
    assert "stay stock" in report.fallbacks[0].reason


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


def _fused_calls(report) -> dict[str, int]:
    return {op: n for (op, outcome), n in report.calls.items() if outcome == "fused"}


def _lora(model, targets: str):
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, config)


def test_rows_point_at_the_language_tower():
    for model_type in VLM_TYPES:
        spec = FAMILIES[model_type]
        assert spec.vision is not None and spec.causal_lm_class.endswith("ForConditionalGeneration")
        assert spec.vision.language_model == "model.language_model"
    assert FAMILIES["gemma3"].final_softcap_attr is None  # the stock multimodal head applies none


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_full_finetune_parity(model_type, device):
    stock = tiny_vlm(model_type, seed=1).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert model_patch_counts(report) == expected_counts(model_type), str(report)
    _only_vision_fallback(report)

    # Image tokens keep their labels in Qwen's batch (TRL's collator does not mask them), not in Gemma's.
    batch = vlm_batch(model_type, stock.config, seed=11, mask_images=model_type == "gemma3", device=device)
    assert (batch["attention_mask"] == 0).any() and (batch["input_ids"] == IMAGE_ID).any()
    attn = fast.model.language_model.layers[0].self_attn
    fwd, seen = attn.__dict__["forward"], []
    rope = fwd._rope
    fwd._rope = lambda q, k, cos, sin: (seen.append(tuple(cos.shape)), rope(q, k, cos, sin))[1]
    loss_fast, loss_stock = _step(fast, batch), _step(stock, batch)
    del fwd._rope
    # One cos/sin row per token of each row: Qwen's 3-D positions differ per row (test_batch_positions_are_3d).
    assert seen == [(2 if model_type in PRE_NORM else 1, batch["input_ids"].shape[1], attn.head_dim)], seen
    assert rel_err(loss_fast, loss_stock) <= 1e-6
    assert_grads_close(fast, stock, 1e-5, floor=1e-4)
    calls = _fused_calls(report)
    assert calls["cross_entropy"] == 1 and calls["rope"] == LAYERS and calls["mlp"] == LAYERS, calls
    assert calls["rms_norm"] >= LAYERS, calls
    assert all(outcome == "fused" for (_, outcome) in report.calls), dict(report.calls)

    unpatch_model(fast)
    assert [name for name, m in fast.named_modules() if "forward" in m.__dict__] == []


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen2_vl"])
def test_batch_positions_are_3d(model_type):
    """The parity batches exercise the 3-D RoPE: positions differ per section on the image tokens
    (height vs width) and per row; the stock rotary module folds them into per-row cos/sin."""
    model = tiny_vlm(model_type, seed=1)
    batch = vlm_batch(model_type, model.config, seed=11)
    positions, _ = model.model.get_rope_index(batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                                              attention_mask=batch["attention_mask"],
                                              mm_token_type_ids=batch["mm_token_type_ids"])
    image = batch["input_ids"] == IMAGE_ID
    assert positions.shape[0] == 3
    assert not torch.equal(positions[1][image], positions[2][image])
    assert not torch.equal(positions[0][0], positions[0][1])


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_lora_language_tower_parity(model_type, device, monkeypatch):
    stock = _lora(tiny_vlm(model_type, seed=2).to(device), LANGUAGE_TARGETS)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert model_patch_counts(report) == expected_counts(model_type, lora=True), str(report)
    _only_vision_fallback(report)
    trainable = [n for n, p in fast.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "language_model" in n for n in trainable)

    spy = count_fused_lora(monkeypatch)
    batch = vlm_batch(model_type, stock.config, seed=12, device=device)
    loss_fast, loss_stock = _step(fast, batch), _step(stock, batch)
    assert rel_err(loss_fast, loss_stock) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)
    assert spy == {"lora_qkv": LAYERS, "lora_linear": LAYERS, "lora_mlp": LAYERS}, spy


@pytest.mark.slow  # ~30 s on 2 CPU cores
def test_lora_with_the_vision_tower_and_checkpointing(device, monkeypatch):
    """Adapters on both towers (the vision ones on PEFT's path), decoder layers and vision blocks
    recomputed: the same loss and gradients as stock without checkpointing."""
    stock = _lora(tiny_vlm("qwen2_5_vl", seed=3).to(device), VISION_TARGETS)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(checkpointing="recompute"))
    assert report.patched["checkpointing"] == LAYERS and report.patched[OP_CHECKPOINTING] == 2, str(report)
    assert report.patched["lora_qkv"] == LAYERS, str(report)
    trainable = {n.split(".lora_")[0].split(".")[3] for n, p in fast.named_parameters() if p.requires_grad}
    assert trainable == {"visual", "language_model"}

    spy = count_fused_lora(monkeypatch)
    batch = vlm_batch("qwen2_5_vl", stock.config, seed=13, device=device)
    loss_fast, loss_stock = _step(fast, batch), _step(stock, batch)
    assert rel_err(loss_fast, loss_stock) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)
    assert spy["lora_qkv"] == 2 * LAYERS, spy  # forward + the backward's recompute
    assert _fused_calls(report)["rms_norm"] > expected_counts("qwen2_5_vl")["rms_norm"]


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_greedy_generation_with_an_image_matches_stock(model_type, device):
    stock = tiny_vlm(model_type, seed=4).to(device).eval()
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    # Long prompts: the prefill (> 64 rows) takes the kernels; the decode steps run stock code.
    batch = vlm_batch(model_type, stock.config, seed=14, prompt_lens=(40, 33), answer_lens=(2, 3),
                      padding_side="left", device=device)
    batch.pop("labels")
    kw = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        a = fast.generate(**batch, **kw)
        b = stock.generate(**batch, **kw)
    assert a.shape == (2, batch["input_ids"].shape[1] + 4)
    assert torch.equal(a, b)
    assert _fused_calls(report).get("rope") == LAYERS  # the prefill


def _nf4_language_tower_(model):
    """The language tower's attention/MLP linears → bitsandbytes NF4 ``Linear4bit`` (double quant, fp32
    compute), quantised from the random weights when moved to the device; the vision tower stays dense."""
    import bitsandbytes as bnb

    for layer in model.model.language_model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, q)
    return model


@pytest.mark.slow  # ~30 s on 2 CPU cores
def test_qlora_language_tower_parity(device, monkeypatch):
    """NF4 base weights under the adapters (widths multiples of 64: bitsandbytes' CPU path, NOTES §4):
    the fused NF4 path vs PEFT + bitsandbytes, loss ≤ 1e-5 and gradients ≤ 1e-4 (test_qlora_parity.py's bounds)."""
    pytest.importorskip("bitsandbytes")
    sizes = dict(hidden_size=128, intermediate_size=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                          "mrope_section": [4, 6, 6]})
    base = tiny_vlm("qwen2_5_vl", seed=5, vision={"out_hidden_size": 128}, **sizes)
    _nf4_language_tower_(base)
    stock = _lora(base.to(device), LANGUAGE_TARGETS)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["lora_qkv"] == report.patched["lora_mlp"] == LAYERS, str(report)
    spy = count_fused_lora(monkeypatch)
    batch = vlm_batch("qwen2_5_vl", stock.config, seed=15, device=device)
    loss_fast, loss_stock = _step(fast, batch), _step(stock, batch)
    assert rel_err(loss_fast, loss_stock) <= 1e-5
    assert_grads_close(fast, stock, 1e-4)
    assert spy == {"lora_qkv": LAYERS, "lora_linear": LAYERS, "lora_mlp": LAYERS}, spy


# Qwen2.5-VL-7B and Gemma-3-4B widths per layer (two layers each), real vision widths, real vocabularies.
_REAL = {
    "qwen2_5_vl": (dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                        num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                "mrope_section": [16, 24, 24]}),
                   dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)),
    "gemma3": (dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=128),
               dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_real_widths_bf16_lora_gpu(model_type, monkeypatch):
    """bf16 weights (no autocast), real widths, rows of ~450 tokens with an image: fused vs stock PEFT,
    both against an fp32 run of the same weights, loss and every adapter gradient within 2× stock's
    error + 5e-3 (test_lora.py's rule); every fused op counted."""
    text, vision = _REAL[model_type]
    torch.manual_seed(0)
    ref = _lora(tiny_vlm(model_type, seed=7, vision=vision, **text), LANGUAGE_TARGETS).cuda()
    stock = copy.deepcopy(ref)
    for name, p in stock.named_parameters():  # a bf16 model with PEFT's float32 adapters
        if p.is_floating_point() and "lora_" not in name:
            p.data = p.data.bfloat16()
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert model_patch_counts(report) == expected_counts(model_type, lora=True), str(report)
    spy = count_fused_lora(monkeypatch)
    batch = vlm_batch(model_type, ref.config, seed=16, prompt_lens=(200, 150), answer_lens=(240, 280),
                      device="cuda")
    batch32 = dict(batch)
    batch["pixel_values"] = batch["pixel_values"].bfloat16()
    ref_loss = _step(ref, batch32)
    ref_grads = {n: p.grad.double() for n, p in ref.named_parameters() if p.requires_grad}
    errs = {}
    for label, model in (("stock", stock), ("fast", fast)):
        loss = _step(model, batch)
        errs[label] = {"loss": rel_err(loss, ref_loss)} | {
            n: rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.requires_grad}
    bad = {k: (errs["fast"][k], errs["stock"][k]) for k in errs["stock"]
           if not errs["fast"][k] <= 2 * errs["stock"][k] + 5e-3}
    assert not bad, dict(list(bad.items())[:5])
    assert spy == {"lora_qkv": LAYERS, "lora_linear": LAYERS, "lora_mlp": LAYERS}, spy
    assert _fused_calls(report)["cross_entropy"] == 1 and _fused_calls(report)["rope"] == LAYERS
