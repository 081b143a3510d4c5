"""One LoRA training step on a Qwen3-30B-A3B (or gpt-oss-20b) shape: fasttune vs stock HF+PEFT and Unsloth (H200).

Model: random-init Qwen3-MoE with Qwen3-30B-A3B's widths (hidden 2048, 32 query / 4 KV heads of
128, 128 experts, top-8, expert intermediate 768, V = 151,936) and ``--layers`` decoder layers (48
in the real model; the per-layer work is identical, so a few layers show the ratio: the default 8
keeps the random weights ~10 GB, which Unsloth must load from a checkpoint written to
``--ckpt-dir``). ``--model gpt-oss-20b``: its widths instead (24 layers in the real model; 32 experts, top-4,
clamped SwiGLU with biases, sinks; stock runs eager attention, transformers having no SDPA path for sinks). bf16 weights, bf16 autocast, AdamW on the adapters, checkpointing on
(HF's non-reentrant for hf, fasttune's ``--checkpointing`` (offload), Unsloth's own).

LoRA r=16, alpha 16 (``--lora``):
  experts   q/k/v/o plus the experts' stacked parameters through PEFT's ``target_parameters``
            (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) — the default;
  attention q/k/v/o only, the experts frozen.

Base weights (``--weights``): ``bf16``, or ``nf4`` (QLoRA: every decoder nn.Linear becomes a
bitsandbytes NF4 ``Linear4bit`` as a 4-bit load makes it, ``bench_step.to_nf4``; the stacked experts
stay bf16 for hf and Unsloth's PEFT path as bitsandbytes leaves them, and fasttune holds them in NF4
under ``--experts-nf4 auto``, the default; ``off`` keeps them bf16 to isolate the change).

Stacks, each in its own process (``bench_step.py``'s Step/measure: median of ``--steps`` timed
steps after ``--warmup``): ``hf`` (transformers' default grouped_mm experts + PEFT), ``fasttune``
(``patch_model``; the run checks that every MoE block took the grouped path and, with ``--lora
experts``, that the adapters were fused), ``unsloth`` (``FastLanguageModel`` on the saved
checkpoint; its own MoE path). A stack that fails prints its row with the error and the others go on.

One line per stack and shape, e.g.::

    RESULT fasttune 4x2048: 12,345 tok/s, 662.1 ms/step, peak allocated 21.3 GiB, peak reserved 23.0 GiB, loss 12.02

then a table with the speed-ups over hf and unsloth.

Usage (H200, repo root, peers' wheels as for bench_step.py):
    python3 benchmarks/bench_moe_step.py --layers 8 --out $OUT/moe.json
    python3 benchmarks/bench_moe_step.py --layers 8 --lora attention --stacks hf,fasttune
    python3 benchmarks/bench_moe_step.py --layers 8 --stacks fasttune,unsloth --profile fasttune,unsloth
    python3 benchmarks/bench_moe_step.py --layers 8 --weights nf4 --stacks hf,fasttune   # QLoRA, NF4 experts
    python3 benchmarks/bench_moe_step.py --layers 8 --model gpt-oss-20b
    python3 benchmarks/bench_moe_step.py --layers 8 --stacks fasttune,unsloth --rounds 3   # alternating, median
    python3 benchmarks/bench_moe_step.py --smoke     # tiny model on CPU (interpreter) or GPU: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step as common  # noqa: E402  (imports Unsloth first in an unsloth worker; sets the smoke interpreter)

import torch  # noqa: E402
from allocator_segments import pool_peak, segment_summary  # noqa: E402 - benchmarks/ is on sys.path as the script dir

GIB = 1 << 30
HISTORY_ENTRIES = 1_000_000  # --segments history: the trace's ring buffer
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                     use_cache=False, output_router_logits=False, router_aux_loss_coef=0.001,
                     bos_token_id=1, eos_token_id=2, pad_token_id=3)
# gpt-oss-20b: 24 layers alternating 128-token sliding and full attention with sinks, 64/8 heads of 64, 32 experts,
# top-4, expert intermediate 2880, clamped SwiGLU with biases, YaRN RoPE; transformers has no SDPA path for its
# sinks, so stock runs eager attention.
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0,
                   rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                        original_max_position_embeddings=4096, rope_theta=150000.0),
                   tie_word_embeddings=False, use_cache=False, output_router_logits=False, router_aux_loss_coef=0.9,
                   pad_token_id=199999, eos_token_id=200002)
MODELS = {"qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B, "sdpa"), "gpt-oss-20b": ("gpt_oss", GPT_OSS_20B, "eager")}
SMOKE = {"qwen3-30b-a3b": dict(QWEN3_30B_A3B, vocab_size=1031, hidden_size=128, moe_intermediate_size=64,
                               num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32),
         "gpt-oss-20b": dict(GPT_OSS_20B, vocab_size=1031, hidden_size=128, intermediate_size=64, num_local_experts=8,
                             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             sliding_window=16, pad_token_id=3, eos_token_id=2)}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
STACKS = ("hf", "fasttune", "unsloth")


def shape_of(args) -> dict:
    shape = dict(SMOKE[args.model] if args.smoke else MODELS[args.model][1], num_hidden_layers=args.layers)
    if args.model == "gpt-oss-20b":
        shape["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)]
    return shape


def build(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, attention = MODELS[args.model]
    attention = args.attention or attention
    config = AutoConfig.for_model(model_type, **shape_of(args))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if common.device() == "cuda" else torch.float32
    with torch.device(common.device()):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    model.requires_grad_(False)
    return model


def lora_config(args):
    from peft import LoraConfig

    extra = dict(target_parameters=EXPERT_PARAMS) if args.lora == "experts" else {}
    return LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none", target_modules=ATTENTION,
                      task_type="CAUSAL_LM", **extra)


def prepare(stack: str, args, log):
    if stack == "unsloth":
        return prepare_unsloth(args, log)
    from peft import get_peft_model

    base = build(args)
    if args.ckpt_dir and "unsloth" in args.stacks:
        common.save_checkpoint(base, args.ckpt_dir)
    if args.weights == "nf4":
        common.to_nf4(base)
    model = get_peft_model(base, lora_config(args))
    if stack == "hf":
        common.hf_checkpointing(base)
    else:
        from fasttune import FastConfig, patch_model

        report = patch_model(model, FastConfig(checkpointing=args.checkpointing, moe_experts_nf4=args.experts_nf4,
                                               experts_stash="experts" in args.stash,
                                               attention_stash="attention" in args.stash,
                                               checkpoint_forward_graphs=args.forward_graphs or args.backward_graphs,
                                               checkpoint_backward_graphs=args.backward_graphs))
        common.release()  # the bf16 experts that NF4 replaced
        log("    " + str(report).replace("\n", "\n    "))
        want = {"moe": args.layers, **({"lora_moe": args.layers} if args.lora == "experts" else {})}
        if args.weights == "nf4" and args.experts_nf4 != "off":
            want["moe_nf4"] = args.layers
        short = {op: report.patched[op] for op, n in want.items() if report.patched[op] != n}
        if short:
            raise RuntimeError(f"MoE fast path not installed on every layer {short}: {report}")
        model._bench_report = report
    model.train()
    return model


def prepare_unsloth(args, log):
    if "UNSLOTH_IMPORT_ERROR" in vars(common):
        raise RuntimeError(f"unsloth does not import: {common.UNSLOTH_IMPORT_ERROR}")
    from unsloth import FastLanguageModel

    if not os.path.exists(os.path.join(args.ckpt_dir or "-", "config.json")):
        raise RuntimeError(f"no checkpoint at {args.ckpt_dir} (the hf or fasttune worker writes it)")
    model, _ = FastLanguageModel.from_pretrained(args.ckpt_dir, max_seq_length=max(s for _, s in args.shapes),
                                                 dtype=torch.bfloat16, load_in_4bit=args.weights == "nf4")
    kw = dict(r=16, lora_alpha=16, lora_dropout=0.0, bias="none", use_gradient_checkpointing="unsloth",
              random_state=0, target_modules=list(ATTENTION))
    if args.lora == "experts":
        try:  # newer Unsloth takes PEFT's target_parameters for stacked experts
            model = FastLanguageModel.get_peft_model(model, target_parameters=EXPERT_PARAMS, **kw)
        except TypeError as err:
            log(f"    unsloth: get_peft_model(target_parameters=...) refused ({err}); experts named as modules")
            kw["target_modules"] += ["gate_up_proj", "down_proj"]
            model = FastLanguageModel.get_peft_model(model, **kw)
    else:
        model = FastLanguageModel.get_peft_model(model, **kw)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    log(f"    unsloth: {len(trainable)} trainable tensors, {sum('expert' in n for n in trainable)} on experts")
    if hasattr(FastLanguageModel, "for_training"):
        FastLanguageModel.for_training(model)
    model.train()
    return model


def worker(stack: str, args) -> None:
    def log(msg):
        print(msg, flush=True)

    def emit(row):
        print("RESULT " + json.dumps(row), flush=True)

    try:
        model = prepare(stack, args, log)
    except Exception as err:  # noqa: BLE001 - a stack that does not run here is a row, not a crash
        for b, s in args.shapes:
            emit(dict(stack=stack, shape=f"{b}x{s}", error=f"setup: {type(err).__name__}: {err}"[:400]))
        return
    vocab = shape_of(args)["vocab_size"]
    for b, s in args.shapes:
        row = dict(stack=stack, shape=f"{b}x{s}")
        if time.time() > args.deadline_at - 10:
            emit(dict(row, error="skipped: time budget"))
            continue
        ids = torch.randint(4, vocab, (b, s), generator=torch.Generator().manual_seed(1)).to(common.device())
        step = common.Step(model, dict(input_ids=ids, labels=ids))
        try:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            warmup = args.warmup
            history = args.segments == "history" and torch.cuda.is_available()
            if history:  # every allocation with its stack, from the first warm-up step to the last timed one
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")  # no C++ symbols: fast
            if args.segments and torch.cuda.is_available():  # the warm-up here: the pools between it and the steps
                row["loss_warmup"] = [round(float(step()), 4) for _ in range(warmup)]
                torch.cuda.synchronize()
                since = len(torch.cuda.memory._snapshot()["device_traces"][0]) if history else 0
                row["reserved_after_warmup_gib"] = round(torch.cuda.memory_reserved() / GIB, 2)
                row["peak_reserved_warmup_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
                row["segments_after_warmup"] = segment_summary()
                if args.segments == "release":  # does the steps' reserve grow back? (what a leftover would not do)
                    torch.cuda.empty_cache()
                    row["reserved_after_release_gib"] = round(torch.cuda.memory_reserved() / GIB, 2)
                warmup = 0
            row.update(common.measure(step, b * s, warmup, args.steps, gc_mode=args.gc))
            if args.segments and torch.cuda.is_available():
                row["segments"] = segment_summary()
                log(f"    segments {json.dumps({k: row[k] for k in row if 'segments' in k or 'reserved' in k})}")
            if history:  # each pool's traced peak and what was alive then (the main pool's after the warm-up)
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                if len(snap["device_traces"][0]) >= HISTORY_ENTRIES:
                    row["history_truncated"] = True  # the oldest entries dropped: fewer --steps
                pools = sorted({tuple(seg.get("segment_pool_id") or (0, 0)) for seg in snap["segments"]})
                row["pool_peaks"] = [pool_peak(snap, pool, since if pool == (0, 0) else 0) for pool in pools]
                for peak in row["pool_peaks"]:
                    log(f"    pool {peak['pool']}: traced peak {peak['peak_mib']} MiB at entry {peak['at_entry']} "
                        f"of {peak['entries']}: {json.dumps(peak['live'])}")
                if args.trace_dir:
                    torch.cuda.memory._dump_snapshot(os.path.join(args.trace_dir, f"{stack}_moe_{b}x{s}_memory.pickle"))
                del snap
            if torch.cuda.is_available():
                row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
            report = getattr(model, "_bench_report", None)
            if report is not None:
                row["calls"] = {f"{op}/{outcome}"[:120]: n for (op, outcome), n in report.calls.items()
                                if op in ("moe", "lora_moe", "moe_nf4")}
                from fasttune.model_patches.checkpointing import layer_checkpointing

                ckpt = layer_checkpointing(model)
                if ckpt is not None and ckpt.stash is not None:  # cores stashed, over budget, link busy
                    row["stash"] = dataclasses.asdict(ckpt.stash.stats)
                if ckpt is not None and ckpt.graphs is not None:  # what the graphs options actually captured
                    g, bwd = ckpt.graphs, ckpt.graphs.backward
                    row["graphs"] = dict(captures=g.captures, replays=g.replays, eager=sorted(g.logged))
                    if bwd is not None:
                        row["graphs"]["backward"] = dict(captures=bwd.captures, replays=bwd.replays,
                                                         eager=sorted(bwd.logged))
                    log(f"    graphs {row['graphs']}")
            if stack in args.profile:
                row["profile"] = common.profile(step, f"{stack}_moe_{b}x{s}", args.trace_dir or None,
                                                steps=args.profile_steps)
                for out in row["profile"].splitlines()[:60]:
                    log("  " + out)
            if stack in args.host_profile:
                row["host_profile"] = common.host_profile(step, dump=os.path.join(
                    args.trace_dir, f"{stack}_moe_{b}x{s}.pstats") if args.trace_dir else None)
                log(row["host_profile"])
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            log(f"    error: {row['error']}")  # before the release below, which a broken CUDA context fails
        del step
        model.zero_grad(set_to_none=True)
        common.release()
        emit(row)


def line(r: dict) -> str:
    if "error" in r:
        return f"RESULT {r['stack']} {r['shape']}: FAILED {r['error']}"
    return (f"RESULT {r['stack']} {r['shape']}: {r['tokens_per_s']:,} tok/s, {r['ms']:.1f} ms/step, "
            f"peak allocated {r['peak_gib']} GiB, peak reserved {r.get('peak_reserved_gib', 'n/a')} GiB, "
            f"loss {r['loss_step1']}" + (f", calls {r['calls']}" if r.get("calls") else "")
            + (f", stash {r['stash']}" if r.get("stash") else "")
            + f"; steps {r.get('times_ms')}, back to back {r.get('ms_back_to_back')} ms/step {r.get('back_to_back_ms')}"
            + f", gc {r.get('gc_collections')}")


def run_stack(stack: str, args, log) -> list[dict]:
    expected = [dict(stack=stack, shape=f"{b}x{s}") for b, s in args.shapes]
    if args.deadline_at - time.time() < 30:
        return [dict(r, error="skipped: time budget") for r in expected]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", stack, "--deadline-at", str(args.deadline_at),
           "--stacks", ",".join(args.stacks), "--model", args.model, "--attention", args.attention or "", "--layers", str(args.layers), "--lora", args.lora,
           "--shapes", ",".join(f"{b}x{s}" for b, s in args.shapes), "--steps", str(args.steps), "--gc", args.gc,
           "--warmup", str(args.warmup), "--checkpointing", args.checkpointing,
           "--weights", args.weights, "--experts-nf4", args.experts_nf4,
           "--ckpt-dir", args.ckpt_dir or "", "--profile", ",".join(args.profile),
           "--host-profile", ",".join(args.host_profile), "--profile-steps", str(args.profile_steps),
           "--trace-dir", args.trace_dir,
           "--stash", ",".join(args.stash), "--segments", args.segments] + (
               ["--smoke"] if args.smoke else []) + (["--forward-graphs"] if args.forward_graphs else []) \
        + (["--backward-graphs"] if args.backward_graphs else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1",
               PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    rows, tail = [], []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    killer = threading.Timer(max(1.0, args.deadline_at + 20 - time.time()), proc.kill)
    killer.start()
    try:
        for out in proc.stdout:
            if out.startswith("RESULT "):
                rows.append(json.loads(out[len("RESULT "):]))
                log(line(rows[-1]))
            elif out.startswith("  "):
                log(out.rstrip())
            tail = (tail + [out.rstrip()])[-15:]
        proc.wait()
    finally:
        killer.cancel()
    done = {r["shape"] for r in rows}
    why = f"worker exit {proc.returncode}: " + " | ".join(tail[-4:])[-400:]
    missing = [dict(r, error=why) for r in expected if r["shape"] not in done]
    for r in missing:
        log(line(r))
    return rows + missing


def _spread(values: list) -> str:
    """One value (or several equal ones) as is; several (one per round) as min–max."""
    values = [v for v in values if v is not None]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def merge_rounds(rows: list[dict]) -> dict:
    """{(stack, shape): row}; with ``--rounds`` > 1 the rounds' rows of a stack and shape merged: the
    median tok/s (the ratios' basis), each round's tok/s and peak memory kept as lists."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["stack"], r["shape"]), []).append(r)
    merged = {}
    for key, rs in groups.items():
        ok = [r for r in rs if "tokens_per_s" in r]
        if not ok:
            merged[key] = rs[-1]
            continue
        skipped = sum(str(r.get("error", "")).startswith("skipped") for r in rs)  # not started: the time budget
        merged[key] = dict(ok[0], tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in ok)),
                           rounds_tokens_per_s=[r["tokens_per_s"] for r in ok],
                           rounds_peak_gib=[r["peak_gib"] for r in ok],
                           rounds_peak_reserved_gib=[r.get("peak_reserved_gib") for r in ok],
                           failed_rounds=len(rs) - len(ok) - skipped, skipped_rounds=skipped)
    return merged


