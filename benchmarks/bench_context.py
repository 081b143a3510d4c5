"""Long context and throughput of fasttune's decoder-layer checkpointing on a Llama-3.1-8B shape (H200).

(a) The longest sequence at batch 1 for which one QLoRA step (NF4 base via bitsandbytes, LoRA r=16
    on all 7 projections, fwd+bwd) runs: fasttune "offload" vs Hugging Face checkpointing
    (non-reentrant, stock loss) vs Unsloth (``--stacks fasttune,hf,unsloth``, in its own process:
    it patches transformers globally). Lengths double from 16,384 until a step fails, then bisect to 4,096;
    at most 6 attempts run per stack, and no attempt whose predicted time (quadratic in the length from
    the last success) would overrun the stack's time cap or the global deadline: the result then
    says "time cap", with the measured GPU and pinned-host GiB per 1k tokens to extrapolate from.
(b) Tokens/s of "auto" inside an 80 GiB GPU (``torch.cuda.set_per_process_memory_fraction``;
    budget = free memory minus margin) vs "recompute", bf16 LoRA 4×2048 step (``--shape``).
(c) "offload" vs "recompute" (and no checkpointing, for reference) on the same step; target:
    offload at most 5% slower than recompute. ``--only c --shape 1x32768`` checks long sequences.

Models are random-init (no downloads): built in bf16 on the GPU from the config; for (a) every
decoder Linear is then replaced by a ``bitsandbytes.nn.Linear4bit`` quantized from those weights.
Steps are forward+backward only (no optimizer), tokens random, labels = inputs.

Usage (H200, repo root; bitsandbytes from the carried wheels):
    python benchmarks/bench_context.py [--only a|b|c[,..]] [--out FILE.json] [--stacks fasttune,hf,unsloth]
        [--kernels off]
Default run (a+b+c, no Unsloth) stays under ~6 minutes; ``--only a --stacks unsloth`` runs Unsloth
alone (~4 minutes: it must write and load a 16 GB random checkpoint).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

if "--unsloth-worker" in sys.argv:  # Unsloth must be imported before transformers
    import unsloth  # noqa: F401

from pathlib import Path

import torch

from allocator_segments import segment_summary  # noqa: E402 - benchmarks/ is on sys.path as the script dir

GIB = 1 << 30
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 20,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=3)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KERNELS_OFF = dict(cross_entropy=False, rms_norm=False, rope=False, mlp=False, lora=False, fused_logprobs=False)
START_LEN, GRANULARITY, MAX_ATTEMPTS = 16384, 4096, 6
WARMUP_LEN = 4096  # one untimed attempt per stack first: kernel compilation and autotuning


class Deadline:
    """Seconds left of the whole run."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# --- models ------------------------------------------------------------------------------------

def build_model(nf4: bool, lora: bool = True):
    """A random-init Llama-3.1-8B-shaped causal LM on the GPU (bf16, or NF4 decoder Linears), with LoRA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **LLAMA_8B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    if nf4:
        to_nf4(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    model.train()
    return model


def to_nf4(model) -> None:
    """Each decoder nn.Linear → bitsandbytes NF4 Linear4bit quantised from its weight (bench_step's builder)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_step import to_nf4 as quantise

    quantise(model)


def fast_config(mode, kernels: bool, **kw):
    from fasttune.config import FastConfig

    return FastConfig(checkpointing=mode, **({} if kernels else KERNELS_OFF), **kw)


def release(model=None) -> None:
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()  # pinned blocks cached by torch's host allocator


# --- one step ------------------------------------------------------------------------------------

def attempt(model, seq: int, vocab: int, pinned=None) -> dict:
    """One fwd+bwd at batch 1 × ``seq``; an out-of-memory error is a result, not a crash."""
    release(model)
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, vocab, (1, seq), device="cuda")
    error = None
    t0 = time.perf_counter()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        error = "OOM"
    except RuntimeError as err:  # bitsandbytes/Triton report allocation failures as RuntimeError
        if "out of memory" not in str(err).lower():
            raise
        error = "OOM"
    seconds = time.perf_counter() - t0
    out = dict(seq=seq, ok=error is None, seconds=round(seconds, 2),
               peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
               reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2), error=error)
    if pinned is not None:
        out["pinned_gib"] = round(pinned(seq) / GIB, 2)
    if SEGMENTS[0]:
        out["segments"] = segment_summary()
    release(model)
    return out


