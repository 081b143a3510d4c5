"""Evaluate while fine-tuning: ``load_model``, ``FastTrainer.evaluate`` with an ``evaluate`` metric, and generation.

    python examples/eval_example.py                                   # embedded model + task, no download
    python examples/eval_example.py --model Qwen/Qwen2.5-0.5B         # a Hub model: LoRA r=16 (add --4bit for QLoRA)

What it shows:
- ``fasttune.load_model`` loads a folder or Hub id into a patched model (+ LoRA for Hub models);
- ``FastTrainer`` trains on the fused kernels and evaluates on the stock head, so ``compute_metrics``
  gets logits. ``preprocess_logits_for_metrics`` keeps only the argmax ids, so evaluation does not
  hold [examples, seq, vocab] logits in memory;
- the metric comes from the ``evaluate`` library. By default it is ``metrics/token_accuracy.py`` next
  to this file, loaded with ``evaluate.load(<path>)``: no network needed. ``--hub-metric accuracy``
  uses the Hub's script instead (needs the network and scikit-learn); the inputs and the output
  key are the same;
- held-out exact match of greedy generations (left-padded batches through ``generate``, on the
  patched model) before and after training.

The embedded model is random-init, so it is fully fine-tuned (as in quickstart.py); Hub models get
LoRA adapters.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

METRIC_SCRIPT = Path(__file__).resolve().parent / "metrics" / "token_accuracy.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded model)")
    p.add_argument("--4bit", dest="load_in_4bit", action="store_true", help="NF4 base weights (QLoRA)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-size", type=int, default=128)
    p.add_argument("--eval-steps", type=int, default=100)
    p.add_argument("--hub-metric", default=None, help="an `evaluate` Hub metric id instead of the local script")
    p.add_argument("--output-dir", default="outputs/eval_example")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def argmax_logits(logits, labels):
    """Keep [batch, seq] token ids instead of [batch, seq, vocab] logits between eval batches."""
    if isinstance(logits, tuple):  # some models return (logits, cache, ...)
        logits = logits[0]
    return logits.argmax(dim=-1)


def make_compute_metrics(metric):
    """``compute_metrics`` for a causal LM: position t predicts token t+1; -100 labels are skipped."""

    def compute_metrics(eval_pred):
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        return metric.compute(predictions=preds[:, :-1].reshape(-1), references=labels[:, 1:].reshape(-1))

    return compute_metrics


def load(args, workdir: Path):
    """(model, tokenizer) through fasttune.load_model; the embedded model is saved to a folder first."""
    from fasttune import LoraSpec, load_model
    from fasttune import embedded

    if args.model is None:
        tok = embedded.build_tokenizer()
        embedded.build_model(tok, seed=args.seed).save_pretrained(workdir / "embedded")
        tok.save_pretrained(workdir / "embedded")
        return load_model(workdir / "embedded", dtype="float32", lora=None, max_seq_length=64)
    return load_model(args.model, load_in_4bit=args.load_in_4bit, max_seq_length=512,
                      lora=LoraSpec(r=16, alpha=16, seed=args.seed))


def run(argv=None) -> dict:
    import evaluate
    from transformers import TrainingArguments

    from fasttune import FastTrainer, embedded

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(args, Path(tmp))
    metric = evaluate.load(args.hub_metric or str(METRIC_SCRIPT), keep_in_memory=True)

    rows = embedded.make_task(args.steps * args.batch_size // 4 + args.eval_size, seed=args.seed)
    train_rows, eval_rows = rows[args.eval_size:], rows[:args.eval_size]
    gpu = torch.cuda.is_available()
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=max(args.steps // 20, 1), weight_decay=0.0, logging_steps=max(args.steps // 10, 1),
        eval_strategy="steps", eval_steps=args.eval_steps, save_strategy="no", report_to=[], use_cpu=not gpu,
        bf16=gpu and torch.cuda.is_bf16_supported(), dataloader_num_workers=0, seed=args.seed,
    )
    trainer = FastTrainer(
        model=model, args=targs, train_dataset=embedded.TaskDataset(tok, train_rows),
        eval_dataset=embedded.TaskDataset(tok, eval_rows), data_collator=embedded.PadCollator(tok.pad_token_id),
        processing_class=tok, compute_metrics=make_compute_metrics(metric),
        preprocess_logits_for_metrics=argmax_logits,
    )
    before = trainer.evaluate()
    match_before = embedded.exact_match(trainer.model, tok, eval_rows)
    trainer.train()
    after = trainer.evaluate()
    match_after = embedded.exact_match(trainer.model, tok, eval_rows)

    print(f"eval loss {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}; token accuracy "
          f"{before['eval_accuracy']:.1%} -> {after['eval_accuracy']:.1%}; generation exact match "
          f"{match_before:.1%} -> {match_after:.1%}")
    result = {"eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
              "accuracy_before": before["eval_accuracy"], "accuracy_after": after["eval_accuracy"],
              "exact_match_before": match_before, "exact_match_after": match_after,
              "patched": dict(trainer.patch_report.patched)}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_metrics.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run()