def table(rows: list[dict], args) -> str:
    by = merge_rounds(rows)
    several = getattr(args, "rounds", 1) > 1
    head = "tok/s, median of the rounds (× hf, × unsloth); each round" if several else "tok/s (× hf, × unsloth)"
    out = [f"| stack | shape | {head} | peak allocated GiB | peak reserved GiB |", "|---|---|---|---|---|"]
    for stack in args.stacks:
        for b, s in args.shapes:
            r = by.get((stack, f"{b}x{s}"), {})
            if "tokens_per_s" not in r:
                out.append(f"| {stack} | {b}x{s} | {r.get('error', '-')[:80]} | | |")
                continue
            ratios = [f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}× {name}" for name in ("hf", "unsloth")
                      if "tokens_per_s" in (ref := by.get((name, f"{b}x{s}"), {})) and name != stack]
            speed = f"{r['tokens_per_s']:,} ({', '.join(ratios) or '-'})"
            if several:
                speed += "; " + ", ".join(f"{v:,}" for v in r["rounds_tokens_per_s"]) + (
                    f"; {r['failed_rounds']} failed" if r["failed_rounds"] else "") + (
                    f"; {r['skipped_rounds']} not run (time budget)" if r["skipped_rounds"] else "")
                out.append(f"| {stack} | {b}x{s} | {speed} | {_spread(r['rounds_peak_gib'])} "
                           f"| {_spread(r['rounds_peak_reserved_gib'])} |")
            else:
                out.append(f"| {stack} | {b}x{s} | {speed} | {r['peak_gib']} | {r.get('peak_reserved_gib', '')} |")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated subset of " + ", ".join(STACKS))
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS), help="the shape (random init)")
    p.add_argument("--attention", default="", help="attn_implementation of the hf and fasttune models (default: "
                   "sdpa for Qwen3-MoE, eager for gpt-oss; flex_attention runs gpt-oss's sinks compiled)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (Qwen3-30B-A3B has 48, gpt-oss-20b 24; default 8)")
    p.add_argument("--lora", default="experts", choices=("experts", "attention"),
                   help="LoRA on attention and the experts, or on attention only (experts frozen)")
    p.add_argument("--weights", default="bf16", choices=("bf16", "nf4"),
                   help="base weights: bf16, or NF4 (QLoRA: decoder linears as bitsandbytes Linear4bit)")
    p.add_argument("--experts-nf4", default="auto", choices=("auto", "on", "off"),
                   help="fasttune's FastConfig.moe_experts_nf4 (auto: NF4 experts when --weights nf4)")
    p.add_argument("--shapes", default="4x2048", help="batch x sequence, comma-separated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the stacks this many times, alternating, each in a fresh process: the table gives the "
                        "median tok/s and the range of peak memory (a stack's reserve moves between processes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gc", default="on", choices=("on", "freeze", "off"),
                   help="Python's garbage collector during the timed steps (freeze: the model leaves its generations)")
    p.add_argument("--checkpointing", default="offload", choices=("offload", "recompute", "auto"))
    p.add_argument("--stash", default="", help="fasttune's stashes under offload/auto, comma-separated: experts "
                   "(FastConfig.experts_stash), attention (FastConfig.attention_stash)")
    p.add_argument("--forward-graphs", action="store_true",
                   help="fasttune: FastConfig(checkpoint_forward_graphs=True), the layers' forward from CUDA graphs")
    p.add_argument("--backward-graphs", action="store_true",
                   help="fasttune: FastConfig(checkpoint_backward_graphs=True), the layers' backward from CUDA graphs too")
    p.add_argument("--segments", default="", choices=("", "on", "release", "history"),
                   help="the warm-up run apart, the allocator's segments per stream and pool after it and after the "
                        "steps (allocator_segments.py); release: torch.cuda.empty_cache() between the two; history: "
                        "also each pool's peak and what was alive then, from torch's memory history (use few --steps; "
                        "with --trace-dir the snapshot is kept for pytorch.org/memory_viz)")
    p.add_argument("--ckpt-dir", default=None, help="where unsloth's checkpoint is written/read ('' to skip)")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds for the whole run")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--profile", default="", help="stacks (comma-separated) whose extra step is profiled: "
                   "top kernels, GEMMs by shape, idle gaps (stored in the JSON row and printed)")
    p.add_argument("--profile-steps", type=int, default=1,
                   help="steps in the profile, back to back (2+: what a pipelined step waits on)")
    p.add_argument("--trace-dir", default="", help="keep the profiled step's Chrome trace (and the --host-profile pstats) in this folder")
    p.add_argument("--host-profile", default="", help="cProfile one extra step of these stacks (host time by function)")
    p.add_argument("--smoke", action="store_true", help="tiny model: checks the script, measures nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.stacks = sorted((s for s in args.stacks.split(",") if s), key=lambda s: STACKS.index(s)
                         if s in STACKS else p.error(f"unknown stack {s!r}"))
    args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]
    args.profile = [s for s in args.profile.split(",") if s]
    args.host_profile = [s for s in args.host_profile.split(",") if s]
    args.stash = [s for s in args.stash.split(",") if s]
    if any(s not in ("experts", "attention") for s in args.stash):
        p.error(f"--stash takes experts and/or attention, got {args.stash}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.layers is None:
        args.layers = 2 if args.smoke else 8
    if args.smoke and args.shapes == [(4, 2048)]:
        args.shapes, args.steps, args.warmup = [(1, 64)], min(args.steps, 1), min(args.warmup, 1)
    if args.ckpt_dir is None:
        args.ckpt_dir = f"/tmp/fasttune_bench_moe_{'smoke_' if args.smoke else ''}{args.model}_{args.layers}l"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args)
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_moe_step.py needs a CUDA GPU (or --smoke)")
    t0 = time.time()
    args.deadline_at = t0 + args.budget_s

    def log(msg):
        print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)

    info = common.versions()
    log(" ".join(f"{k}={v}" for k, v in info.items()) + f" layers={args.layers} lora={args.lora} "
        f"model={args.model} attention={args.attention or MODELS[args.model][2]} weights={args.weights} experts_nf4={args.experts_nf4} stash={','.join(args.stash) or 'none'}")
    rows = []
    for n in range(1, args.rounds + 1):
        if args.rounds > 1:
            log(f"round {n} of {args.rounds}")
        for stack in args.stacks:
            rows += [dict(r, round=n) for r in run_stack(stack, args, log)]
    print("\n" + table(rows, args) + f"\n\ntotal {time.time() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"versions": info, "model": args.model, "attention": args.attention or MODELS[args.model][2],
                       "layers": args.layers, "lora": args.lora, "weights": args.weights,
                       "experts_nf4": args.experts_nf4, "stash": args.stash, "rounds": args.rounds, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
