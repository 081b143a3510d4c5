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
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer
from helpers.nf4_moe import ATTENTION, EXPERT_PARAMS, SHAPES, dequantised_stock, load_4bit, nf4_weights

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _pair(model_type, path, dequantise=True):
    """(stock with the dequantised experts — or the original ones, as loaded, with ``dequantise``
    False —, fasttune with NF4 experts), LoRA on attention and experts."""
    base = load_4bit(model_type, path, "cpu", double_quant=True)
    stock = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION,
                                            target_parameters=EXPERT_PARAMS, init_lora_weights=False))
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["moe_nf4"] == 1, str(report)
    if dequantise:
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


def test_merge_onto_the_16_bit_original(tmp_path):
    """``save_merged(base=<a 16-bit checkpoint>)``: the LoRA delta goes onto the original experts read
    from the checkpoint (not onto their NF4 values), as for a stock model holding them. (The base is
    written with the stacked expert keys: transformers 5's save_pretrained writes Qwen3-MoE experts
    per expert, which ``base=`` merging of LoRA on the experts does not read, NF4 or not.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    stock, fast = _pair("qwen3_moe", tmp_path / "base", dequantise=False)  # stock: experts as loaded (fp32)
    source = tmp_path / "stacked"
    source.mkdir()
    shutil.copy(tmp_path / "base" / "config.json", source / "config.json")
    dense = tiny_model("qwen3_moe", seed=8, **SHAPES["qwen3_moe"])  # load_4bit's weights
    original = {k: v.contiguous() for k, v in dense.state_dict().items()}
    save_file(original, str(source / "model.safetensors"), metadata={"format": "pt"})
    tensors = {}
    for name, model in (("stock", stock), ("fast", fast)):
        out = save_merged(model, tmp_path / name, base=source, dtype="float32")
        tensors[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert tensors["fast"].keys() == tensors["stock"].keys()
    for key, value in tensors["fast"].items():
        assert torch.equal(value, tensors["stock"][key]), key
    # the same LoRA delta as on the NF4 values (save_merged without base), on top of the original
    key = "model.layers.0.mlp.experts.gate_up_proj"
    nf4 = nf4_weights(fast)["base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"]
    on_nf4 = load_file(save_merged(fast, tmp_path / "on_nf4", dtype="float32") / "model.safetensors")[key]
    delta = on_nf4 - nf4.dequantize()
    assert delta.abs().max() > 1e-3 and not torch.equal(tensors["fast"][key], on_nf4)
    torch.testing.assert_close(tensors["fast"][key] - original[key], delta, rtol=0, atol=1e-6)


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
