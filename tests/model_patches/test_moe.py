"""Mixture-of-experts families on the fast path: the same loss (with the router's auxiliary loss)
and the same gradient of every trainable parameter (routers and experts included) as the stock
model, fp32, on tiny random configs (tests/_lib/helpers/tiny_models.py: 4 experts, top-2,
``output_router_logits=True``). Loss ≤ 1e-6 relative, every gradient ≤ 1e-5 (see
test_family_parity.py for why these bounds). The grouped expert path must actually run: the
report's call counts say how many expert calls were fused, and with LoRA how many fused adapters.

Covered: full fine-tuning of every MoE family of the table; PEFT LoRA on the experts
(``target_parameters``) with LoRA on attention; LoRA on attention only with the experts frozen;
top-1 routing with an expert that no token reaches; bf16; offloaded checkpointing; greedy
generation with a KV cache; unpatching.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.model_patches.lora_widen import owns_storage
from fasttune.model_patches.moe_widen import WIDE_EXPERTS_ATTR
from fasttune.model_patches.report import FUSED
from helpers.compare import assert_grads_close, assert_grads_close_judging_ill_conditioned, grad_errors, rel_err
from helpers.spies import grouped_mlp_output_unused, model_patch_counts
from helpers.tiny_models import MOE_TYPES, make_batch, stock_fallback_ops, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# MoE blocks per tiny model (Qwen3-MoE, GLM-4-MoE and Qwen2-MoE have one dense layer of two) and the patched ops.
MOE_BLOCKS = {"qwen3_moe": 1, "mixtral": 2, "gpt_oss": 2, "olmoe": 2, "granitemoe": 2, "glm4_moe": 1,
              "qwen3_5_moe_text": 2, "qwen2_moe": 1}
EXPECTED = {
    "qwen3_moe": dict(rms_norm=9, mlp=1, residual_norms=2),
    "mixtral": dict(rms_norm=5, residual_norms=2),
    "gpt_oss": dict(rms_norm=5),
    "olmoe": dict(rms_norm=9, residual_norms=2),
    "granitemoe": dict(rms_norm=5),
    "glm4_moe": dict(rms_norm=9, mlp=2, residual_norms=2),  # the dense layer's MLP and the shared expert
    # Qwen3.5-MoE: one gated-delta-rule layer (stock) and one attention layer; the shared experts' MLPs.
    "qwen3_5_moe_text": dict(rms_norm=7, mlp=2, rope=1),
    "qwen2_moe": dict(rms_norm=5, mlp=2, residual_norms=2),  # the dense layer's MLP and the shared expert
}
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def expected_counts(model_type: str) -> dict[str, int]:
    return {"cross_entropy": 1, "rope": 2, "moe": MOE_BLOCKS[model_type], **EXPECTED[model_type]}


def _one_layer(model_type: str) -> dict:
    """Overrides for a one-layer tiny model (the interpreter's cost is per launch: fewer layers, faster tests)."""
    return dict(num_hidden_layers=1, **({"layer_types": ["sliding_attention"]} if model_type == "gpt_oss" else {}))


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


def _records_router_logits(model) -> bool:
    """Whether this transformers records the routers' logits for the model (5.17's Granite-MoE does not,
    and its own forward then fails computing the auxiliary loss)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "router_logits" in (getattr(type(getattr(base, "model", base)), "_can_record_outputs", None) or {})


def _compare(stock, fast, seed, device, seq=13):
    if stock.config.output_router_logits and not _records_router_logits(stock):
        pytest.skip(f"transformers {transformers.__version__} records no router logits for "
                    f"{stock.config.model_type} (stock cannot compute its auxiliary loss)")
    batch = make_batch(stock.config.vocab_size, seq=seq, seed=seed, device=device)
    stock.train(), fast.train()
    out_fast, out_stock = _step(fast, batch), _step(stock, batch)
    assert rel_err(out_fast.loss, out_stock.loss) <= 1e-6
    if getattr(out_stock, "aux_loss", None) is not None:
        assert rel_err(out_fast.aux_loss, out_stock.aux_loss) <= 1e-6
    assert_grads_close_judging_ill_conditioned(fast, stock, 1e-5, lambda exact: _step(exact, batch))
    return out_fast


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_full_finetune_parity_and_unpatch(model_type, device):
    stock = tiny_model(model_type, seed=1).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert model_patch_counts(report) == expected_counts(model_type), str(report)
    assert [f.op for f in report.fallbacks] == stock_fallback_ops(model_type), str(report)
    out = _compare(stock, fast, seed=11, device=device)
    assert report.calls["moe", FUSED] == MOE_BLOCKS[model_type]
    routers = [n for n, p in fast.named_parameters() if ("gate.weight" in n or "router" in n) and p.grad is not None]
    assert routers and all(fast.get_parameter(n).grad.abs().max() > 0 for n in routers)
    if model_type != "glm4_moe":  # GLM-4-MoE has no auxiliary loss in transformers
        assert out.aux_loss is not None

    unpatch_model(fast)
    assert [n for n, m in fast.named_modules() if "forward" in m.__dict__] == []
    fast.eval(), stock.eval()
    batch = make_batch(stock.config.vocab_size, seq=13, seed=3, device=device)
    with torch.no_grad():
        assert torch.equal(fast(**batch).logits, stock(**batch).logits)


def _expert_weights(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
            or ".experts.base_layer" in n and n.endswith(("gate_up_proj", "down_proj"))}


def _widened(model) -> list:
    """The ``WideExperts`` that still hold their expert weight."""
    found = []
    for m in model.modules():
        for name, wide in (m.__dict__.get(WIDE_EXPERTS_ATTR) or {}).items():
            if wide is not None and wide.holds(getattr(m, name)):
                found.append(wide)
    return found


@pytest.mark.parametrize("widen", [True, False])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "qwen2_moe"])
def test_lora_on_experts_parity(model_type, widen, device):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMS,
                        init_lora_weights=False)  # B ≠ 0: the adapters change the output
    overrides = _one_layer(model_type) if model_type == "gpt_oss" else {}
    stock = get_peft_model(tiny_model(model_type, seed=2, **overrides), config).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(lora_widen=widen))
    blocks = 1
    assert report.patched["moe"] == blocks and report.patched["lora_moe"] == blocks, str(report)
    trainable = [n for n, p in fast.named_parameters() if p.requires_grad]
    assert sum("experts" in n for n in trainable) == 4 * blocks  # A and B of both expert parameters
    _compare(stock, fast, seed=12, device=device)
    assert report.calls["lora_moe", FUSED] == blocks
    # lora_widen: both expert weights now live in buffers with a 16-wide border for A and s·B (r = 4)
    assert len(_widened(fast)) == (2 * blocks if widen else 0)
    assert all(w.extra == 16 for w in _widened(fast))

    # Adapters disabled (DPO's reference pass): the base experts alone, still on the grouped path.
    with fast.disable_adapter(), stock.disable_adapter(), torch.no_grad():
        batch = make_batch(stock.config.vocab_size, seq=40, seed=13, device=device)
        fast.train(), stock.train()
        assert rel_err(fast(**batch).loss, stock(**batch).loss) <= 1e-6
    assert report.calls["moe", FUSED] == 2 * blocks and report.calls["lora_moe", FUSED] == blocks
    if widen:  # the adapters back on after a pass with a zero border: A and B are reloaded
        _compare(stock, fast, seed=14, device=device)
        unpatch_model(fast)
        assert _widened(fast) == [] and all(owns_storage(p) for p in _expert_weights(fast).values())
        assert len(_expert_weights(fast)) == 2 * blocks
        _compare(stock, fast, seed=15, device=device)


def test_fresh_expert_adapters_give_the_base_model_bit_for_bit(device):
    """init_lora_weights=True (B = 0) on widened experts: the loss with the adapters on and off
    (DPO's policy and reference at step 0) is the same bits."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMS)
    fast = get_peft_model(tiny_model("qwen3_moe", seed=5), config).to(device)
    report = patch_model(fast, FastConfig())
    batch = make_batch(fast.config.vocab_size, seq=40, seed=16, device=device)  # prefill-sized: fused
    fast.train()
    with torch.no_grad():
        on = fast(**batch).loss
        with fast.disable_adapter():
            off = fast(**batch).loss
    assert len(_widened(fast)) == 2 and report.calls["lora_moe", FUSED] == 1
    assert torch.equal(on, off)


def test_lora_on_attention_only_keeps_experts_frozen(device):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False)
    stock = get_peft_model(tiny_model("mixtral", seed=3), config).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["moe"] == 2 and "lora_moe" not in report.patched and report.fallbacks == [], str(report)
    _compare(stock, fast, seed=14, device=device)
    assert report.calls["moe", FUSED] == 2
    assert all(p.grad is None for n, p in fast.named_parameters() if "experts" in n)


def test_top1_routing_with_an_expert_no_token_reaches(device):
    stock = tiny_model("gpt_oss", seed=4, num_experts_per_tok=1, **_one_layer("gpt_oss")).to(device)
    with torch.no_grad():
        for layer in stock.model.layers:
            layer.mlp.router.bias[3] = -1e4  # expert 3 never wins the top-1
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    _compare(stock, fast, seed=15, device=device)
    for name, p in fast.named_parameters():
        if "experts" in name:
            assert torch.equal(p.grad[3], torch.zeros_like(p.grad[3])), name


def test_bf16_loss_and_gradients_within_bf16_noise(device):
    """bf16 stock and patched runs against fp32: the patched error at most 2× stock's + eps."""
    ref = tiny_model("qwen3_moe", seed=5)
    stock16 = copy.deepcopy(ref).to(torch.bfloat16)
    fast16 = copy.deepcopy(stock16)
    patch_model(fast16, FastConfig())
    batch = make_batch(ref.config.vocab_size, seq=13, seed=16, device=device)
    losses = []
    for m in (ref, stock16, fast16):
        m.to(device).train()
        losses.append(_step(m, batch).loss.double())
    eps = torch.finfo(torch.bfloat16).eps
    assert (losses[2] - losses[0]).abs() <= 2 * (losses[1] - losses[0]).abs() + eps * losses[0].abs()
    grads = {n: [m.get_parameter(n).grad.double() for m in (ref, stock16, fast16)] for n, _ in ref.named_parameters()}
    for name, (g32, gs, gf) in grads.items():
        bound = 2 * (gs - g32).norm() + 4 * eps * g32.norm()
        assert (gf - g32).norm() <= bound, name


def test_offloaded_checkpointing_matches_stock(device):
    stock = tiny_model("mixtral", seed=6).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(checkpointing="offload"))
    assert report.patched["checkpointing"] == 2 and report.patched["moe"] == 2
    _compare(stock, fast, seed=17, device=device)
    assert report.calls["moe", FUSED] >= 2


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_recompute_skips_the_unused_down_projection_exactly(model_type, device, monkeypatch):
    """Under checkpointing the recompute's MoE output is thrown away (it only enters the residual
    sum in every MoE family): the recompute runs the gate/up product alone (output_unused=True,
    once per block), and loss and gradients equal those of an unchecked patched run and stock's."""
    flags = grouped_mlp_output_unused(monkeypatch)
    stock = tiny_model(model_type, seed=8).to(device)
    plain, fast = copy.deepcopy(stock), copy.deepcopy(stock)
    patch_model(plain, FastConfig())
    report = patch_model(fast, FastConfig(checkpointing="recompute"))
    blocks = MOE_BLOCKS[model_type]
    out_plain = _compare(stock, plain, seed=19, device=device)
    assert flags == [False] * blocks
    flags.clear()
    out_fast = _compare(stock, fast, seed=19, device=device)
    assert flags == [False] * blocks + [True] * blocks, flags
    assert report.calls["moe", FUSED] == 2 * blocks  # forward and recompute
    if device != "cpu":  # CUDA: atomic adds (index_add_, split-K GEMMs) make runs differ in the last bits
        return  # (both runs were checked against stock above)
    assert torch.equal(out_fast.loss, out_plain.loss)
    for (name, p), q in zip(fast.named_parameters(), plain.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9), name


