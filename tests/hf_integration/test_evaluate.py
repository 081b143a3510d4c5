"""FastTrainer.evaluate / predict with ``compute_metrics`` built on the ``evaluate`` library.

The metric is ``examples/metrics/token_accuracy.py`` loaded with ``evaluate.load(<local script>)``:
the Hub metrics (``evaluate.load("accuracy")``, ``"exact_match"``) are scripts downloaded from the
Hub, so they fail offline (checked: FileNotFoundError with HF_HUB_OFFLINE=1 and an empty cache),
and "accuracy" also needs scikit-learn. The local script has the same inputs and output key.

In eval mode the patched causal-LM forward takes the stock head, so logits come back (for
``compute_metrics``) and the eval loss is the stock loss over patched norms/RoPE/MLP: equal to a
stock Trainer's within fp32 rounding (≤ 1e-5 relative), and equal to the fused kernel's
training-mode loss on the same batch.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

from fasttune import FastConfig, FastTrainer
from fasttune.embedded import PadCollator
from helpers.compare import rel_err
from helpers.tiny_models import tiny_model
from helpers.train_data import random_lm_rows

evaluate = pytest.importorskip("evaluate")

METRIC_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "metrics" / "token_accuracy.py"
VOCAB = 1000


@pytest.fixture(scope="module")
def metric(tmp_path_factory):
    """The token-accuracy metric, loaded from the local script (its importable copy goes to a tmp dir)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluate.config, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules")))
        return evaluate.load(str(METRIC_SCRIPT), keep_in_memory=True)


def argmax_logits(logits, labels):
    """preprocess_logits_for_metrics: keep [batch, seq] token ids, not [batch, seq, vocab] logits."""
    return logits.argmax(dim=-1)


def metrics_fn(metric):
    def compute_metrics(eval_pred):
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        # Position t predicts token t+1 (the shift the loss applies).
        return metric.compute(predictions=preds[:, :-1].reshape(-1), references=labels[:, 1:].reshape(-1))

    return compute_metrics


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[],
                             use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True,
                             save_strategy="no", **kw)


def _model(kind: str):
    model = tiny_model("llama", seed=2, vocab_size=VOCAB)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False, task_type="CAUSAL_LM"))
    return model


@torch.no_grad()
def greedy_rows(model, prompt_lengths=(3, 5), per_length: int = 4, new_tokens: int = 5, seed: int = 0):
    """Rows whose completions are the model's own greedy continuations of random prompts (prompts
    masked out of the labels): a correctly shifted token accuracy of this model is then ~1, a
    mis-shifted one ~0, so the metric's wiring is checked, not just its existence."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    was_training = model.training
    model.eval()
    for n in prompt_lengths:
        prompts = torch.randint(3, VOCAB, (per_length, n), generator=g)
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        for seq in out.tolist():
            rows.append({"input_ids": seq, "attention_mask": [1] * len(seq), "labels": [-100] * n + seq[n:]})
    model.train(was_training)
    return rows


def _trainers(tmp_path, kind, metric, rows=None):
    model = _model(kind)
    rows = rows if rows is not None else greedy_rows(model)
    common = dict(eval_dataset=rows, data_collator=PadCollator(0), compute_metrics=metrics_fn(metric),
                  preprocess_logits_for_metrics=argmax_logits)
    stock = Trainer(model=copy.deepcopy(model), args=_args(tmp_path / "stock"), **common)
    fast = FastTrainer(model=model, args=_args(tmp_path / "fast"), fast_config=FastConfig(), **common)
    assert fast.patch_report.patched["cross_entropy"] == 1 and fast.patch_report.patched["rope"] == 2
    return stock, fast, rows


def _manual_accuracy(preds: np.ndarray, labels: np.ndarray) -> float:
    p, y = preds[:, :-1], labels[:, 1:]
    keep = y != -100
    return float((p[keep] == y[keep]).mean())


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_evaluate_and_predict_with_an_evaluate_metric(tmp_path, metric, kind):
    stock, fast, rows = _trainers(tmp_path, kind, metric)
    got, ref = fast.evaluate(), stock.evaluate()
    assert rel_err(torch.tensor(got["eval_loss"]), torch.tensor(ref["eval_loss"])) <= 1e-5, (got, ref)

    pred = fast.predict(rows)
    assert pred.predictions.shape == pred.label_ids.shape  # argmax ids per position
    n_scored = int((pred.label_ids[:, 1:] != -100).sum())
    # The metric sees the shifted predictions: the model's own greedy continuations score ~1 (one
    # token may flip on an fp32 near-tie between the cached and the full forward), the same as a
    # count done by hand, and the same as the stock run's.
    assert ref["eval_accuracy"] >= 1.0 - 1.0 / n_scored - 1e-9, ref
    assert abs(got["eval_accuracy"] - ref["eval_accuracy"]) <= 1.0 / n_scored
    assert pred.metrics["test_accuracy"] == pytest.approx(_manual_accuracy(pred.predictions, pred.label_ids))
    assert pred.metrics["test_loss"] == pytest.approx(got["eval_loss"], rel=1e-6)
    # Evaluation leaves the patches on (the next training step runs fused again).
    from fasttune.model_patches.head import head_forward
    from fasttune.model_patches import find_causal_lm

    assert head_forward(find_causal_lm(fast.model)) is not None


def test_prediction_step_returns_logits_and_the_stock_loss(tmp_path, metric):
    rows = random_lm_rows(VOCAB, n=4, seed=6)
    stock, fast, _ = _trainers(tmp_path, "full", metric, rows)
    inputs = PadCollator(0)(rows)
    # evaluation_loop puts the model in eval mode before it calls prediction_step; in training
    # mode the patched head would take the fused loss and return no logits.
    fast.model.eval(), stock.model.eval()
    for prediction_loss_only in (False, True):
        loss_f, logits_f, labels_f = fast.prediction_step(fast.model, dict(inputs), prediction_loss_only)
        loss_s, logits_s, _ = stock.prediction_step(stock.model, dict(inputs), prediction_loss_only)
        assert rel_err(loss_f, loss_s) <= 1e-6
        if prediction_loss_only:
            assert logits_f is None
        else:
            assert logits_f.shape == (*inputs["input_ids"].shape, VOCAB)
            assert rel_err(logits_f, logits_s) <= 1e-5
            assert torch.equal(labels_f.cpu(), inputs["labels"])


def test_fused_training_loss_equals_eval_loss(device):
    """The fused kernel's loss (training mode, no logits) equals the eval-mode and the stock loss."""
    stock = tiny_model("llama", seed=3, vocab_size=VOCAB).to(device)
    fast = copy.deepcopy(stock)
    from fasttune import patch_model

    patch_model(fast, FastConfig())
    batch = {k: v.to(device) for k, v in PadCollator(0)(random_lm_rows(VOCAB, n=3, seed=7)).items()}
    with torch.no_grad():
        fused = fast.train()(**batch)
        evaluated = fast.eval()(**batch)
        reference = stock.eval()(**batch)
    assert fused.logits is None and evaluated.logits is not None  # the fused path really ran in training mode
    assert rel_err(fused.loss, reference.loss) <= 1e-6
    assert rel_err(evaluated.loss, reference.loss) <= 1e-6


