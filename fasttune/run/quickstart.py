"""The main job on the embedded default: fine-tune with FastTrainer and show it learning.

``python examples/quickstart.py`` (or ``fasttune quickstart``) builds the embedded model,
tokenizer and task (``fasttune.embedded``), measures held-out exact match, trains with
``FastTrainer`` (a progress bar, the loss logged as it falls), measures again and saves the model
under ``outputs/quickstart``. ``--model``/``--dataset`` take a Hub model id and a dataset with
prompt/completion columns instead (LoRA r=16 on a Hub model).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from .. import embedded
from ..config import FastConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fasttune quickstart", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hub id or local path (default: the embedded model)")
    p.add_argument("--dataset", default=None, help="Hub dataset id or local json/csv with prompt/completion")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--completion-column", default="completion")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-size", type=int, default=200, help="held-out rows for exact match")
    p.add_argument("--output-dir", default="outputs/quickstart")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _load(args):
    """(model, tokenizer, train_rows, eval_rows, lora) for the embedded default or a Hub model/dataset."""
    if args.model is None:
        tok = embedded.build_tokenizer()
        model = embedded.build_model(tok, seed=args.seed)
        lora = False
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        dtype = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        lora = True
    if args.dataset is None:  # held-out words are ones the training rows never contain
        train = embedded.make_task(max(args.steps * args.batch_size // 4, 1), seed=args.seed)
        return model, tok, train, embedded.held_out_task(train, args.eval_size, seed=args.seed + 10_000), lora
    from datasets import load_dataset

    path = Path(args.dataset)
    ds = (load_dataset(path.suffix.lstrip("."), data_files=str(path))["train"] if path.exists()
          else load_dataset(args.dataset, split="train"))
    rows = [{"prompt": r[args.prompt_column], "completion": r[args.completion_column]} for r in ds]
    return model, tok, rows[args.eval_size:], rows[:args.eval_size], lora


def _describe(score: float, n: int, dataset) -> str:
    if dataset is None:
        return embedded.describe_exact_match(score, n)
    return (f"held-out exact match {score:.1%}: the share of the first {n} rows whose completion the model "
            f"generates exactly")


def run(argv=None) -> dict:
    """Run the quickstart; returns the metrics it also writes to ``<output-dir>/metrics.json``."""
    from transformers import TrainingArguments

    from ..hf_integration.trainer import FastTrainer

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    model, tok, train_rows, eval_rows, lora = _load(args)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    before = embedded.exact_match(model, tok, eval_rows)
    print(f"before training: {_describe(before, len(eval_rows), args.dataset)}")

    out = Path(args.output_dir)
    targs = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(args.steps // 20, 1),
        weight_decay=0.0, logging_steps=max(args.steps // 20, 1), save_strategy="no", report_to=[],
        use_cpu=device == "cpu", bf16=device == "cuda" and torch.cuda.is_bf16_supported(),
        dataloader_num_workers=0, seed=args.seed, disable_tqdm=False,
    )
    trainer = FastTrainer(
        model=model, args=targs, train_dataset=embedded.TaskDataset(tok, train_rows),
        data_collator=embedded.PadCollator(tok.pad_token_id), processing_class=tok, fast_config=FastConfig(),
    )
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    after = embedded.exact_match(model, tok, eval_rows)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {seconds:.0f} s ({result.global_step} steps); "
          f"held-out exact match {before:.1%} -> {after:.1%}")
    print(f"after training: {_describe(after, len(eval_rows), args.dataset)}")

    final = out / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    metrics = {"exact_match_before": before, "exact_match_after": after, "first_loss": losses[0],
               "last_loss": losses[-1], "train_seconds": round(seconds, 1), "steps": result.global_step,
               "patched": dict(trainer.patch_report.patched)}
    os.makedirs(out, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"saved to {final}")
    return metrics


def main(argv=None) -> int:
    run(argv)
    return 0