SEGMENTS = [False]  # --segments: summarise the allocator's segments after each attempt


def search(run, cap_s: float, deadline: Deadline, log, start: int = START_LEN) -> dict:
    """Doubling from START_LEN, then bisection; stops at MAX_ATTEMPTS or when the next attempt would not fit.

    An attempt whose peak memory, extrapolated linearly from the two longest successes, exceeds the
    GPU by more than 15% is not run: it counts as a failure marked "predicted OOM".
    """
    attempts, ok, bad, last, stopped = [], 0, None, None, None
    warm = run(WARMUP_LEN)  # compiles and autotunes the kernels (Triton, torch.compile) outside the timed attempts
    log(f"    warm-up at {WARMUP_LEN} tokens: {'ok' if warm['ok'] else warm['error']} in {warm['seconds']} s")
    t_leg = time.perf_counter()
    total_gib = torch.cuda.mem_get_info()[1] / GIB
    while sum(a["seconds"] > 0 for a in attempts) < MAX_ATTEMPTS:  # predicted failures cost nothing
        if bad is None:
            seq = start if ok == 0 else 2 * ok
        elif bad - ok <= GRANULARITY:
            break
        else:
            seq = max(1024, (ok + bad) // 2 // 1024 * 1024)
        fit = per_1k_tokens([a for a in attempts if a["ok"]])
        if fit.get("gpu_gib_per_1k", 0) > 0:
            peak = last["peak_gib"] + (seq - last["seq"]) / 1024 * fit["gpu_gib_per_1k"]
            if peak > 1.15 * total_gib:
                log(f"    {seq:>7} tokens: predicted OOM ({peak:.0f} GiB), not run")
                attempts.append(dict(seq=seq, ok=False, seconds=0.0, peak_gib=round(peak, 1),
                                     error="predicted OOM (not run)"))
                bad = seq if bad is None else min(bad, seq)
                continue
        left = min(cap_s - (time.perf_counter() - t_leg), deadline.left())
        predicted = 5.0 + (last["seconds"] * (seq / last["seq"]) ** _time_exponent(attempts) if last else 5.0)
        if predicted > left:
            stopped = f"time cap: {seq} tokens predicted {predicted:.0f} s, {max(left, 0):.0f} s left"
            break
        r = run(seq)
        for name, seg in r.get("segments", {}).items():
            log(f"      {name}: {seg}")
        log(f"    {seq:>7} tokens: {'ok' if r['ok'] else r['error']} in {r['seconds']} s, peak {r['peak_gib']} GiB"
            + (f" allocated, {r['reserved_gib']} GiB reserved" if "reserved_gib" in r else "")
            + (f", pinned {r['pinned_gib']} GiB" if "pinned_gib" in r else ""))
        attempts.append(r)
        if r["ok"]:
            ok, last = seq, r
        else:
            bad = seq if bad is None else min(bad, seq)
    result = dict(max_ok=ok, first_fail=bad, stopped=stopped or ("out of memory" if bad else "attempts"),
                  attempts=attempts)
    result.update(per_1k_tokens([a for a in attempts if a["ok"]], limits=True))
    return result


def _time_exponent(attempts: list[dict]) -> float:
    """Growth of step time with length: fitted on the two longest successes plus 0.3, within [1.5, 2].

    Attention makes the step superlinear and more so as it grows (H200, 8B QLoRA: 1.2 from 32k to
    64k, 1.5 from 64k to 128k, 1.9 from 128k to 256k for Unsloth); quadratic without two points.
    """
    oks = sorted((a for a in attempts if a["ok"]), key=lambda a: a["seq"])[-2:]
    if len(oks) < 2 or oks[0]["seconds"] <= 0:
        return 2.0
    import math

    fitted = math.log(oks[1]["seconds"] / oks[0]["seconds"]) / math.log(oks[1]["seq"] / oks[0]["seq"])
    return min(2.0, max(1.5, fitted + 0.3))


def per_1k_tokens(oks: list[dict], limits: bool = False) -> dict:
    """Slopes of GPU peak and pinned host memory per 1k tokens, from the two longest successes."""
    if len(oks) < 2:
        return {}
    a, b = sorted(oks, key=lambda r: r["seq"])[-2:]
    k = (b["seq"] - a["seq"]) / 1024
    out = {"gpu_gib_per_1k": round((b["peak_gib"] - a["peak_gib"]) / k, 4)}
    if "pinned_gib" in b:
        out["pinned_gib_per_1k"] = round((b["pinned_gib"] - a["pinned_gib"]) / k, 4)
    total = torch.cuda.mem_get_info()[1]
    if limits and out["gpu_gib_per_1k"] > 0:
        extra_k = (total / GIB - b["peak_gib"]) / out["gpu_gib_per_1k"]
        out["gpu_limit_tokens_linear_fit"] = int(b["seq"] + extra_k * 1024)
    return out


# --- (a) -----------------------------------------------------------------------------------------

def part_a(args, deadline: Deadline, log) -> dict:
    results = {}
    stacks = set(args.stacks.split(","))
    ckpt_dir = None
    if "unsloth" in stacks:  # Unsloth loads from disk: write the random bf16 weights first
        model = build_model(nf4=False, lora=False)
        ckpt_dir = write_checkpoint(model)
        log(f"  (a) random bf16 checkpoint at {ckpt_dir}")
        if stacks & {"fasttune", "hf"}:
            to_nf4(model)
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                     target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
            model.train()
    else:
        model = build_model(nf4=True)
    log(f"  (a) QLoRA 8B built: {torch.cuda.memory_allocated() / GIB:.1f} GiB on the GPU")
    if "fasttune" in stacks:
        results["fasttune_offload"] = fasttune_leg(model, args, deadline, log)
    if "hf" in stacks:
        results["hf_checkpointing"] = hf_leg(model, args, deadline, log)
    del model
    release()
    if "unsloth" in stacks:
        log("  (a) Unsloth (separate process)")
        results["unsloth"] = run_unsloth(ckpt_dir, args, deadline, log)
    return results


def fasttune_leg(model, args, deadline: Deadline, log) -> dict:
    from fasttune.model_patches import patch_model, unpatch_model
    from fasttune.model_patches.checkpointing import layer_checkpointing

    log("  (a) fasttune offload")
    patch_model(model, fast_config("offload", args.kernels == "on"))
    stats = layer_checkpointing(model).checkpointer.stats
    packed_before = [0]

    def pinned(seq):  # host bytes this step offloaded: layer inputs packed × [1, seq, hidden] bf16
        n, packed_before[0] = stats.packed - packed_before[0], stats.packed
        return n * seq * LLAMA_8B["hidden_size"] * 2

    if args.memory_history:  # every allocation with its stack, for torch's memory_viz (pytorch.org/memory_viz)
        torch.cuda.memory._record_memory_history(max_entries=300_000)
    try:
        result = search(lambda s: attempt(model, s, LLAMA_8B["vocab_size"], pinned), args.leg_cap, deadline, log,
                        args.start_len)
    except Exception as err:  # a broken stack is a result too
        result = dict(error=f"{type(err).__name__}: {err}")
    if args.memory_history:
        torch.cuda.memory._dump_snapshot(args.memory_history)
        torch.cuda.memory._record_memory_history(enabled=None)
        log(f"  (a) memory history of the fasttune leg in {args.memory_history}")
    unpatch_model(model)
    release(model)
    return result


def hf_leg(model, args, deadline: Deadline, log) -> dict:
    log("  (a) Hugging Face checkpointing (use_reentrant=False, stock loss)")
    base = model.get_base_model()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        result = search(lambda s: attempt(model, s, LLAMA_8B["vocab_size"]), min(80.0, args.leg_cap), deadline, log,
                        args.start_len)
    except Exception as err:
        result = dict(error=f"{type(err).__name__}: {err}")
    base.gradient_checkpointing_disable()
    release(model)
    return result


def write_checkpoint(model) -> str:
    """Save the random bf16 model and a tiny tokenizer where Unsloth's from_pretrained can read them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(tempfile.gettempdir(), "fasttune_bench_llama8b")
    if not os.path.exists(os.path.join(path, "config.json")):
        model.save_pretrained(path, max_shard_size="5GB")
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                      bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
        tok.save_pretrained(path)
    return path


def run_unsloth(path: str, args, deadline: Deadline, log) -> dict:
    cap = deadline.left() - 5
    if cap < 60:
        return dict(error=f"skipped: {cap:.0f} s left")
    cmd = [sys.executable, __file__, "--unsloth-worker", path, "--cap", str(cap), "--leg-cap", str(args.leg_cap),
           "--start-len", str(args.start_len)]
    try:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cap + 30, env=env)
    except subprocess.TimeoutExpired:
        return dict(error="timed out")
    for line in proc.stdout.splitlines():
        if line.startswith("    "):
            log(line)
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return dict(error=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")


def unsloth_worker(path: str, cap: float, leg_cap: float, start: int) -> None:
    from unsloth import FastLanguageModel

    deadline = Deadline(cap)
    model, _ = FastLanguageModel.from_pretrained(path, max_seq_length=1 << 19, dtype=torch.bfloat16,
                                                 load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                             target_modules=LORA_TARGETS, use_gradient_checkpointing="unsloth")
    model.train()
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"    (Unsloth loaded in {cap - deadline.left():.0f} s)")
    result = search(lambda s: attempt(model, s, LLAMA_8B["vocab_size"]), leg_cap, deadline, log, start)
    print("RESULT " + json.dumps(result), flush=True)


# --- (b) and (c) ----------------------------------------------------------------------------------

def throughput(model, mode, kernels: bool, shape: tuple[int, int], steps: int = 3, **kw) -> dict:
    from fasttune.model_patches import patch_model
    from fasttune.model_patches.checkpointing import layer_checkpointing

    patch_model(model, fast_config(mode, kernels, **kw))
    ids = torch.randint(0, LLAMA_8B["vocab_size"], shape, device="cuda")
    release(model)
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up: pinned buffers, auto's measurement
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    state = layer_checkpointing(model)
    out = dict(mode=str(mode), ms_per_step=round(1000 * seconds, 1), tokens_per_s=round(ids.numel() / seconds),
               peak_gib=round(torch.cuda.max_memory_allocated() / GIB, 2))
    if state is not None and state.decision is not None:
        out["auto"] = str(state.decision)
    if state is not None and state.checkpointer is not None:
        out["prefetch_misses"] = state.checkpointer.stats.misses
    return out


def part_bc(args, parts: set, log) -> dict:
    from fasttune.model_patches import unpatch_model

    kernels = args.kernels == "on"
    shape = tuple(int(x) for x in args.shape.lower().split("x"))
    model = build_model(nf4=False)
    log(f"  (b/c) bf16 LoRA 8B built: {torch.cuda.memory_allocated() / GIB:.1f} GiB on the GPU")
    rows = {}
    for mode in ("recompute", "offload", None):
        if mode is None or mode == "offload":
            if "c" not in parts:
                continue
        rows[str(mode)] = throughput(model, mode, kernels, shape)
        log(f"    {rows[str(mode)]}")
    if "b" in parts:
        total = torch.cuda.mem_get_info()[1]
        unpatch_model(model)
        release(model)
        torch.cuda.set_per_process_memory_fraction(min(1.0, 80 * GIB / total))
        try:
            rows["auto_80GiB"] = throughput(model, "auto", kernels, shape)
        except torch.OutOfMemoryError:
            rows["auto_80GiB"] = dict(mode="auto", error="OOM inside 80 GiB")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        log(f"    {rows['auto_80GiB']}")
    unpatch_model(model)
    del model
    release()
    rec = rows["recompute"]["tokens_per_s"]
    for name, row in rows.items():
        if "tokens_per_s" in row:
            row["vs_recompute"] = round(row["tokens_per_s"] / rec, 3)
    return rows


# --- report --------------------------------------------------------------------------------------

def markdown(results: dict) -> str:
    lines = []
    if "a" in results:
        lines += ["### (a) longest batch-1 QLoRA step, Llama-3.1-8B shape, NF4, r=16", "",
                  "| stack | longest ok | first failure | stopped by | s at longest | GPU GiB at longest "
                  "(reserved) | reserved ÷ allocated, every length | GPU GiB / 1k tok | pinned GiB / 1k tok |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, r in results["a"].items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error'][:120]} | | | | | | | |")
                continue
            best = max((a for a in r["attempts"] if a["ok"]), key=lambda a: a["seq"], default={})
            ratios = ", ".join(f"{a['seq'] // 1024}k {a['reserved_gib'] / a['peak_gib']:.2f}"
                               for a in r["attempts"] if a["ok"] and a.get("peak_gib") and "reserved_gib" in a)
            lines.append(f"| {name} | {r['max_ok']:,} | {r['first_fail'] or '-'} | {r['stopped']} "
                         f"| {best.get('seconds', '-')} | {best.get('peak_gib', '-')} ({best.get('reserved_gib', '-')}) "
                         f"| {ratios or '-'} "
                         f"| {r.get('gpu_gib_per_1k', '-')} | {r.get('pinned_gib_per_1k', '-')} |")
        lines.append("")
    if "bc" in results:
        lines += [f"### (b)/(c) bf16 LoRA r=16 step, {results['shape']} tokens, Llama-3.1-8B shape", "",
                  "| checkpointing | ms/step | tokens/s | vs recompute | peak GiB | note |",
                  "|---|---|---|---|---|---|"]
        for name, r in results["bc"].items():
            if "error" in r:
                lines.append(f"| {name} | | | | | {r['error']} |")
                continue
            lines.append(f"| {name} | {r['ms_per_step']} | {r['tokens_per_s']:,} | {r['vs_recompute']} "
                         f"| {r['peak_gib']} | {r.get('auto', '')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="a,b,c", help="parts to run: a, b, c (comma-separated)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--stacks", default="fasttune,hf",
                        help="stacks compared in (a): fasttune, hf, unsloth (unsloth adds ~4 minutes)")
    parser.add_argument("--kernels", choices=("on", "off"), default="on",
                        help="fasttune's Triton kernels with the checkpointing ('off': checkpointing alone)")
    parser.add_argument("--deadline", type=float, default=340.0, help="seconds for the whole run")
    parser.add_argument("--leg-cap", type=float, default=125.0,
                        help="(a): seconds of attempts per stack (Hugging Face: at most 80)")
    parser.add_argument("--start-len", type=int, default=START_LEN, help="(a): first length tried")
    parser.add_argument("--shape", default="4x2048", help="(b)/(c): batch x sequence of the step")
    parser.add_argument("--gpu-cap-gib", type=float, default=None,
                        help="(a): cap this process's GPU memory (set_per_process_memory_fraction): a length that "
                             "trains under a cap below its peak reserved memory shows the reserve is not the limit")
    parser.add_argument("--segments", action="store_true",
                        help="(a): after each attempt, the allocator's segments per stream (reserved, in use, free ranges)")
    parser.add_argument("--memory-history", help="(a): dump the fasttune leg's allocator history (a pickle) here")
    parser.add_argument("--unsloth-worker", help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.unsloth_worker:
        return unsloth_worker(args.unsloth_worker, args.cap, args.leg_cap, args.start_len)
    if not torch.cuda.is_available():
        raise SystemExit("bench_context.py needs a CUDA GPU")
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    if not set(args.stacks.split(",")) <= {"fasttune", "hf", "unsloth"}:
        raise SystemExit(f"--stacks takes fasttune, hf, unsloth; got {args.stacks!r}")
    if not parts <= {"a", "b", "c"}:
        raise SystemExit(f"--only takes a, b, c; got {args.only!r}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = Deadline(args.deadline)
    SEGMENTS[0] = args.segments
    if args.gpu_cap_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * GIB / torch.cuda.mem_get_info()[1]))
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": args.kernels,
               "shape": args.shape, "gpu_cap_gib": args.gpu_cap_gib,
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")}
    if parts & {"b", "c"}:
        results["bc"] = part_bc(args, parts, log)
    if "a" in parts:
        results["a"] = part_a(args, deadline, log)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    print(markdown(results))
    print(f"\ntotal {results['seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
