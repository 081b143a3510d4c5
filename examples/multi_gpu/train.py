"""Fine-tune on several GPUs with FastTrainer through accelerate: DDP, FSDP2 or DeepSpeed ZeRO-3.

    accelerate launch --config_file examples/multi_gpu/ddp.yaml examples/multi_gpu/train.py
    accelerate launch --config_file examples/multi_gpu/fsdp2.yaml examples/multi_gpu/train.py \\
        --model Qwen/Qwen2.5-0.5B --dataset my.jsonl --export adapter merged
    accelerate launch --config_file examples/multi_gpu/fsdp2.yaml examples/multi_gpu/train.py \
        --model Qwen/Qwen2.5-0.5B --load-in-4bit                  # QLoRA: NF4 codes sharded by FSDP2
    torchrun --nproc_per_node 2 examples/multi_gpu/train.py      # DDP without an accelerate config

Without ``--model`` it trains the embedded default (a small Llama built in-process, tied
embeddings, the "shift" task: no download), in full; with a Hub id or folder it attaches LoRA
(``--full`` for full fine-tuning). ``--dataset`` takes a local .json/.jsonl/.csv or a Hub dataset
with prompt/completion columns. The global batch is ``--per-device-batch-size`` × processes; the
printed loss is averaged over every token of it, so one process with the whole batch logs the same.
On CPU (``accelerate launch --cpu`` / gloo) DDP works; FSDP and DeepSpeed need GPUs.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
from transformers import TrainingArguments

from fasttune import FastConfig, FastTrainer
from fasttune import embedded
from fasttune.hf_integration.distributed import sharding_kind


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded model)")
    p.add_argument("--dataset", default=None, help="local json/jsonl/csv or Hub id with prompt/completion columns")
    p.add_argument("--full", action="store_true", help="full fine-tuning of a --model (default: LoRA r=16)")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: a --model's linear layers in NF4 (under FSDP the codes are stored in bf16 and sharded)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--per-device-batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512, help="tokens per row (embedded task: 32)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 embedded, 2e-4 LoRA, 2e-5 full")
    p.add_argument("--checkpointing", default="offload", choices=("offload", "recompute", "auto", "none"),
                   help="fasttune's decoder-layer checkpointing (leave FSDP's own off)")
    p.add_argument("--export", nargs="*", default=[], choices=("adapter", "merged", "gguf"),
                   help="artifacts written under <output-dir> by the main process after training")
    p.add_argument("--output-dir", default="outputs/multi_gpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _encode(tok, row: dict[str, str], max_length: int) -> dict[str, list[int]]:
    """Prompt tokens masked out of the loss; the tokenizer's own BOS (if any) first, EOS last."""
    prompt = tok(row["prompt"], add_special_tokens=True)["input_ids"]
    answer = tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = (prompt + answer)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ([-100] * len(prompt) + answer)[:max_length]}


def _dataset(args, tok, max_length: int) -> list[dict[str, list[int]]]:
    if args.dataset is None:
        rows = embedded.make_task(args.steps * args.per_device_batch_size * 2, seed=args.seed)
    else:
        from datasets import load_dataset

        path = Path(args.dataset)
        ds = (load_dataset(path.suffix.lstrip("."), data_files=str(path))["train"] if path.exists()
              else load_dataset(args.dataset, split="train"))
        rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in ds]
    if args.model is None:
        return [embedded.encode(tok, r, max_length) for r in rows]
    return [_encode(tok, r, max_length) for r in rows]


def _model(args, fast: FastConfig, zero3: bool):
    """(model, tokenizer, max_length). Built after TrainingArguments: under ZeRO-3 transformers
    then partitions the weights while loading (zero.Init)."""
    if args.model is None:
        tok = embedded.build_tokenizer()
        return embedded.build_model(tok, seed=args.seed), tok, 32
    from fasttune.hf_integration.loader import LoraSpec, load_model

    # One full copy per GPU (DDP, FSDP2 before sharding); ZeRO-3 places the partitions itself.
    placement = {"device_map": None} if zero3 else {}
    model, tok = load_model(args.model, max_seq_length=args.max_length, lora=None if args.full else LoraSpec(),
                            load_in_4bit=args.load_in_4bit, fast_config=fast, **placement)
    return model, tok, args.max_length


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.load_in_4bit and (args.model is None or args.full):
        raise SystemExit("--load-in-4bit needs --model and LoRA (not --full)")
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
                        format="%(message)s")
    cuda = torch.cuda.is_available()
    fast = FastConfig(checkpointing=None if args.checkpointing == "none" else args.checkpointing,
                      export_artifacts=tuple(args.export))
    lr = args.lr or (3e-3 if args.model is None else 2e-5 if args.full else 2e-4)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.per_device_batch_size,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(args.steps // 20, 1), weight_decay=0.0,
        logging_steps=max(args.steps // 20, 1), save_strategy="no", report_to=[], seed=args.seed,
        bf16=cuda and torch.cuda.is_bf16_supported(), use_cpu=not cuda, dataloader_num_workers=0,
        average_tokens_across_devices=True,  # the loss is the mean over every token of the global batch
    )
    zero3 = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true" and \
        os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "") == "3"
    model, tok, max_length = _model(args, fast, zero3)
    trainer = FastTrainer(model=model, args=targs, train_dataset=_dataset(args, tok, max_length),
                          data_collator=embedded.PadCollator(tok.pad_token_id), processing_class=tok,
                          fast_config=fast)
    result = trainer.train()
    trainer.save_model(str(Path(args.output_dir) / "final"))  # collective: every rank gathers its shard
    if trainer.is_world_process_zero():
        tok.save_pretrained(str(Path(args.output_dir) / "final"))
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print(f"{trainer.accelerator.num_processes} process(es), {trainer.accelerator.distributed_type}, "
              f"parameters {sharding_kind(trainer.model)}; loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f} "
              f"in {result.metrics['train_runtime']:.0f} s; last tokens/s {logs[-1].get('tokens_per_second')}")
        print(trainer.patch_report)


if __name__ == "__main__":
    main()
