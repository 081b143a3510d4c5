"""QLoRA MoE fixtures: tiny MoE models loaded in 4-bit by bitsandbytes, and the stock oracle whose
expert parameters hold the dequantised NF4 values of a fasttune model (tests/model_patches/test_moe_nf4.py,
tests/export/test_nf4_experts_export.py)."""

from __future__ import annotations

import copy
import math

import torch

from fasttune.kernels.nf4_weight import NF4Weight
from helpers.tiny_models import tiny_model

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# one MoE layer each (qwen3_moe's second layer is dense); hidden 128 for bitsandbytes' CPU path
SHAPES = {
    # The dense MLP layer's width a multiple of 32 too: on CPUs with AVX512-BF16, bitsandbytes repacks a
    # Linear4bit's weight for its CPU kernel at the first eval forward and asserts out_features % 32 == 0.
    "qwen3_moe": dict(hidden_size=128, head_dim=32, intermediate_size=256),
    "gpt_oss": dict(hidden_size=128, head_dim=32, num_hidden_layers=1, layer_types=["sliding_attention"]),
    # qwen2_moe: the shared expert (a 4-bit Linear) 64 wide, its gate a 4-bit Linear(128, 1); the second layer dense
    "qwen2_moe": dict(hidden_size=128, head_dim=32, intermediate_size=256, shared_expert_intermediate_size=64),
    "mixtral": dict(hidden_size=128, head_dim=32, num_hidden_layers=1),
}


def load_4bit(model_type: str, path, device, double_quant=False, seed=8, quant_type="nf4", **overrides):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model(model_type, seed=seed, **{**SHAPES[model_type], **overrides}).save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_use_double_quant=double_quant)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32,
                                                attn_implementation="eager", device_map=device)


def nf4_weights(model) -> dict[str, NF4Weight]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NF4Weight)}


def dequantised_stock(stock, fast) -> None:
    """Give the stock model's expert parameters the values the fast model's NF4 experts hold: its
    own dense weights through bitsandbytes' ``quantize_4bit`` and ``dequantize_4bit`` (the fast
    model was a copy of it), after checking that the fast model holds those very codes."""
    import bitsandbytes.functional as bnb_f

    held = nf4_weights(fast)
    assert held
    for name, w in held.items():
        dense = stock.get_parameter(name)
        packed, state = bnb_f.quantize_4bit(dense.detach(), blocksize=w.blocksize, compress_statistics=w.nested,
                                            quant_type="nf4")
        assert torch.equal(packed.reshape(-1), w.packed)
        flat = copy.copy(state)
        flat.shape = torch.Size([math.prod(state.shape)])  # bitsandbytes' CPU path wants 2-D at most
        with torch.no_grad():
            dense.copy_(bnb_f.dequantize_4bit(packed, flat).reshape(state.shape))
        assert torch.equal(dense, w.dequantize())