def test_lora_on_experts_under_offload_skips_the_down_projection_exactly(device, monkeypatch):
    """The same with PEFT LoRA on gpt-oss's experts (transposed weights, biases) under "offload"."""
    flags = grouped_mlp_output_unused(monkeypatch)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMS,
                        init_lora_weights=False)
    stock = get_peft_model(tiny_model("gpt_oss", seed=9), config).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(checkpointing="offload"))
    _compare(stock, fast, seed=20, device=device)
    assert flags == [False] * 2 + [True] * 2, flags
    assert report.calls["lora_moe", FUSED] == 4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_greedy_generation_with_cache_matches_stock(model_type, device):
    stock = tiny_model(model_type, seed=7).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    stock.eval(), fast.eval()
    prompt = make_batch(stock.config.vocab_size, batch=2, seq=40, seed=30, device=device)  # 80 rows: prefill fused
    # No auxiliary loss while decoding: transformers 5.17 computes it at every step from the prompt's mask
    # and one step's router logits, and fails there (stock too); 5.24 does not.
    kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0, output_router_logits=False)
    with torch.no_grad():
        a = fast.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], **kw)
        b = stock.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], **kw)
    assert torch.equal(a, b)
    assert report.calls["moe", FUSED] == 1  # the prefill; decode steps run the stock experts


