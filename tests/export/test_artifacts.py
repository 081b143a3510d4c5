"""The artifacts of a run under one folder: which repo each goes to, and what export_artifacts writes."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune.export.artifacts import export_artifacts, hub_id_or_none, hub_repos
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer


def test_each_artifact_has_its_repo():
    assert hub_repos("me/run", ("adapter", "merged", "gguf")) == {
        "adapter": "me/run-lora", "merged": "me/run", "gguf": "me/run-GGUF"}
    assert hub_repos("me/run", {"gguf": "folder"}) == {"gguf": "me/run-GGUF"}


def test_only_hub_ids_are_named_as_the_base(tmp_path):
    assert hub_id_or_none("org/model-1.5B") == "org/model-1.5B"
    assert hub_id_or_none(str(tmp_path)) is None and hub_id_or_none("relative/../x") is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert hub_id_or_none(None) is None and hub_id_or_none("") is None and hub_id_or_none("no-namespace") is None


def test_export_artifacts_writes_each_folder_and_drops_stale_gguf(tmp_path):
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama", vocab_size=1000),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    stale = tmp_path / "gguf" / "run-Q4_0.gguf"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from an earlier export")
    out = export_artifacts(model, tok, tmp_path, ("adapter", "merged", "gguf"), name="run",
                           gguf_quantizations=("f16",), merged_dtype="float32", base_model_id="org/base")
    assert out == {"adapter": tmp_path / "adapter", "merged": tmp_path / "merged", "gguf": tmp_path / "gguf"}
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "gguf").glob("*.gguf")) == ["run-F16.gguf"]
    with pytest.raises(ValueError, match="artifacts"):
        export_artifacts(model, tok, tmp_path, ("weights",), name="run")
    full = tiny_model("llama", vocab_size=1000)
    assert export_artifacts(full, tok, tmp_path / "full", ("adapter",), name="run") == {}  # no adapter to save


def test_gguf_types_of_the_same_weights_accumulate(tmp_path):
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama", vocab_size=1000),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))

    def export(quants, source):
        export_artifacts(model, tok, tmp_path, ("gguf",), name="run", gguf_quantizations=quants, source=source)
        return sorted(p.name for p in (tmp_path / "gguf").glob("*.gguf"))

    assert export(("f16",), "weights-1") == ["run-F16.gguf"]
    assert export(("q8_0", "q4_0"), "weights-1") == ["run-F16.gguf", "run-Q4_0.gguf", "run-Q8_0.gguf"]
    assert export(("q8_0",), "weights-2") == ["run-Q8_0.gguf"]  # retrained: the others are of the old weights


def test_a_tokenizer_gguf_cannot_hold_is_refused_before_any_artifact(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = get_peft_model(tiny_model("llama", vocab_size=1000),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    raw = Tokenizer(models.BPE())  # byte-level without merges: llama.cpp refuses it
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["abc"], trainer=trainers.BpeTrainer(
        vocab_size=1, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    with pytest.raises(ValueError, match="without merges"):
        export_artifacts(model, tok, tmp_path, ["adapter", "merged", "gguf"], name="x")
    assert list(tmp_path.iterdir()) == []
