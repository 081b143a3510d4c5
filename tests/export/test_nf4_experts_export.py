"""Export of a QLoRA MoE model whose stacked experts fasttune holds in NF4 (``moe_experts_nf4``).

The merged 16-bit checkpoint and the GGUF file of the NF4-expert model equal, tensor for tensor,
those of the stock model whose expert parameters hold the dequantised NF4 values (LoRA on the
experts merged in), and the merged checkpoint loads in stock transformers with no missing or
unexpected key (no NF4 buffers leak into it).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model
from fasttune.export.gguf import save_gguf
from fasttune.export.merged import save_merged
from helpers.tiny_tokenizers import bpe_tokenizer
from helpers.nf4_moe import ATTENTION, EXPERT_PARAMS, dequantised_stock, load_4bit, nf4_weights

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _pair(model_type, path):
    """(stock with the dequantised experts, fasttune with NF4 experts), LoRA on attention and experts."""
    base = load_4bit(model_type, path, "cpu", double_quant=True)
    stock = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION,
                                            target_parameters=EXPERT_PARAMS, init_lora_weights=False))
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["moe_nf4"] == 1, str(report)
    dequantised_stock(stock, fast)
    return stock, fast


def test_merged_checkpoint_equals_the_dequantised_stock_merge(tmp_path):
    from transformers import AutoModelForCausalLM

    stock, fast = _pair("qwen3_moe", tmp_path / "base")
    loaded = {}
    for name, model in (("stock", stock), ("fast", fast)):
        out = save_merged(model, tmp_path / name, dtype="float32")
        loaded[name], info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    a, b = loaded["fast"].state_dict(), loaded["stock"].state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the experts carry the LoRA delta on top of the dequantised NF4 values
    name = "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"
    dequantised = nf4_weights(fast)[name].dequantize()
    assert not torch.equal(a["model.layers.0.mlp.experts.gate_up_proj"], dequantised)


def test_gguf_equals_the_dequantised_stock_export(tmp_path):
    """Mixtral (llama.cpp's ``llama`` with expert tensors): qwen3moe in llama.cpp wants MoE in every layer."""
    gguf = pytest.importorskip("gguf")
    stock, fast = _pair("mixtral", tmp_path / "base")
    tensors = {}
    for name, model in (("stock", stock), ("fast", fast)):
        path = save_gguf(model, bpe_tokenizer(), tmp_path / name, ["f32"], name="tiny")[0]
        tensors[name] = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    assert tensors["fast"].keys() == tensors["stock"].keys()
    assert "blk.0.ffn_gate_exps.weight" in tensors["fast"]
    for key, value in tensors["fast"].items():
        assert np.array_equal(value, tensors["stock"][key]), key
