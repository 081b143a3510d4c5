"""FastTrainer: same fp32 loss curve as a stock Trainer, label smoothing in the kernel, throughput logs."""

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fasttune import FastConfig, FastTrainer
from fasttune.embedded import PadCollator
from fasttune.config import resolve_checkpointing
from fasttune.model_patches.head import head_forward
from helpers.compare import rel_err
from helpers.train_data import random_lm_rows
from helpers.tiny_models import tiny_model


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def _losses(trainer):
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("extra", [{}, {"gradient_accumulation_steps": 2}, {"label_smoothing_factor": 0.1}],
                         ids=["plain", "grad_accum_2", "label_smoothing"])
def test_loss_curve_matches_stock_trainer(tmp_path, extra):
    model = tiny_model("llama")
    rows = random_lm_rows(model.config.vocab_size, n=40)
    collate = PadCollator(pad_token_id=0)
    stock = Trainer(model=copy.deepcopy(model), args=_args(tmp_path / "s", **extra), train_dataset=rows,
                    data_collator=collate)
    fast = FastTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "f", **extra), train_dataset=rows,
                       data_collator=collate, fast_config=FastConfig())
    assert fast.patch_report.patched["cross_entropy"] == 1
    if "label_smoothing_factor" in extra:
        assert fast.label_smoother is None and head_forward(fast.model).label_smoothing == 0.1
    a, b = _losses(fast), _losses(stock)
    assert len(a) == len(b) == 4
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(y), f"step {step}: fast {x} vs stock {y}"
    # Adam amplifies rounding-level gradient differences in near-zero entries, so compare the
    # trained weights as a whole (relative Frobenius distance), not element by element.
    pa = dict(fast.model.named_parameters())
    flat_a = torch.cat([pa[n].detach().flatten() for n, _ in stock.model.named_parameters()])
    flat_b = torch.cat([p.detach().flatten() for _, p in stock.model.named_parameters()])
    assert rel_err(flat_a, flat_b) <= 1e-5


def test_throughput_is_logged(tmp_path):
    model = tiny_model("llama")
    trainer = FastTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=random_lm_rows(
        model.config.vocab_size, n=8), data_collator=PadCollator(0))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["tokens_per_second"] > 0 for h in logged)


def test_checkpointing_flag_maps_onto_fast_config(tmp_path):
    args = _args(tmp_path, gradient_checkpointing=True)
    cfg = resolve_checkpointing(args, FastConfig())
    assert cfg.checkpointing == "offload"
    assert not args.gradient_checkpointing and not getattr(args, "activation_checkpointing", False)
    args2 = _args(tmp_path)
    assert resolve_checkpointing(args2, FastConfig()).checkpointing is None
    cfg3 = resolve_checkpointing(_args(tmp_path, gradient_checkpointing=True), FastConfig(checkpointing="recompute"))
    assert cfg3.checkpointing == "recompute"


def test_prediction_step_returns_logits_even_in_training_mode(tmp_path):
    model = tiny_model("llama")
    rows = random_lm_rows(model.config.vocab_size, n=4)
    trainer = FastTrainer(model=model, args=_args(tmp_path), train_dataset=rows, data_collator=PadCollator(0))
    batch = PadCollator(0)(rows)
    trainer.model.train()
    loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
    assert logits is not None and logits.shape[-1] == model.config.vocab_size
    assert head_forward(trainer.model).return_logits is False  # restored
    loss_only, no_logits, _ = trainer.prediction_step(trainer.model, batch, prediction_loss_only=True)
    assert no_logits is None and torch.allclose(loss_only, loss, rtol=1e-6)


