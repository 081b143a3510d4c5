"""Generation speed of a patched model vs the same model stock, Llama-3.1-8B shape (H200).

Inference must not get slower on fasttune's path: in eval mode the head is stock, while RMSNorm,
RoPE, the gated MLP (and, with ``--lora``/``--nf4``, the fused LoRA projections) run fasttune's
kernels. Decode steps at batch 1 are launch-bound, so this is where a kernel with a slow launch
or a fused path that is slower on one-token inputs would show.

Workload: random-init bf16 model (sdpa attention), prompts of 512 tokens (batch > 1: lengths
512, 384, 256, ... left padded), greedy ``generate`` with the KV cache, exactly ``--new-tokens``
new tokens per row. Timed: the whole ``generate`` call (prefill + decode), after one warm-up call
per configuration (Triton compilation), median of ``--repeats`` calls, stock and patched calls
alternating on the same model instance (``patch_model`` / ``unpatch_model``) so drift and
clocks hit both alike. Reported: new tokens/s, prefill share, the patched/stock ratio, and
whether the greedy tokens agree (bf16: a few may diverge late from rounding; logged, not judged).

Usage (H200, repo root):
    python benchmarks/bench_generate.py [--layers 32] [--batches 1,8] [--new-tokens 128] [--lora] [--nf4]
        [--out FILE.json]                                        # ~2-4 minutes for the default
    python -m pytest benchmarks/bench_generate.py -m gpu -q      # the no-regression check (~1-2 minutes)
The check: patched tokens/s ≥ 0.95 × stock (run-to-run noise on this machine is 2–5%:
docs/FACTS.md, Measuring on the GPU) at batch 1 and 8, plain bf16 and bf16 + LoRA r=16 (8 layers of the 8B shape: per-layer costs are what
differ).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, use_cache=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = 512
MIN_RATIO = 0.95


def build_model(layers: int, lora: bool, nf4: bool):
    """Random-init Llama-3.1-8B-shaped model on the GPU in bf16 (optionally NF4 decoder linears, LoRA r=16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**LLAMA_8B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    if nf4:
        _to_nf4(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                                 task_type="CAUSAL_LM", init_lora_weights=False))
    return model.eval()


def _to_nf4(model) -> None:
    """Each decoder nn.Linear → bitsandbytes NF4 Linear4bit quantised from its weight (bench_step's builder)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_step import to_nf4 as quantise

    quantise(model)


def prompts(batch: int, vocab: int, seed: int = 0):
    """``batch`` prompts of 512, 384, 256, ... tokens (at least 64), left padded to 512 (PROMPT)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(batch):
        n = max(PROMPT - 128 * row, PROMPT // 8)
        ids[row, PROMPT - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, PROMPT - n:] = 1
    return ids.cuda(), mask.cuda()


@torch.no_grad()
def timed_generate(model, ids, mask, new_tokens: int):
    """(seconds, sequences) of one greedy generate call with the KV cache."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, use_cache=True, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


@torch.no_grad()
def prefill_seconds(model, ids, mask) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, use_cache=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def compare(model, batch: int, new_tokens: int, repeats: int) -> dict:
    """Stock vs patched generate on the same instance, alternating; one warm-up call each."""
    from fasttune import FastConfig, patch_model, unpatch_model

    ids, mask = prompts(batch, LLAMA_8B["vocab_size"])
    times = {"stock": [], "fasttune": []}
    seqs, prefill = {}, {}
    for i in range(repeats + 1):
        # Alternate which path goes first: host-bound decode drifts within a run (RESULTS.md, Generation).
        for stack in (("stock", "fasttune") if i % 2 == 0 else ("fasttune", "stock")):
            if stack == "fasttune":
                report = patch_model(model, FastConfig())
            seconds, out = timed_generate(model, ids, mask, new_tokens)
            if i == 0:
                prefill[stack] = prefill_seconds(model, ids, mask)
                seqs[stack] = out
            else:
                times[stack].append(seconds)
            if stack == "fasttune":
                unpatch_model(model)
    tokens = batch * new_tokens
    row = {"batch": batch, "new_tokens": new_tokens, "patched": dict(report.patched),
           "fallbacks": len(report.fallbacks)}
    for stack, ts in times.items():
        row[f"{stack}_tok_s"] = round(tokens / statistics.median(ts), 1)
        row[f"{stack}_prefill_ms"] = round(prefill[stack] * 1e3, 2)
    row["ratio"] = round(row["fasttune_tok_s"] / row["stock_tok_s"], 3)
    generated = slice(ids.shape[1], None)
    row["greedy_token_agreement"] = float((seqs["stock"][:, generated] == seqs["fasttune"][:, generated])
                                          .float().mean())
    return row


def run(layers: int, batches, new_tokens: int, repeats: int, lora: bool, nf4: bool) -> list[dict]:
    model = build_model(layers, lora=lora, nf4=nf4)
    rows = []
    for batch in batches:
        row = {"layers": layers, "lora": lora, "nf4": nf4, **compare(model, batch, new_tokens, repeats)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
@pytest.mark.parametrize("lora", [False, True], ids=["bf16", "bf16+lora"])
def test_generate_tokens_per_second_no_regression(lora):
    rows = run(layers=8, batches=(1, 8), new_tokens=64, repeats=3, lora=lora, nf4=False)
    for row in rows:
        assert row["fallbacks"] == 0, row
        assert row["ratio"] >= MIN_RATIO, f"patched generation slower than stock: {row}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--nf4", action="store_true", help="NF4 decoder linears (bitsandbytes); with --lora: QLoRA")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU")
    rows = run(args.layers, [int(b) for b in args.batches.split(",")], args.new_tokens, args.repeats,
               lora=args.lora, nf4=args.nf4)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
