"""TRL's vision SFT path on fasttune: a ``messages`` dataset with images and the model's processor.

``FastSFTTrainer`` and ``SFTTrainer + FastPatchCallback`` against stock ``SFTTrainer`` on the same tiny
vision-language model and data (tests/_lib/helpers/tiny_vlms.py: the processor built in-process,
images generated), LoRA on the language tower, assistant-only loss (the collator's ``{% generation %}``
masks) over right-padded rows with image tokens: per step, every trainable gradient (before the
optimizer step) and the logged loss, entropy and token accuracy agree to 1e-5; fasttune's head
answered every ``fused_lm_head`` call and the fused LoRA ran (counted). SGD at lr 0.01: step 0's
gradients differ by fp32 rounding (≤ 6e-6 measured), and a larger step (0.05) amplifies that into
step 1's q/k adapter gradients (4.6e-5 measured) through Gemma's q/k-normed attention.

Gemma 3's text config carries a final soft-cap here: the stock multimodal forward ignores it, TRL's
fused head applies it, and so does fasttune's answer to TRL's calls (``HeadExtras.trl_softcap``).

Gemma 3 runs everywhere; Qwen2.5-VL's processor needs a video processor, which needs torchvision
(not in the CPU CI set): that case is skipped without it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import TrainerCallback

from fasttune import FastConfig, FastPatchCallback
from fasttune.model_patches import patch_report
from helpers.compare import rel_err
from helpers.spies import count_fused_lora
from helpers.tiny_vlms import processor_token_ids, random_images, tiny_vlm, vlm_processor

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from fasttune.hf_integration.trl import FastSFTTrainer  # noqa: E402

RTOL = 1e-5
TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MODEL_TYPES = ["gemma3", pytest.param("qwen2_5_vl", marks=pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="Qwen2-VL's processor needs torchvision"))]
# TRL's vision collator masks non-assistant tokens only with transformers >= 5.18 (it refuses before).
ASSISTANT_ONLY = Version(transformers.__version__) >= Version("5.18.0.dev0")
_ANSWERS = ["A fox.", "Paris is the capital of France.", "Numbers like 12345.", "Fine-tuning is fun and fast."]


class GradRecorder(TrainerCallback):
    """Every trainable gradient just before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad and p.grad is not None})


def _dataset():
    images = random_images(len(_ANSWERS), seed=5)
    rows = [{"images": [image],
             "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}
            for image, answer in zip(images, _ANSWERS)]
    return datasets.Dataset.from_list(rows)


def _model(model_type: str, processor):
    from peft import LoraConfig, get_peft_model

    model = tiny_vlm(model_type, seed=6, token_ids=processor_token_ids(model_type, processor))
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=TARGETS))


def _args(tmp_path, name: str):
    return trl.SFTConfig(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=2,
                         learning_rate=0.01, optim="sgd", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                         report_to=[], use_cpu=True, bf16=False, seed=0, gradient_checkpointing=False,
                         disable_tqdm=True, dataloader_num_workers=0, assistant_only_loss=ASSISTANT_ONLY,
                         max_length=None,
                         shuffle_dataset=False)


def _run(trainer_cls, model_type, tmp_path, name, **kw):
    processor = vlm_processor(model_type)
    recorder = GradRecorder()
    trainer = trainer_cls(model=_model(model_type, processor), args=_args(tmp_path, name), train_dataset=_dataset(),
                          processing_class=processor, callbacks=[recorder, *kw.pop("callbacks", [])], **kw)
    trainer.train()
    return trainer, recorder


def _assert_same_run(fast, stock, fast_rec, stock_rec):
    assert len(fast_rec.steps) == len(stock_rec.steps) == 2
    for i, (ga, gb) in enumerate(zip(fast_rec.steps, stock_rec.steps)):
        assert ga.keys() == gb.keys() and ga and all("language_model" in n for n in ga), f"step {i}"
        bad = {n: rel_err(ga[n], gb[n]) for n in gb if not rel_err(ga[n], gb[n]) <= RTOL}
        assert not bad, f"step {i}: gradients differ: {dict(list(bad.items())[:4])}"
    logs_a = [h for h in fast.state.log_history if "loss" in h]
    logs_b = [h for h in stock.state.log_history if "loss" in h]
    assert len(logs_a) == len(logs_b) == 2
    for la, lb in zip(logs_a, logs_b):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert abs(la[key] - lb[key]) <= RTOL * abs(lb[key]) + 1e-7, (key, la[key], lb[key])


@pytest.fixture(scope="module")
def stock_runs(tmp_path_factory):
    """model_type → (stock SFTTrainer, its GradRecorder): each run once for the module's tests."""
    runs = {}

    def get(model_type):
        if model_type not in runs:
            runs[model_type] = _run(trl.SFTTrainer, model_type, tmp_path_factory.mktemp("stock"), "stock")
        return runs[model_type]

    return get


@pytest.mark.slow  # two TRL runs of two steps each: ~40 s on 2 CPU cores
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fast_sft_trainer_on_images_matches_stock(model_type, tmp_path, monkeypatch, stock_runs):
    stock, stock_rec = stock_runs(model_type)
    spy = count_fused_lora(monkeypatch)
    fast, fast_rec = _run(FastSFTTrainer, model_type, tmp_path, "fast", fast_config=FastConfig())
    _assert_same_run(fast, stock, fast_rec, stock_rec)
    report = patch_report(fast.model)
    assert report.calls[("cross_entropy", "fused")] == 2, dict(report.calls)  # TRL's fused_lm_head calls
    assert spy["lora_qkv"] == spy["lora_mlp"] == 2 * 2, spy  # 2 steps × 2 layers
    assert report.calls[("rope", "fused")] == 2 * 2


@pytest.mark.slow
def test_patch_callback_on_images_matches_stock(tmp_path, monkeypatch, stock_runs):
    stock, stock_rec = stock_runs("gemma3")
    spy = count_fused_lora(monkeypatch)
    callback = FastPatchCallback()
    fast, fast_rec = _run(trl.SFTTrainer, "gemma3", tmp_path, "callback", callbacks=[callback])
    _assert_same_run(fast, stock, fast_rec, stock_rec)
    assert callback.report.calls[("cross_entropy", "fused")] == 2, dict(callback.report.calls)
    assert spy["lora_mlp"] == 2 * 2, spy
