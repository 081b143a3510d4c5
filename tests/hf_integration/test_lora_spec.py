"""LoraSpec's tower switches on vision-language models, and load_model for them.

The targets are checked on real PEFT models: exactly the linear layers of the selected towers get
adapters (the vision tower's own q/k/v-like and MLP layers only with ``finetune_vision_layers``), and
the regex never matches a non-linear module that shares a path shape (Qwen's merger ``mlp.1`` is a
GELU between ``mlp.0`` and ``mlp.2``). ``load_model`` loads a saved tiny Gemma 3 (weights, config and
processor) as ``(PeftModel, processor)``, patched, LoRA on the language tower on the fused path.
"""

from __future__ import annotations

import re

import pytest
import torch
from peft import get_peft_model

from fasttune import LoraSpec, load_model, patch_report
from fasttune.hf_integration.lora_spec import target_modules_for
from helpers.tiny_models import tiny_model
from helpers.tiny_vlms import processor_token_ids, tiny_vlm, vlm_processor

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _adapted(model) -> set[str]:
    return {name for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def test_switches_are_checked():
    with pytest.raises(ValueError, match="finetune_vision_layers"):
        LoraSpec(finetune_vision_layers="yes")
    with pytest.raises(ValueError, match="both False"):
        LoraSpec(finetune_language_layers=False, finetune_vision_layers=False)
    with pytest.raises(ValueError, match="text model"):
        target_modules_for(LoraSpec(finetune_vision_layers=True), tiny_model("llama", vocab_size=300))
    assert target_modules_for(LoraSpec(), tiny_model("llama", vocab_size=300)) == "all-linear"


def test_language_tower_only_by_default():
    model = tiny_vlm("qwen2_5_vl")
    targets = target_modules_for(LoraSpec(), model)
    assert targets.startswith("^(?:") and "\\d+" in targets
    adapted = _adapted(get_peft_model(model, LoraSpec().to_peft_config(model)))
    assert adapted and all(".language_model." in n for n in adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == PROJECTIONS
    assert len(adapted) == 2 * len(PROJECTIONS)  # two layers


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_vision_tower_too(model_type):
    model = tiny_vlm(model_type)
    spec = LoraSpec(finetune_vision_layers=True)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    adapted = _adapted(get_peft_model(model, spec.to_peft_config(model)))
    assert {n.removeprefix("base_model.model.") for n in adapted} == linears
    tower = "visual" if model_type == "qwen2_5_vl" else "vision_tower"
    assert any(f".{tower}." in n for n in adapted)
    if model_type == "qwen2_5_vl":  # the merger's GELU sits between its two linears, path-alike
        assert {n.rsplit(".", 1)[-1] for n in adapted if ".merger." in n} == {"0", "2"}


def test_named_targets_and_vision_only():
    model = tiny_vlm("qwen2_5_vl")
    targets = target_modules_for(LoraSpec(target_modules=("q_proj", "qkv"), finetune_vision_layers=True), model)
    names = [n for n, _ in model.named_modules() if re.fullmatch(targets, n)]
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "qkv"} and len(names) == 4
    only_vision = LoraSpec(finetune_language_layers=False, finetune_vision_layers=True)
    names = [n for n, _ in model.named_modules() if re.fullmatch(target_modules_for(only_vision, model), n)]
    assert names and all(n.startswith("model.visual.") for n in names)
    with pytest.raises(ValueError, match="no linear layer"):
        target_modules_for(LoraSpec(target_modules=("nope",)), model)


def test_load_model_gives_the_model_and_its_processor(tmp_path):
    processor = vlm_processor("gemma3")
    tiny_vlm("gemma3", seed=3, token_ids=processor_token_ids("gemma3", processor)).save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    model, loaded = load_model(str(tmp_path), dtype="float32", max_seq_length=128, lora=LoraSpec(r=4, seed=0))
    assert type(loaded).__name__ == "Gemma3Processor" and loaded.tokenizer.model_max_length == 128
    assert type(model.get_base_model()).__name__ == "Gemma3ForConditionalGeneration"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in n and "lora_" in n for n in trainable)
    report = patch_report(model)
    assert report.patched["lora_qkv"] == report.patched["lora_mlp"] == 2, str(report)
    assert [fb.op for fb in report.fallbacks] == ["vision_tower"], str(report)
