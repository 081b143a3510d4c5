"""Exports of a model trained with FP8 bases merge onto the original 16-bit weights, never the FP8 copy.

A tiny Llama saved with save_pretrained is loaded with ``load_in_fp8=True`` (and from NF4 with
``load_in_4bit=True`` too), its adapters given random B. ``save_merged(model, out)`` and
``save_gguf(model, ...)`` must equal PEFT's own merge of the same adapters onto the checkpoint's
16-bit tensors (fp32: the same float32 operations), and must differ from a merge onto the
dequantised FP8 codes. A model built from a config (no checkpoint) is refused with a clear error
unless ``base=`` names the 16-bit checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from fasttune import FastConfig, LoraSpec, load_model, patch_model
from fasttune.export.merged import save_merged
from fasttune.model_patches.fp8_base import fp8_weight_of, is_fp8_layer
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer

SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama16")
    tiny_model("llama", seed=3, **SIZES).save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def _randomise_b(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _peft_merge_onto_original(saved, adapter_state):
    """PEFT's merge_and_unload of the same adapters onto a fresh 16-bit load: the expected tensors."""
    ref, _ = load_model(saved, dtype="float32", lora=LoraSpec(r=4, seed=0), fast_config=FastConfig(lora=False))
    set_peft_model_state_dict(ref, adapter_state)
    return {k: v.float() for k, v in ref.merge_and_unload().state_dict().items()}


def _merged(out):
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return {k: v.float() for k, v in tensors.items()}


@pytest.mark.parametrize("nf4", [False, True])
def test_save_merged_reads_the_original_16bit_weights(saved, tmp_path, nf4):
    if nf4:
        pytest.importorskip("bitsandbytes")
    model, _ = load_model(saved, dtype="float32", load_in_4bit=nf4, load_in_fp8=True, lora=LoraSpec(r=4, seed=0))
    _randomise_b(model)
    adapter = get_peft_model_state_dict(model)
    got = _merged(save_merged(model, tmp_path / "merged", dtype="float32"))
    want = _peft_merge_onto_original(saved, adapter)
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    for key, tensor in got.items():
        assert torch.allclose(tensor, want[key], rtol=0, atol=1e-6), key
    # The FP8 copy is not what was merged: a merge onto the dequantised codes is visibly different.
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer()
    assert is_fp8_layer(layer)
    q = "model.layers.0.self_attn.q_proj.weight"
    delta = want[q] - _peft_merge_onto_original(saved, {k: torch.zeros_like(v) for k, v in adapter.items()})[q]
    onto_fp8 = fp8_weight_of(layer).dequantize() + delta
    assert (onto_fp8 - got[q]).abs().max() > 1e-3


def test_save_gguf_reads_the_original_16bit_weights(saved, tmp_path):
    gguf = pytest.importorskip("gguf")
    from fasttune.export.gguf import save_gguf

    model, tok = load_model(saved, dtype="float32", load_in_fp8=True, lora=LoraSpec(r=4, seed=0))
    _randomise_b(model)
    want = _peft_merge_onto_original(saved, get_peft_model_state_dict(model))
    (path,) = save_gguf(model, tok, tmp_path, ["f32"], name="tiny")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for gguf_name, key in (("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                           ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")):
        data = torch.from_numpy(tensors[gguf_name].data.copy()).reshape(want[key].shape)
        assert torch.allclose(data, want[key], rtol=0, atol=1e-6), gguf_name


def test_no_checkpoint_needs_base(saved, tmp_path):
    """Built from a config (nothing to read the originals from): a ValueError naming base=, and
    with base= the merge streams the given 16-bit checkpoint."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", seed=3, **SIZES)  # the weights saved in `saved`, but not loaded from there
    model.requires_grad_(False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=list(TARGETS)))  # as LoraSpec(r=4)
    report = patch_model(model, FastConfig(base_dtype="fp8"))
    assert report.patched["fp8_q_proj"] == 2
    with pytest.raises(ValueError, match="base="):
        save_merged(model, tmp_path / "nope")
    _randomise_b(model)
    got = _merged(save_merged(model, tmp_path / "merged", base=saved, dtype="float32"))
    want = _peft_merge_onto_original(saved, get_peft_model_state_dict(model))
    for key, tensor in got.items():
        assert torch.allclose(tensor, want[key], rtol=0, atol=1e-6), key


def test_fast_trainer_trains_fp8_and_exports_onto_the_original(saved, tmp_path, caplog):
    """The whole flow: FastTrainer(fast_config=FastConfig(base_dtype="fp8")) on a loaded model
    converts the bases, trains (the log names the FP8 calls), and its end-of-training merged export
    equals PEFT's merge of the trained adapters onto the checkpoint's 16-bit weights."""
    import logging

    from transformers import TrainingArguments

    from fasttune import FastTrainer
    from fasttune.embedded import PadCollator
    from helpers.train_data import random_lm_rows

    model, tok = load_model(saved, dtype="float32", lora=LoraSpec(r=4, seed=0))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    with caplog.at_level(logging.INFO, logger="fasttune"):
        trainer = FastTrainer(model=model, args=args, train_dataset=random_lm_rows(SIZES["vocab_size"], n=8),
                              data_collator=PadCollator(0), processing_class=tok,
                              fast_config=FastConfig(base_dtype="fp8", export_artifacts=("merged",)))
        assert trainer.patch_report.patched["fp8_down_proj"] == 2
        trainer.train()
    assert "stored in FP8" in caplog.text and "fp8_q_proj:" in caplog.text
    got = _merged(tmp_path / "run" / "merged")
    want = _peft_merge_onto_original(saved, get_peft_model_state_dict(model))
    for key, tensor in got.items():  # merged_dtype bfloat16: the fp32 merge cast once
        assert torch.equal(tensor, want[key].to(torch.bfloat16).float()), key
