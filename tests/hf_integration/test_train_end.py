"""The end of FastTrainer.train(): the artifacts FastConfig asks for, with cards, on the main process only."""

from types import SimpleNamespace

import torch
from peft import LoraConfig, get_peft_model

from fasttune.config import FastConfig
from fasttune.hf_integration.train_end import export_after_training
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer

VOCAB = 1000


def _lora(model, **kw):
    kw = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **kw}
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(**kw))


def test_export_after_training_local(tmp_path):
    tok = bpe_tokenizer()
    peft_model = _lora(tiny_model("llama", vocab_size=VOCAB), target_modules=["q_proj", "v_proj"])
    history = [{"loss": 2.0, "step": 1}, {"loss": 1.5, "step": 2, "tokens_per_second": 1234.5, "peak_memory_gib": 1.5},
               {"train_runtime": 3.2, "train_loss": 1.75, "step": 2}]
    trainer = SimpleNamespace(model=peft_model, processing_class=tok, args=SimpleNamespace(output_dir=str(tmp_path)),
                              state=SimpleNamespace(global_step=2, log_history=history),
                              is_world_process_zero=lambda: True)
    cfg = FastConfig(export_artifacts=("adapter", "merged"), hub_model_id="me/run", merged_dtype="float32")
    result = export_after_training(trainer, cfg)
    assert set(result["folders"]) == {"adapter", "merged"} and result["urls"] == {}
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "library_name: transformers" in card and "me/run-lora" in card and "| 2 | 1.5 | 1,234 | 1.5 | 3.2 |" in card
    assert "| LoRA rank (r) | 4 |" in card and "| License | unknown — check the base model's license |" in card
    # without a hub_model_id the cards are written all the same, naming placeholders
    cfg = FastConfig(export_artifacts=("adapter",))
    export_after_training(trainer, cfg)
    adapter_card = (tmp_path / "adapter" / "README.md").read_text()
    assert f"your-hf-username/{tmp_path.name}-lora" in adapter_card and "Not on the Hub yet" in adapter_card
    assert "[More Information Needed]" not in adapter_card  # PEFT's stub card is replaced
    trainer.is_world_process_zero = lambda: False
    assert export_after_training(trainer, cfg) is None
    assert export_after_training(SimpleNamespace(is_world_process_zero=lambda: True), FastConfig()) is None
