"""merged_weights: merged tensors computed on demand, without touching the live model."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune.export.merged_weights import checkpoint_shards, checkpoint_weights, model_weights
from helpers.tiny_models import tiny_model


def _peft(targets=("q_proj", "down_proj")):
    base = tiny_model("llama", num_hidden_layers=1, vocab_size=300)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False)
    return get_peft_model(base, cfg)


def test_entries_equal_peft_merge_and_leave_the_model_alone():
    model = _peft()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    entries, rules = model_weights(model)
    merged = {e.name: e.load() for e in entries}
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert merged[name].shape == tensor.shape
        assert torch.allclose(merged[name], tensor.float(), atol=1e-6, rtol=1e-5), name
    assert set(rules.merge) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


def test_checkpoint_shards_and_lazy_entries(tmp_path):
    base = tiny_model("llama", num_hidden_layers=2, vocab_size=300)
    base.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = checkpoint_shards(tmp_path)
    assert len(shards) > 1
    entries = {e.name: e for e in checkpoint_weights(tmp_path)}
    for name, p in base.state_dict().items():
        if name in entries:
            assert entries[name].shape == tuple(p.shape)
            assert torch.equal(entries[name].load(), p.float())


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        checkpoint_shards(tmp_path)


def test_lora_on_stacked_experts_merges_like_peft():
    """PEFT's ParamWrapper (LoRA on the experts' 3-D parameters, nested one per parameter): the
    merged tensors are PEFT's merge_and_unload ones, gpt-oss's transposed layout included."""
    for model_type in ("qwen3_moe", "gpt_oss"):
        base = tiny_model(model_type, vocab_size=300, mlp_only_layers=[])
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        model = get_peft_model(base, cfg)
        merged = {e.name: e.load() for e in model_weights(model)[0]}
        reference = copy.deepcopy(model).merge_and_unload().state_dict()
        assert set(merged) == set(reference), model_type
        for name, tensor in reference.items():
            assert torch.allclose(merged[name], tensor.float(), atol=1e-6, rtol=1e-5), (model_type, name)
        experts = [n for n in merged if "experts" in n and not n.endswith("_bias")]
        unmerged = copy.deepcopy(model).unload().state_dict()
        assert experts and all(not torch.allclose(merged[n], unmerged[n].float()) for n in experts)