def test_local_metric_script_ignores_masked_positions(metric):
    out = metric.compute(predictions=[3, 5, 7, 1], references=[3, 9, -100, 1])
    assert out == {"accuracy": pytest.approx(2 / 3)}


@pytest.mark.slow  # 8–30 s on the 2 shared CPU cores: a subprocess with a short real fine-tune
def test_eval_example_runs_offline(tmp_path):
    """examples/eval_example.py on the CPU path users get (no Triton interpreter), offline."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    out = subprocess.run([sys.executable, str(root / "examples" / "eval_example.py"), "--steps", "40",
                          "--eval-steps", "20", "--eval-size", "32", "--output-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "eval_metrics.json").read_text())
    assert result["eval_loss_after"] < 0.8 * result["eval_loss_before"]
    assert result["accuracy_after"] > result["accuracy_before"]
    assert result["patched"]["cross_entropy"] == 1


@pytest.mark.parametrize("prediction_loss_only", [True, False])
def test_eval_loss_is_smoothed_as_stock(tmp_path, prediction_loss_only):
    """With label_smoothing_factor, a stock Trainer's eval_loss is the smoothed loss (its
    LabelSmoother runs in compute_loss for eval too). FastTrainer moves the smoothing into the fused
    head, which only serves training forwards: evaluation must still report the smoothed loss."""
    rows = random_lm_rows(VOCAB, n=6, seed=11)
    model = _model("full")
    args = dict(label_smoothing_factor=0.1, prediction_loss_only=prediction_loss_only)
    common = dict(eval_dataset=rows, data_collator=PadCollator(0))
    stock = Trainer(model=copy.deepcopy(model), args=_args(tmp_path / "s", **args), **common)
    fast = FastTrainer(model=copy.deepcopy(model), args=_args(tmp_path / "f", **args), **common)
    plain = Trainer(model=copy.deepcopy(model), args=_args(tmp_path / "p"), **common)
    from fasttune.model_patches.head import head_forward
    from fasttune.model_patches import find_causal_lm

    head = head_forward(find_causal_lm(fast.model))
    assert fast.label_smoother is None and head.label_smoothing == 0.1  # training: smoothing in the kernel
    got, ref, unsmoothed = fast.evaluate()["eval_loss"], stock.evaluate()["eval_loss"], plain.evaluate()["eval_loss"]
    assert abs(got - ref) <= 1e-6 * ref, (got, ref)
    assert abs(ref - unsmoothed) > 1e-3, (ref, unsmoothed)  # the smoothing is visible at this size
    assert fast.label_smoother is None and head.label_smoothing == 0.1 and not head.return_logits  # restored

