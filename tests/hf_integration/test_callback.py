"""FastPatchCallback on a stock Trainer and on TRL's SFTTrainer (metrics through the fused head)."""

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments

from fasttune import FastConfig, FastPatchCallback
from fasttune.embedded import PadCollator, build_model, build_tokenizer, make_task
from fasttune.model_patches.head import head_forward
from helpers.train_data import random_lm_rows
from helpers.tiny_models import tiny_model


def test_callback_patches_a_stock_trainer(tmp_path):
    model = tiny_model("llama")
    rows = random_lm_rows(model.config.vocab_size, n=16)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    cb = FastPatchCallback(FastConfig())
    stock = Trainer(model=copy.deepcopy(model), args=args, train_dataset=rows, data_collator=PadCollator(0))
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PadCollator(0), callbacks=[cb])
    assert cb.report is not None and cb.report.patched["cross_entropy"] == 1
    assert head_forward(trainer.model) is not None
    trainer.train(), stock.train()
    a = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    b = [h["loss"] for h in stock.state.log_history if "loss" in h]
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def _sft(tmp_path, callbacks, seed=0):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tok = build_tokenizer()
    model = build_model(tok, hidden_size=64, seed=seed)
    ds = Dataset.from_list(make_task(48, seed=seed))
    cfg = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=1e-3,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                    gradient_checkpointing=False, max_length=32, seed=seed, disable_tqdm=True,
                    dataloader_num_workers=0)
    return SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=callbacks)


@pytest.mark.slow
def test_callback_on_sft_trainer_keeps_losses_and_metrics(tmp_path):
    cb = FastPatchCallback()
    fast = _sft(tmp_path / "f", [cb])
    stock = _sft(tmp_path / "s", [])
    assert cb.report.patched["cross_entropy"] == 1
    fast.train(), stock.train()
    # TRL installs its own fused head after on_init_end; the callback puts ours back on top.
    assert head_forward(fast.model) is not None
    fa = [h for h in fast.state.log_history if "loss" in h]
    st = [h for h in stock.state.log_history if "loss" in h]
    assert len(fa) == len(st) == 3
    for x, y in zip(fa, st):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"])
        assert abs(x["entropy"] - y["entropy"]) <= 1e-4 * abs(y["entropy"])
        assert x["mean_token_accuracy"] == pytest.approx(y["mean_token_accuracy"], abs=1e-6)


def test_run_time_counts_are_logged_once_after_the_first_step(tmp_path, caplog):
    """2 steps: one log of what ran fused, after step 1; counted from train() on (not the warm-up call)."""
    import logging

    from fasttune.embedded import TaskDataset, make_task

    tok = build_tokenizer()
    model = build_model(tok, hidden_size=64)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    cb = FastPatchCallback()
    trainer = Trainer(model=model, args=args, train_dataset=TaskDataset(tok, make_task(8)),
                      data_collator=PadCollator(tok.pad_token_id), callbacks=[cb])
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 6]]))  # before training: not in the first step's counts
    caplog.set_level(logging.INFO, logger="fasttune")
    trainer.train()
    logged = [r.getMessage() for r in caplog.records if "run-time calls" in r.getMessage()]
    assert len(logged) == 1 and "cross_entropy: 1/1 calls fused" in logged[0]
    assert "rms_norm: 5/5 calls fused" in logged[0] and "ran no call fused" not in caplog.text
    assert cb.report.calls["cross_entropy", "fused"] == 2  # the counts go on after the log
