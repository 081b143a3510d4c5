"""Export of vision-language models: the adapter and the merged 16-bit model reload in stock
transformers as the same class (with the processor); GGUF is the language model plus an mmproj file,
or a refusal naming what llama.cpp lacks.

LoRA on both towers (``finetune_vision_layers=True``) with random B, so the merge changes vision and
language weights alike. Merged in fp32 and saved in float32: logits of the reloaded model match the
PEFT model's to 1e-5 (the merge is W + s·B·A in another summation order than PEFT's forward).
Gemma 3 runs with its in-process processor: the reloaded processor tokenizes and processes the
image, and the reloaded model computes the same logits from that.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor

from fasttune import LoraSpec, save_adapter, save_gguf, save_merged
from fasttune.hf_integration.loader import attach_lora
from helpers.compare import rel_err
from helpers.tiny_vlms import processor_token_ids, random_images, tiny_vlm, vlm_batch, vlm_processor

_MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A fox."}]}]


def _trained(model_type: str, processor=None, save_base_to=None):
    token_ids = processor_token_ids(model_type, processor) if processor is not None else None
    base = tiny_vlm(model_type, seed=2, token_ids=token_ids)
    if save_base_to is not None:  # the base as it was loaded, for the adapter
        base.save_pretrained(save_base_to)
    model = attach_lora(base, LoraSpec(r=4, seed=0, finetune_vision_layers=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model.eval()


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def test_qwen2_5_vl_adapter_and_merged_reload_as_the_same_class(tmp_path):
    model = _trained("qwen2_5_vl", save_base_to=tmp_path / "base")
    batch = vlm_batch("qwen2_5_vl", model.config, seed=3)
    batch.pop("labels")
    want = _logits(model, batch)

    save_merged(model, tmp_path / "merged", dtype="float32")
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    assert type(merged).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert rel_err(_logits(merged, batch), want) <= 1e-5

    save_adapter(model, tmp_path / "adapter")
    base = AutoModelForImageTextToText.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert rel_err(_logits(reloaded, batch), want) <= 1e-5


def test_gemma3_merged_reloads_with_its_processor(tmp_path):
    processor = vlm_processor("gemma3")
    model = _trained("gemma3", processor)
    save_merged(model, tmp_path / "merged", processor, dtype="bfloat16")
    loaded_processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    assert type(loaded_processor).__name__ == "Gemma3Processor"
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    assert next(iter(merged.parameters())).dtype == torch.float32
    # The template as text, then the processor on text and images: apply_chat_template(..., images=...) hands the
    # images to the processor twice in transformers 5.17 (a TypeError) and once in 5.24.
    prompt = loaded_processor.apply_chat_template([_MESSAGES], tokenize=False)
    batch = loaded_processor(text=prompt, images=[random_images(1, seed=7)], return_tensors="pt")
    assert (batch["input_ids"] == merged.config.image_token_id).sum() == merged.config.mm_tokens_per_image
    got, want = _logits(merged, batch), _logits(model, batch)
    assert rel_err(got, want) <= 1e-2  # saved in bf16: one bf16 rounding of every weight


def test_gguf_writes_the_language_model_and_its_mmproj(tmp_path):
    """The LoRA-trained VLM's GGUF is two files (tests/export/test_gguf_mmproj.py runs them in llama.cpp)."""
    from helpers.gguf_models import gguf_tokenizer

    model = _trained("gemma3")
    paths = save_gguf(model, gguf_tokenizer("sp"), tmp_path / "gguf", "q8_0", name="vlm")
    assert [p.name for p in paths] == ["vlm-Q8_0.gguf", "mmproj-vlm-F16.gguf"]


def test_gguf_a_config_llama_cpp_cannot_run_is_refused_naming_it(tmp_path):
    model = _trained("qwen2_5_vl")  # window_size 56: llama.cpp's Qwen2.5-VL windows are 112 pixels
    with pytest.raises(ValueError, match="mmproj GGUF.*window_size 112"):
        save_gguf(model, object(), tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()