def test_qlora_experts_kept_dense_take_the_grouped_path(device, tmp_path):
    """bitsandbytes quantises 2-D linears only: attention is NF4 (fused LoRA with NF4 dequant); with
    ``moe_experts_nf4="off"`` the stacked experts stay dense in the load dtype and their LoRA is fused
    into the grouped products (NF4 experts, the "auto" default: test_moe_nf4.py)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # NF4 rows: multiples of 64 (NOTES §4); one layer
    tiny_model("mixtral", seed=8, hidden_size=128, head_dim=32, num_hidden_layers=1).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.float32,
                                                attn_implementation="eager", device_map=device)
    assert type(base.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=EXPERT_PARAMS, init_lora_weights=False)
    stock = get_peft_model(base, config)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(moe_experts_nf4="off"))
    assert report.fallbacks == [] and "moe_nf4" not in report.patched, str(report)
    assert report.patched["lora_moe"] == 1 and report.patched["lora_qkv"] == 1, str(report)
    _compare(stock, fast, seed=18, device=device)
    assert report.calls["lora_moe", FUSED] == 1 and report.calls["lora_qkv", FUSED] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_30b_a3b_layers_at_real_size(dtype):
    """Two Qwen3-30B-A3B layers (128 experts, top-8, 2048 → 768), LoRA r=16 on attention and experts.

    fp32 (the Triton grouped GEMM; torch's takes bf16 only): the stock loss within 1e-5 and every
    gradient within 1e-4. bf16 (torch's grouped GEMM): fasttune's bf16 run is at least as close to an
    fp32 stock run as stock's bf16 run is — loss and every gradient, within 2× stock's distance plus
    1e-2 relative. (bf16 against bf16 directly is no criterion: the two round the router's input
    differently, and near-tie top-8 choices then flip between them, as they do against fp32.)"""
    shape = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                 mlp_only_layers=[], output_router_logits=True)
    config = LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=EXPERT_PARAMS, init_lora_weights=False)
    base = get_peft_model(tiny_model("qwen3_moe", seed=9, **shape), config)
    stock = copy.deepcopy(base).to("cuda", dtype)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["lora_moe"] == 2, str(report)
    batch = make_batch(shape["vocab_size"], batch=2, seq=512, seed=19, device="cuda")
    stock.train(), fast.train()
    out_fast, out_stock = _step(fast, batch), _step(stock, batch)
    assert report.calls["lora_moe", FUSED] == 2
    if dtype == torch.float32:
        assert rel_err(out_fast.loss, out_stock.loss) <= 1e-5
        assert_grads_close(fast, stock, 1e-4)
        return
    ref = base.to("cuda", torch.float32)
    ref.train()
    out_ref = _step(ref, batch)
    assert rel_err(out_fast.loss, out_ref.loss) <= 2 * rel_err(out_stock.loss, out_ref.loss) + 1e-2
    stock_err, fast_err = grad_errors(stock, ref), grad_errors(fast, ref)
    bad = {n: (fast_err[n], stock_err[n]) for n in stock_err if not fast_err[n] <= 2 * stock_err[n] + 1e-2}
    assert not bad, f"{len(bad)} gradients farther from fp32 than 2× stock bf16 + 1e-2: {dict(list(bad.items())[:5])}"


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen2_moe"])
def test_gated_shared_expert_lora_under_offload_matches_stock(model_type, device):
    """Qwen3.5-MoE and Qwen2-MoE scale their shared expert (a dense MLP) by a sigmoid gate, a product that saves
    the MLP's output for backward: the checkpoint's recompute must not skip that MLP's down projection (it did,
    giving NaN gradients, before the row said ``mlp_output_saved``). LoRA on attention, the shared expert (and
    Qwen2-MoE's dense layer) and the experts, under "offload"."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                        target_parameters=EXPERT_PARAMS, init_lora_weights=False)
    stock = get_peft_model(tiny_model(model_type, seed=2), config).to(device)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(checkpointing="offload"))
    blocks = MOE_BLOCKS[model_type]
    assert report.patched["lora_mlp"] == 2 and report.patched["lora_moe"] == blocks, str(report)
    _compare(stock, fast, seed=5, device=device)
    # forward and recompute
    assert report.calls["lora_mlp", FUSED] == 4 and report.calls["lora_moe", FUSED] == 2 * blocks