def test_loader_then_trainer_log_the_patch_report_once(tmp_path, caplog):
    import logging

    from fasttune import load_model
    from fasttune.embedded import build_model, build_tokenizer

    tok = build_tokenizer()
    build_model(tok).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    caplog.set_level(logging.INFO, logger="fasttune")
    from fasttune import LoraSpec

    model, tok = load_model(str(tmp_path / "base"), lora=LoraSpec(r=4, alpha=8))
    rows = [{"input_ids": [1, 5, 6, 7], "attention_mask": [1] * 4, "labels": [1, 5, 6, 7]}] * 4
    FastTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=rows,
                data_collator=PadCollator(tok.pad_token_id)).train()
    reports = [r for r in caplog.records if r.getMessage().startswith("fasttune patch report")]
    assert len(reports) == 1, [r.getMessage() for r in reports]


def test_qlora_moe_with_nf4_experts_matches_stock_trainer_on_dequantised_experts(tmp_path):
    """A 4-bit Qwen3-MoE with LoRA on attention and the experts: FastTrainer holds the experts in NF4
    (``moe_experts_nf4="auto"``); a stock Trainer on the same model whose experts hold the dequantised
    values gives the same loss curve and the same trained adapters."""
    from peft import LoraConfig, get_peft_model

    from fasttune.model_patches.report import FUSED
    from helpers.nf4_moe import EXPERT_PARAMS, dequantised_stock, load_4bit

    base = load_4bit("qwen3_moe", tmp_path / "base", "cpu")
    stock_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  target_parameters=EXPERT_PARAMS))
    rows = random_lm_rows(stock_model.config.vocab_size, n=24)
    collate = PadCollator(pad_token_id=0)
    fast = FastTrainer(model=copy.deepcopy(stock_model), args=_args(tmp_path / "f", max_steps=3), train_dataset=rows,
                       data_collator=collate, fast_config=FastConfig())
    report = fast.patch_report
    assert report.patched["moe_nf4"] == 1 and report.patched["lora_moe"] == 1, str(report)
    dequantised_stock(stock_model, fast.model)
    stock = Trainer(model=stock_model, args=_args(tmp_path / "s", max_steps=3), train_dataset=rows,
                    data_collator=collate)
    a, b = _losses(fast), _losses(stock)
    assert len(a) == len(b) == 3 and report.calls["moe_nf4", FUSED] >= 3
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(y), f"step {step}: fast {x} vs stock {y}"
    trained = {n: p for n, p in fast.model.named_parameters() if p.requires_grad}
    flat_a = torch.cat([trained[n].detach().flatten() for n, p in stock.model.named_parameters() if p.requires_grad])
    flat_b = torch.cat([p.detach().flatten() for p in stock.model.parameters() if p.requires_grad])
    assert any("experts" in n for n in trained) and rel_err(flat_a, flat_b) <= 1e-5


@pytest.mark.parametrize("where", ["export_artifacts", "push_artifacts"])
def test_a_gguf_artifact_the_export_would_refuse_is_refused_before_training(tmp_path, where):
    model = tiny_model("ministral")  # trains on the fast path; no GGUF converter rules
    fast = (FastConfig(export_artifacts=("adapter", "gguf")) if where == "export_artifacts"
            else FastConfig(push_to_hub=True, hub_model_id="me/ministral-sft"))  # push_artifacts: all three
    rows = random_lm_rows(model.config.vocab_size, n=4)
    with pytest.raises(ValueError, match=rf"fast_config.{where} asks for a GGUF artifact.*'ministral'.*Leave 'gguf'"):
        FastTrainer(model=model, args=_args(tmp_path), train_dataset=rows, data_collator=PadCollator(0),
                    fast_config=fast)
    FastTrainer(model=tiny_model("ministral"), args=_args(tmp_path), train_dataset=rows, data_collator=PadCollator(0),
                fast_config=FastConfig(export_artifacts=("adapter", "merged")))  # the rest is fine
    FastTrainer(model=tiny_model("glm4"), args=_args(tmp_path), train_dataset=rows, data_collator=PadCollator(0),
                fast_config=FastConfig(export_artifacts=("gguf",)))  # a family llama.cpp runs
