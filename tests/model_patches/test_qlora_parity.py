"""QLoRA as people load it: fused NF4 path vs PEFT + bitsandbytes, fp32 and bf16 compute dtypes.

A tiny Llama checkpoint saved in bf16 and loaded with ``BitsAndBytesConfig`` (NF4, double
quantisation), so every ``QuantState`` is bfloat16. With ``bnb_4bit_compute_dtype=float32``
and ``prepare_model_for_kbit_training`` (norms, embeddings, head upcast to fp32) the activations
are fp32 while the QuantState is bf16: bitsandbytes 0.50's forward multiplies by the weight
dequantised straight to fp32, its backward (dX) by the bf16-rounded weight. A fused path that
rounds to bf16 in the forward too errs by ~5e-3 on the adapter gradients (one bf16 rounding of
W). LoRA r=8 on all seven projections, B random. Widths are multiples of 64 (docs/FACTS.md, bitsandbytes on the CPU).

Tolerances (relative; loss as a scalar, each trainable gradient in Frobenius norm):
- fp32 compute: loss ≤ 1e-5, gradients ≤ 1e-4 — the same weights and functions, products in
  another order (measured ≤ 2e-6 on gradients, ≤ 2e-7 on the loss).
- bf16 compute (everything bf16): against the fp32-compute run of the same quantised weights,
  fasttune errs no more than 2× stock PEFT + 2e-3 (test_lora.py's autocast rule).
The shapes: the issue's (hidden 128, 4/2 heads) and two held out (GQA 3:1 and 4:1, other
odd vocabularies, q/k/v/o and MLP biases on one).
"""

from __future__ import annotations


import pytest
import torch

from fasttune import FastConfig, patch_model
from helpers.compare import grad_errors, rel_err
from helpers.spies import count_fused_lora
from helpers.tiny_models import make_batch, tiny_model

pytest.importorskip("bitsandbytes")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "h128-issue": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=256, vocab_size=5003),
    "h192-gqa3": dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                      intermediate_size=384, vocab_size=4099),
    "h256-gqa4-bias": dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                           intermediate_size=512, vocab_size=3001, attention_bias=True, mlp_bias=True),
}
FUSED_PER_FORWARD = 2 * 3  # two layers × (lora_qkv, lora_o, lora_mlp)


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the fused Functions, so a silent fallback to PEFT's path fails the test."""
    return count_fused_lora(monkeypatch)


def save_checkpoint(path, shape: str) -> str:
    """A tiny random Llama of ``shape``, saved in bf16 (as most checkpoints are)."""
    tiny_model("llama", dtype=torch.bfloat16, seed=4, **SHAPES[shape]).save_pretrained(path)
    return str(path)


def qlora(path: str, compute_dtype: torch.dtype, prepare: bool, bf16_adapters: bool = False):
    """The checkpoint loaded in 4-bit NF4 (double quant) + a PEFT LoRA adapter with random B
    (float32 unless ``bf16_adapters``: then PEFT keeps them in the bf16 base's dtype)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=torch.bfloat16,
                                                 attn_implementation="eager")
    if prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(model, config, autocast_adapter_dtype=not bf16_adapters)


def step(model, batch):
    """Loss and {name: grad} of one forward + backward in train mode (bitsandbytes' CPU eval
    path repacks NF4 weights, docs/FACTS.md, bitsandbytes on the CPU)."""
    model.train()
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device  # bitsandbytes loads onto CUDA where there is one
    loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
    loss.backward()
    return loss.detach()


def by_projection(errs: dict[str, float]) -> dict[str, float]:
    """The worst gradient error per projection type (q_proj, ...), for readable failures."""
    worst = {}
    for name, err in errs.items():
        key = next((t for t in TARGETS if f".{t}." in name), name)
        worst[key] = max(worst.get(key, 0.0), err)
    return worst


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_compute_over_bf16_quant_state_matches_bitsandbytes(tmp_path, shape, spy):
    path = save_checkpoint(tmp_path, shape)
    stock, fast = qlora(path, torch.float32, prepare=True), qlora(path, torch.float32, prepare=True)
    qs = fast.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.quant_state
    assert qs.dtype == torch.bfloat16 and qs.nested  # the case under test
    report = patch_model(fast, FastConfig())
    assert not [f for f in report.fallbacks if f.op.startswith("lora")], str(report)
    batch = make_batch(SHAPES[shape]["vocab_size"], seq=24, seed=5)
    loss_stock, loss_fast = step(stock, batch), step(fast, batch)
    assert sum(spy.values()) == FUSED_PER_FORWARD, spy
    assert rel_err(loss_fast, loss_stock) <= 1e-5, (loss_fast, loss_stock)
    errs = grad_errors(fast, stock)
    assert len(errs) == 2 * 7 * 2
    worst = by_projection(errs)
    assert max(worst.values()) <= 1e-4, worst


def test_bf16_compute_within_bf16_noise(tmp_path, spy):
    """All-bf16 QLoRA (compute dtype = QuantState dtype = activations): the fused NF4 LoRA path vs
    the fp32-compute run of the same NF4 codes errs ≤ 2× stock + 2e-3, loss and every gradient
    (measured: max gradient error 2.8e-2 vs stock's 2.5e-2). Only the LoRA kernels are on: the
    other kernels' bf16 roundings are their own tests' business."""
    path = save_checkpoint(tmp_path, "h192-gqa3")
    oracle = qlora(path, torch.float32, prepare=True)
    stock, fast = qlora(path, torch.bfloat16, prepare=False), qlora(path, torch.bfloat16, prepare=False)
    with torch.no_grad():  # the bf16 runs' adapters exactly (PEFT may create them in bf16 first)
        params = dict(stock.named_parameters())
        for name, p in oracle.named_parameters():
            if p.requires_grad:
                p.copy_(params[name])
    patch_model(fast, FastConfig(cross_entropy=False, rms_norm=False, residual_norms=False, rope=False, mlp=False,
                                 fused_logprobs=False))
    batch = make_batch(SHAPES["h192-gqa3"]["vocab_size"], seq=24, seed=6)
    ref_loss = step(oracle, batch)
    ref = {n: p.grad.double() for n, p in oracle.named_parameters() if p.requires_grad}
    errs = {}
    for name, model in (("stock", stock), ("fast", fast)):
        loss = step(model, batch)
        errs[name] = [rel_err(loss, ref_loss)] + [rel_err(p.grad, ref[n]) for n, p in model.named_parameters()
                                                  if p.requires_grad]
    assert sum(spy.values()) == FUSED_PER_FORWARD, spy
    bad = [(i, f, s) for i, (f, s) in enumerate(zip(errs["fast"], errs["stock"])) if not f <= 2 * s + 2e-3]
    assert not bad, bad
