"""One checkpointed layer call (``layer_call.py``): its passes, and with ``FastConfig.keep_recomputed_nf4``
the NF4 weights its recompute dequantises kept for the same layer's backward (``kernels/kept_weights.py``).

A tiny Llama saved in bf16 and loaded in NF4 (double quantisation, bf16 QuantStates), LoRA on all
seven projections with random B. Against the same model without checkpointing and with the option
off: the loss and every adapter gradient bit for bit, and the weights put and taken counted (each
one the recompute kept is taken exactly once by the backward). Where the compute dtype is not the
QuantState's (fp32 compute), nothing is kept and the numbers are still those of the unchecked run.
"""

from __future__ import annotations

import pytest
import torch

from fasttune import FastConfig, patch_model
from fasttune.kernels.kept_weights import KeptWeights
from helpers.sgd_steps import sgd_steps
from helpers.spies import count_fused_lora
from helpers.tiny_models import make_batch, tiny_model

pytest.importorskip("bitsandbytes")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
             vocab_size=5003, num_hidden_layers=2)
N_LAYERS = SHAPE["num_hidden_layers"]
# Kept per step: q, k, v, o, gate and up of each layer (the recompute skips down's product), except
# layer 0's q/k/v, whose input (the frozen embeddings' output) needs no gradient: no dX, nothing kept.
KEPT_PER_STEP = 6 * N_LAYERS - 3
# The fused LoRA Functions are what is tested; the other kernels (their own tests' business) are off.
LORA_ONLY = dict(cross_entropy=False, rms_norm=False, residual_norms=False, rope=False, mlp=False, fused_logprobs=False)


def qlora(path: str, compute_dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=torch.bfloat16,
                                                 attn_implementation="eager")
    if compute_dtype == torch.float32:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(model, config)


@pytest.fixture
def kept_counts(monkeypatch):
    """Every ``KeptWeights``' puts and takes, summed over the layer calls."""
    counts = {"put": 0, "take": 0, "taken": 0}
    put, take = KeptWeights.put, KeptWeights.take

    def counting_put(self, base, weight):
        counts["put"] += 1
        return put(self, base, weight)

    def counting_take(self, base, dtype, **kw):
        w = take(self, base, dtype, **kw)
        counts["take"] += 1
        counts["taken"] += w is not None
        return w

    monkeypatch.setattr(KeptWeights, "put", counting_put)
    monkeypatch.setattr(KeptWeights, "take", counting_take)
    return counts


@pytest.mark.parametrize("compute_dtype,mode", [(torch.bfloat16, "offload"), (torch.bfloat16, "recompute"),
                                                (torch.float32, "offload")], ids=["bf16-offload", "bf16-recompute",
                                                                                  "fp32-offload"])
def test_recompute_keeps_nf4_weights_bitwise(tmp_path, monkeypatch, kept_counts, mode, compute_dtype):
    tiny_model("llama", dtype=torch.bfloat16, seed=4, **SHAPE).save_pretrained(tmp_path)
    batches = [make_batch(SHAPE["vocab_size"], seq=24, seed=s) for s in (5, 6)]
    runs = {}
    for name, config in (("unchecked", FastConfig(**LORA_ONLY)), ("kept", FastConfig(checkpointing=mode, **LORA_ONLY)),
                         ("off", FastConfig(checkpointing=mode, keep_recomputed_nf4=False, **LORA_ONLY))):
        model = qlora(str(tmp_path), compute_dtype)
        qs = model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight.quant_state
        assert qs.dtype == torch.bfloat16 and qs.nested
        report = patch_model(model, config)
        assert not [f for f in report.fallbacks if f.op.startswith("lora")], str(report)
        spy = count_fused_lora(monkeypatch)
        before = dict(kept_counts)
        runs[name] = sgd_steps(model, batches)
        runs[name + " counts"] = {k: kept_counts[k] - before[k] for k in kept_counts}
        # Each forward: lora_qkv, lora_o and lora_mlp per layer; a recompute runs them again.
        assert sum(spy.values()) == len(batches) * 3 * N_LAYERS * (1 if name == "unchecked" else 2), spy
    keeps = compute_dtype == torch.bfloat16  # the compute dtype is the QuantState's: dX may use the forward's weight
    expected = KEPT_PER_STEP * len(batches) if keeps else 0
    assert runs["kept counts"]["put"] == expected, runs["kept counts"]
    assert runs["kept counts"]["taken"] == expected, runs["kept counts"]
    assert runs["off counts"]["put"] == runs["unchecked counts"]["put"] == 0
    assert runs["off counts"]["take"] == runs["unchecked counts"]["take"] == 0
    ref_losses, ref_grads = runs["unchecked"]
    assert len(ref_grads) == 2 * 7 * N_LAYERS
    for name in ("kept", "off"):
        losses, grads = runs[name]
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (name, losses, ref_losses)
        unequal = [n for n, g in grads.items() if not torch.equal(g, ref_grads[n])]
        assert not unequal, (name, unequal)


def test_the_first_call_is_the_forward_every_later_one_a_recompute_sharing_its_memo():
    from fasttune.kernels import kept_weights
    from fasttune.model_patches.layer_call import ForwardThenRecompute, layer_memo, recomputing

    seen = []

    def stock(x):
        memo = layer_memo()
        memo.setdefault("forward_saw", x)
        kept = kept_weights.current()
        seen.append((recomputing(), memo["forward_saw"], kept is not None and kept.recording))
        return x

    fn = ForwardThenRecompute(stock, kept=KeptWeights())
    fn(1), fn(2), fn(3)
    assert seen == [(False, 1, False), (True, 1, True), (True, 1, True)]
    assert not recomputing() and layer_memo() is None and kept_weights.current() is None
    ForwardThenRecompute(lambda: seen.append(kept_weights.current()))()  # no KeptWeights: none current
    assert seen[-1] is None
