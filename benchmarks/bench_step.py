"""One LoRA / QLoRA training step on a Llama-3.1-8B shape: fasttune vs stock HF+PEFT, Liger and Unsloth (H200).

A step = forward (bf16 autocast, as Trainer(bf16=True) runs it), backward and a fused AdamW step
on the adapters, on random tokens (labels = inputs). Model: random-init Llama-3.1-8B shape (all
32 layers, V = 128,256; ``--model qwen2.5-7b`` or ``qwen3-8b`` for those shapes, all their layers),
built in bf16 on the GPU (no download); LoRA r=16, alpha 16, dropout 0
on all seven projections; activation checkpointing on. Two kinds of base weights: bf16, and NF4
(every decoder Linear replaced by a bitsandbytes ``Linear4bit`` quantised from the same random
bf16 weights: double quantisation, blocksize 64, bf16 compute). Shapes 4×2048 and 1×8192.

Stacks (each in its own process: Liger and Unsloth patch transformers' modules globally):
  hf        stock transformers + PEFT, HF checkpointing (non-reentrant)
  liger     hf + ``liger_kernel.transformers._apply_liger_kernel_to_instance`` (RMSNorm, RoPE,
            SwiGLU, fused linear cross-entropy), HF checkpointing
  fasttune  ``patch_model(model, FastConfig(checkpointing=...))``: every kernel including fused
            LoRA QKV/O/MLP with NF4 dequantised on the fly; fasttune's checkpointing ("offload"
            by default, ``--checkpointing recompute``)
  fasttune-recompute  the same with checkpointing="recompute" (layer inputs stay on the GPU)
  fasttune-auto       checkpointing="auto" inside ``--auto-budget-gib`` (80) of GPU memory for the
            whole process (``torch.cuda.set_per_process_memory_fraction``): keeps as many layers'
            activations as fit instead of recomputing them
  fasttune-fp8        fasttune with ``FastConfig(base_dtype="fp8")`` ("offload" checkpointing): the seven
            projections' frozen bases in FP8 (from the bf16 weights, or from the NF4 ones with
            ``--weights nf4``: dequantised once, then FP8), base products through torch._scaled_mm
  fasttune-fp8-auto   the same with checkpointing="auto" inside ``--auto-budget-gib``
  unsloth   ``FastLanguageModel.from_pretrained(dir, load_in_4bit=...)`` + ``get_peft_model(...,
            use_gradient_checkpointing="unsloth")``; needs a checkpoint, so the first other stack's
            worker (or, alone, unsloth's own) saves the random bf16 model (with a tiny tokenizer) to
            ``--ckpt-dir`` (16 GB, reused when present). Optional: a row says so when unsloth does
            not import.

Columns: median ms per step over ``--steps`` (5) after ``--warmup`` (2), each step timed alone
(synchronised before and after), tokens/s (and, in parentheses, tokens/s of as many steps run back
to back with one synchronisation at the end, as a training loop runs them), peak GPU memory
allocated over the timed steps (weights, adapters, AdamW states and activations; Unsloth and
fasttune "offload" also hold pinned host memory), and the loss of the first step (adapters' B
starts at 0, so every stack computes the same function there: a sanity check across stacks).

The JSON rows also carry each timed step's ms, per-step phases (GPU ms of forward / backward /
AdamW from CUDA events, how far into the step the host finished launching each, the SM clock and
power draw, and the ms NVML counted the GPU held back by its power cap or temperature since the step
before, with the clock event reasons active) and the garbage collections during the timed steps
(``--gc on|freeze|off``). ``--no-lora-widen`` runs the fasttune stacks with ``FastConfig(lora_widen=False)``
(the rank-r term as its own pass),
``--reuse-forward-lora`` with ``FastConfig(reuse_forward_lora=True)`` (``kernels/forward_reuse.py``),
``--no-residual-norms`` with ``FastConfig(residual_norms=False)`` (the residual adds as their own kernels),
``--attention-stash on|off`` with ``FastConfig(attention_stash=True|False)`` on the offloading stacks (the
attention core's saved tensors in host memory instead of recomputed, the default on dense families; ``off``:
each offloaded layer's core recomputed; the stash's counters follow the row; a bare ``--attention-stash`` is
``on``), ``--mlp-stash``
with ``FastConfig(mlp_stash=True)`` (the same for each layer's MLP; the link rate and layer time the stash
measured follow the row), ``--o-proj-stash on|off`` with ``FastConfig(o_proj_stash=True|False)`` (``off``: each
offloaded layer's o_proj multiplied again in the recompute instead of taking its output back from the host),
``--no-grad-forward`` with ``FastConfig(checkpoint_no_grad_forward=True)`` (the checkpointed layers' forward
without autograd, on for dense families too) and ``--forward-graphs`` with that and
``FastConfig(checkpoint_forward_graphs=True)`` (that forward replayed from CUDA graphs); ``--backward-graphs``
adds ``FastConfig(checkpoint_backward_graphs=True)`` (the layers' recompute and backward replayed too).

``--profile`` adds a torch.profiler table (top CUDA kernels by self device time) of one extra
fasttune step per configuration (``--profile hf,fasttune`` for other stacks; ``--profile-steps N``: N
steps back to back), printed and stored in the JSON with the idle gaps of the GPU and of its compute
stream (host-bound or waiting, by phase and op: ``trace_gaps.py``); ``--trace DIR`` also writes Chrome traces there.

Usage (H200, repo root; peers from the carried wheels, see ../shared/tools/fetch_peer_wheels.sh):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 benchmarks/bench_step.py --out $OUT/bench_step.json            # all stacks, < 8 minutes
    python3 benchmarks/bench_step.py --stacks fasttune --profile --out $OUT/profile.json
    python3 benchmarks/bench_step.py --stacks hf,fasttune,fasttune-fp8,fasttune-fp8-auto,unsloth \
        --out $OUT/fp8.json                                  # FP8 bases beside bf16 and Unsloth
    python3 benchmarks/bench_step.py --stacks fasttune-fp8 --weights bf16 --shapes 4x2048 --profile fasttune-fp8
    python3 benchmarks/bench_step.py --smoke   # tiny model, CPU (interpreter) or GPU: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
import weakref

if "--worker" in sys.argv and sys.argv[sys.argv.index("--worker") + 1:][:1] == ["unsloth"]:
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # no network on the GPU machine
    try:  # Unsloth must be imported before transformers
        import unsloth  # noqa: F401
    except Exception as err:  # noqa: BLE001 - reported as the stack's rows
        UNSLOTH_IMPORT_ERROR = f"{type(err).__name__}: {err}"

import torch  # noqa: E402

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fasttune's kernels are imported

GIB = 1 << 30
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=3)
# Widths multiples of 64: bitsandbytes 0.50.2 on CPU mis-dequantises other NF4 rows
# (docs/FACTS.md, bitsandbytes on the CPU).
SMOKE = dict(LLAMA_8B, vocab_size=1031, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=False, use_cache=False, bos_token_id=1, eos_token_id=2,
                 pad_token_id=3)  # q/k/v carry biases (Qwen2's attention always does)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)  # q/k norms
_SMALL = dict(vocab_size=1031, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
# --model: (transformers model_type, full shape, smoke shape)
MODELS = {
    "llama3.1-8b": ("llama", LLAMA_8B, SMOKE),
    "qwen2.5-7b": ("qwen2", QWEN25_7B, dict(QWEN25_7B, **_SMALL)),
    "qwen3-8b": ("qwen3", QWEN3_8B, dict(QWEN3_8B, **_SMALL, head_dim=32)),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STACKS = ("hf", "liger", "fasttune", "fasttune-recompute", "fasttune-auto", "fasttune-fp8", "fasttune-fp8-auto",
          "unsloth")
WEIGHTS = ("bf16", "nf4")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- models --------------------------------------------------------------------------------------

def build_base(shape: dict, model_type: str = "llama"):
    """The random-init causal LM in bf16 on the GPU (fp32 on CPU for --smoke), frozen."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device() == "cuda" else torch.float32
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.requires_grad_(False)
    return model


def to_nf4(model, quant_storage=torch.uint8) -> None:
    """Each decoder nn.Linear → bitsandbytes NF4 Linear4bit quantised from its weight (as QLoRA loads);
    ``quant_storage``: the dtype holding the packed codes (a float one for FSDP, as
    ``bnb_4bit_quant_storage``)."""
    import bitsandbytes as bnb

    compute = torch.bfloat16 if device() == "cuda" else torch.float32
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if type(lin) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=compute, compress_statistics=True, quant_type="nf4", device="meta",
                                      quant_storage=quant_storage)
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", module=q, quant_storage=quant_storage
                                             ).to(lin.weight.device)  # quantises
                if lin.bias is not None:  # Qwen2's q/k/v: the bias stays 16-bit, as QLoRA loads it
                    q.bias = lin.bias
                setattr(parent, name, q)
    model.is_loaded_in_4bit = True  # PEFT then wraps Linear4bit with its bnb LoRA layer
    release()


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                            target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))


def hf_checkpointing(base) -> None:
    kw = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers ≥ 5.2x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def save_checkpoint(model, path: str) -> None:
    """The random bf16 model plus a tiny tokenizer, where Unsloth's from_pretrained can read them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "config.json")):
        return
    tmp = path + ".partial"
    model.save_pretrained(tmp, max_shard_size="5GB")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                  bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    os.sync()  # the write-back of ~10 GB would otherwise run on the host during the next stack's timed steps


def prepare(stack: str, weights: str, shape: dict, args, log):
    """The PEFT model of ``stack`` with ``weights`` ("bf16"/"nf4"), in training mode."""
    if stack == "unsloth":
        return prepare_unsloth(weights, shape, args)
    base = build_base(shape, MODELS[args.model][0])
    if args.ckpt_dir and "unsloth" in args.all_stacks:  # from bf16 weights, before any quantisation
        t0 = time.perf_counter()
        save_checkpoint(base, args.ckpt_dir)
        log(f"    checkpoint for unsloth at {args.ckpt_dir} ({time.perf_counter() - t0:.0f} s)")
    if weights == "nf4":
        to_nf4(base)
    model = add_lora(base)
    if stack == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=base)
    if stack in ("hf", "liger"):
        hf_checkpointing(base)
    if stack.startswith("fasttune"):
        from fasttune import FastConfig, patch_model

        mode = {"fasttune-recompute": "recompute", "fasttune-auto": "auto",
                "fasttune-fp8-auto": "auto"}.get(stack, args.checkpointing)
        fp8 = stack.startswith("fasttune-fp8")
        report = patch_model(model, FastConfig(checkpointing=mode, lora_widen=not args.no_lora_widen,
                                               residual_norms=not args.no_residual_norms,
                                               reuse_forward_lora=args.reuse_forward_lora,
                                               base_dtype="fp8" if fp8 else "auto",
                                               attention_stash=False if mode == "recompute" else
                                               {"on": True, "off": False}.get(args.attention_stash),
                                               mlp_stash=args.mlp_stash and mode != "recompute",
                                               o_proj_stash={"on": True, "off": False}.get(args.o_proj_stash),
                                               memory_budget_gb=args.memory_budget_gb if mode == "auto" else None,
                                               checkpoint_no_grad_forward=True if args.no_grad_forward
                                               or args.forward_graphs or args.backward_graphs else None,
                                               checkpoint_forward_graphs=args.forward_graphs or args.backward_graphs,
                                               checkpoint_backward_graphs=args.backward_graphs,
                                               **({} if args.loss_workspace_mib is None
                                                  else {"loss_workspace_mib": args.loss_workspace_mib})))
        log("    " + str(report).replace("\n", "\n    "))
        n = shape["num_hidden_layers"]
        ops = ("lora_qkv", "lora_o", "lora_mlp") + (tuple("fp8_" + p for p in LORA_TARGETS) if fp8 else ())
        missing = [op for op in ops if report.patched[op] != n]
        if missing:
            raise RuntimeError(f"fused LoRA{' / FP8 bases' if fp8 else ''} not installed everywhere ({missing}): "
                               f"{report}")
    model.train()
    return model


def prepare_unsloth(weights: str, shape: dict, args):
    if "UNSLOTH_IMPORT_ERROR" in globals():
        raise RuntimeError(f"unsloth does not import: {UNSLOTH_IMPORT_ERROR}")
    from unsloth import FastLanguageModel

    if not args.ckpt_dir:
        raise RuntimeError("unsloth loads the random model from a checkpoint: give --ckpt-dir")
    if not os.path.exists(os.path.join(args.ckpt_dir, "config.json")):  # no other stack wrote it: same seed, same model
        base = build_base(shape, MODELS[args.model][0])
        save_checkpoint(base, args.ckpt_dir)
        del base
        release()
    model, _ = FastLanguageModel.from_pretrained(args.ckpt_dir, max_seq_length=max(s for _, s in args.shapes),
                                                 dtype=torch.bfloat16, load_in_4bit=weights == "nf4")
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                             target_modules=LORA_TARGETS, use_gradient_checkpointing="unsloth",
                                             random_state=0)
    if hasattr(FastLanguageModel, "for_training"):
        FastLanguageModel.for_training(model)
    model.train()
    return model


# --- the step ------------------------------------------------------------------------------------

def padded_batch(ids: torch.Tensor, g: torch.Generator) -> dict:
    """``ids`` as right-padded SFT rows: lengths drawn from half the sequence to all of it, the first row full
    (the batch keeps its shape); the padding is masked out and its labels ignored."""
    b, s = ids.shape
    lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
    lengths[0] = s
    mask = (torch.arange(s)[None, :] < lengths[:, None]).to(ids.device)
    return dict(input_ids=ids, attention_mask=mask.long(), labels=ids.masked_fill(~mask, -100))


class Step:
    """forward under bf16 autocast (CUDA), backward, AdamW on the trainable parameters."""

    def __init__(self, model, batch: dict):
        self.model, self.batch = model, batch
        params = [p for p in model.parameters() if p.requires_grad]
        fused = device() == "cuda" and all(p.is_cuda for p in params)
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=fused or None)

        self.phases: list[list] | None = None  # per step: CUDA events and host times at the phase starts
        self.clocks: list = []  # per step, from NVML when its launches were done: ((SM MHz, power W), throttling)

    def __call__(self) -> torch.Tensor:
        from torch.profiler import record_function  # phase names in profiles (no cost otherwise)

        marks = [] if self.phases is not None else None
        self._mark(marks)
        with record_function("forward"), torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
            loss = self.model(**self.batch).loss
        self._mark(marks)
        with record_function("backward"):
            loss.backward()
        self._mark(marks)
        with record_function("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self._mark(marks)
        if marks is not None:
            self.phases.append(marks)
            self.clocks.append((_clock_and_power(), _throttling()))
        return loss.detach()

    @staticmethod
    def _mark(marks) -> None:
        if marks is None or not torch.cuda.is_available():
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((ev, time.perf_counter()))

    def phase_ms(self) -> list[dict]:
        """Per timed step: GPU ms of forward / backward / optimizer (CUDA events) and the host ms
        from the step's start to each phase's launch being done (how far the host ran ahead)."""
        out, before = [], None
        for marks, (clock, throttle) in zip(self.phases or [], self.clocks):
            if len(marks) != 4:  # no CUDA: no events
                continue
            (e0, h0), (e1, h1), (e2, h2), (e3, h3) = marks
            out.append(dict(gpu=[round(e0.elapsed_time(e1), 1), round(e1.elapsed_time(e2), 1),
                                 round(e2.elapsed_time(e3), 1)],
                            host=[round((h1 - h0) * 1e3, 1), round((h2 - h0) * 1e3, 1), round((h3 - h0) * 1e3, 1)],
                            sm_clock_mhz_power_w=clock, **_throttled_since(before, throttle)))
            before = throttle
        return out


def _clock_and_power() -> tuple[int, int] | None:
    """(SM clock MHz, power draw W) of the GPU now, through NVML (None without CUDA or NVML):
    a power-capped GPU shows its throttling here."""
    try:
        return (torch.cuda.clock_rate(), torch.cuda.power_draw() // 1000) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - pynvml missing or NVML unavailable
        return None


# NVML's clock event reasons (nvmlClocksEventReasons), the ones that slow a busy GPU.
_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


def _throttling() -> tuple | None:
    """(ns the GPU has spent held back by its power cap, by temperature, as NVML counts them since boot;
    the clock event reasons active now), or None without NVML."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler()  # noqa: SLF001 - the handle torch.cuda.power_draw uses
        power = pynvml.nvmlDeviceGetViolationStatus(handle, pynvml.NVML_PERF_POLICY_POWER).violationTime
        thermal = pynvml.nvmlDeviceGetViolationStatus(handle, pynvml.NVML_PERF_POLICY_THERMAL).violationTime
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = reasons(handle)
        return power, thermal, [name for bit, name in _REASONS.items() if mask & bit]
    except Exception:  # noqa: BLE001 - pynvml missing, NVML unavailable or a call it does not support
        return None


def _throttled_since(before: tuple | None, now: tuple | None) -> dict:
    """The ms of power and thermal capping NVML counted between two ``_throttling`` reads (one step
    apart: the time from one step's launches being done to the next's), and the reasons now."""
    if now is None:
        return {}
    out = dict(clock_reasons=now[2])
    if before is not None:
        out.update(power_capped_ms=round((now[0] - before[0]) / 1e6, 1),
                   thermal_capped_ms=round((now[1] - before[1]) / 1e6, 1))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(step: Step, tokens: int, warmup: int, steps: int, gc_mode: str = "on") -> dict:
    loss0 = None
    for _ in range(warmup):  # Triton compiles and autotunes, AdamW allocates its states
        loss = step()
        loss0 = float(loss) if loss0 is None else loss0
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if gc_mode == "freeze":  # what is alive now (the model) leaves the collector's generations
        gc.collect()
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    collections0 = [g["collections"] for g in gc.get_stats()]
    times = []
    step.phases, step.clocks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        loss0 = float(loss) if loss0 is None else loss0  # --warmup 0: the first timed step's
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), collections0)]
    phases = step.phase_ms()
    step.phases = None
    # The same number of steps back to back, one sync at the end, as a training loop runs them
    # (Trainer does not wait for the GPU between steps): the host prepares the next step while the
    # GPU finishes the last one, so the per-step launch lag at the start of forward is hidden.
    sync()
    starts = []  # per step: (CUDA event at its start, host clock): where a pipelined step loses its overlap
    t0 = time.perf_counter()
    for _ in range(steps):
        starts.append((_event(), time.perf_counter()))
        step()
    starts.append((_event(), time.perf_counter()))
    sync()
    pipelined_ms = (time.perf_counter() - t0) / max(steps, 1) * 1e3
    pipelined = dict(host=[round((b[1] - a[1]) * 1e3, 1) for a, b in zip(starts, starts[1:])])
    if torch.cuda.is_available():
        pipelined["gpu"] = [round(a[0].elapsed_time(b[0]), 1) for a, b in zip(starts, starts[1:])]
    gc.enable()
    gc.unfreeze()
    ms = statistics.median(times) * 1e3
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")
    # Reserved: what the caching allocator holds (fragmentation included), what another process cannot use.
    reserved = torch.cuda.max_memory_reserved() / GIB if torch.cuda.is_available() else float("nan")
    return dict(ms=round(ms, 1), tokens_per_s=round(tokens / (ms / 1e3)), peak_gib=round(peak, 2),
                peak_reserved_gib=round(reserved, 2),
                loss_step1=round(loss0, 4), times_ms=[round(t * 1e3, 1) for t in times],
                gc=gc_mode, gc_collections=collections, phases=phases,
                ms_back_to_back=round(pipelined_ms, 1), tokens_per_s_back_to_back=round(tokens / (pipelined_ms / 1e3)),
                back_to_back_ms=pipelined)


def _event():
    """A CUDA event recorded now on the current stream (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def profile(step: Step, label: str, trace_dir: str | None, rows: int = 40, steps: int = 1) -> str:
    """Key averages of ``steps`` steps run back to back (one sync at the end), sorted by self device time
    (the top rows are the CUDA kernels), after a line comparing the wall time with the summed kernel time
    (a gap = GPU idle)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with torch_profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    import tempfile

    from trace_gaps import gap_report, stream_report

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(trace_dir or tmp, f"{label}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        gaps = gap_report(path) + "\n" + stream_report(path)
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    averages = prof.key_averages()
    kernels_ms = sum(e.self_device_time_total for e in averages) / 1e3
    groups: dict[str, float] = {}
    for e in averages:  # kernel time by kind: GEMMs, attention, Triton (ours or peers'), the rest
        t = e.self_device_time_total / 1e3
        if t <= 0:
            continue
        n = e.key.lower()
        kind = ("fp8 quantise" if "quantize_rows" in n else
                "gemm" if any(w in n for w in ("gemm", "nvjet", "cutlass", "xmma", "sm90_")) else
                "attention" if any(w in n for w in ("flash", "fmha", "attention", "sdpa")) else
                "triton" if e.key.startswith("_") or "triton" in n else "other")
        groups[kind] = groups.get(kind, 0.0) + t
    head = (f"wall {wall_ms:.1f} ms ({steps} step{'s' * (steps > 1)} profiled), kernels {kernels_ms:.1f} ms; by kind: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))
    return (head + "\n" + averages.table(sort_by=key, row_limit=rows, max_name_column_width=90)
            + "\n" + gemm_table(prof) + "\n\n" + runtime_table(averages) + "\n\n" + gaps)


def runtime_table(averages) -> str:
    """CUDA runtime/driver calls of the profiled step by host time: a synchronising call (stream, event or
    device synchronize, a blocking copy, cudaMalloc/cudaFree, pinned host allocation) stalls the host until
    the GPU drains, after which every launch is exposed."""
    rows = sorted(((e.key, e.count, e.self_cpu_time_total / 1e3) for e in averages
                   if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn")), key=lambda r: -r[2])
    return ("CUDA runtime calls (host ms)\n| call | count | host ms |\n|---|---|---|\n"
            + "\n".join(f"| {k} | {n} | {ms:.1f} |" for k, n, ms in rows[:20]))


def host_profile(step: Step, rows: int = 70, dump: str | None = None) -> str:
    """cProfile of one step's host side (Python and the time spent inside torch calls), by own time:
    where a host-bound step's GPU waits come from. ``dump``: also write the whole profile there
    (``pstats`` format, for ``python3 -m pstats``)."""
    import cProfile
    import io
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    sync()
    if dump:
        os.makedirs(os.path.dirname(dump) or ".", exist_ok=True)
        prof.dump_stats(dump)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)  # which of our functions the host time sits under
    return "\n".join(line[:200] for line in out.getvalue().splitlines())


def gemm_table(prof, rows: int = 30) -> str:
    """Matrix products of the profiled step grouped by op and input shapes: calls, device ms, TFLOP/s."""
    out = []
    for e in prof.key_averages(group_by_input_shape=True):
        t = e.device_time_total if torch.cuda.is_available() else e.cpu_time_total
        if e.key not in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::_scaled_mm") or t <= 0:
            continue
        shapes = [s for s in e.input_shapes if s]
        a, b = (shapes[1], shapes[2]) if e.key.startswith("aten::addmm") else (shapes[0], shapes[1])
        if len(a) != 2 or len(b) != 2:
            continue
        flops = 2.0 * a[0] * a[1] * b[1] * e.count
        ms = t / 1e3
        out.append((ms, f"| {e.key} | {a[0]}x{a[1]} @ {b[0]}x{b[1]} | {e.count} | {ms:.1f} | {flops / ms / 1e9:.0f} |"))
    out.sort(key=lambda t: -t[0])
    total = sum(ms for ms, _ in out)
    return (f"GEMMs by shape ({total:.1f} ms in aten::mm/addmm/_scaled_mm)\n| op | shapes | calls | ms | TFLOP/s |\n"
            "|---|---|---|---|---|\n" + "\n".join(line for _, line in out[:rows]))


# --- worker: one stack, all its configurations ------------------------------------------------

def worker(stack: str, args) -> None:
    _, full, small = MODELS[args.model]
    shape = small if args.smoke else full
    deadline = args.deadline_at
    if stack.endswith("-auto") and torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.auto_budget_gib * GIB / total))

    def log(msg):
        print(msg, flush=True)

    def emit(row):
        print("RESULT " + json.dumps(row), flush=True)

    for weights in args.weights:
        row0 = dict(stack=stack, weights=weights)
        if time.time() > deadline - 20:
            for b, s in args.shapes:
                emit(dict(row0, shape=f"{b}x{s}", error="skipped: time budget"))
            continue
        t0 = time.perf_counter()
        try:
            model = prepare(stack, weights, shape, args, log)
        except Exception as err:  # noqa: BLE001 - a stack that does not run here is a row, not a crash
            for b, s in args.shapes:
                emit(dict(row0, shape=f"{b}x{s}", error=f"setup: {type(err).__name__}: {err}"[:300]))
            release()
            continue
        log(f"  {stack}/{weights}: ready in {time.perf_counter() - t0:.0f} s, "
            f"{torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else 0:.1f} GiB allocated")
        # Each shape starts from the same adapters (B = 0): its step-1 loss is comparable across stacks.
        initial = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]
        for b, s in args.shapes:
            row = dict(row0, shape=f"{b}x{s}")
            if time.time() > deadline - 10:
                emit(dict(row, error="skipped: time budget"))
                continue
            with torch.no_grad():
                for p, p0 in initial:
                    p.copy_(p0)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(4, shape["vocab_size"], (b, s), generator=g).to(device())
            batch = padded_batch(ids, g) if args.padded else dict(input_ids=ids, labels=ids)
            if args.padded:
                row["real_tokens"] = int(batch["attention_mask"].sum())  # tokens/s counts b x s
            step = Step(model, batch)
            try:
                row.update(measure(step, b * s, args.warmup, args.steps, args.gc))
                if stack.startswith("fasttune"):
                    from fasttune.model_patches.checkpointing import layer_checkpointing

                    state = layer_checkpointing(model)
                    decision = getattr(state, "decision", None)  # no local ref to the model
                    if decision is not None:
                        row["auto"] = str(decision)
                        log(f"    {row['auto']}")
                    if getattr(state, "stash", None) is not None:
                        row["stash"] = dataclasses.asdict(state.stash.stats)
                        link = state.stash.link
                        row["stash_link"] = {"rate_gib_s": link.rate and link.rate / 2**30,
                                             "layer_ms": link.layer_s and link.layer_s * 1e3}
                        log(f"    stash {row['stash']} link {row['stash_link']}")
                    if getattr(state, "checkpointer", None) is not None:
                        pool = state.checkpointer.pool  # allocations: pinned buffers made (each a cudaHostAlloc)
                        row["offload"] = dataclasses.asdict(state.checkpointer.stats)
                        row["host_pool"] = dict(allocations=pool.allocations, peak_gib=round(pool.peak_bytes_in_use / GIB, 2),
                                                held_gib=round(pool.bytes_total / GIB, 2))
                        log(f"    offload {row['offload']}; host pool {row['host_pool']}")
                    if getattr(state, "graphs", None) is not None:
                        row["graphs"] = dict(captures=state.graphs.captures, replays=state.graphs.replays)
                        bwd = state.graphs.backward
                        if bwd is not None:
                            row["graphs"]["backward"] = dict(captures=bwd.captures, replays=bwd.replays,
                                                             eager=sorted(bwd.logged))
                        log(f"    graphs {row['graphs']}; forward eager: {sorted(state.graphs.logged)}")
                    del state
                if stack in args.profile:
                    row["profile"] = profile(step, f"{stack}_{weights}_{b}x{s}", args.trace,
                                             steps=args.profile_steps)
                if stack in args.host_profile:
                    row["host_profile"] = host_profile(step, dump=os.path.join(
                        args.trace, f"{stack}_{weights}_{b}x{s}.pstats") if args.trace else None)
                    log(row["host_profile"])
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {err}"[:300]
                log(traceback.format_exc())
            del step
            model.zero_grad(set_to_none=True)
            release()
            emit(row)
        weight = weakref.ref(next(p for p in model.parameters() if not p.requires_grad))
        del model, initial
        release()
        if weight() is not None:  # the model outlived its last reference: say who holds it
            log(f"    LEAK: {stack}/{weights} base weights still alive after del + gc: "
                + "; ".join(sorted({type(r).__name__ for r in gc.get_referrers(weight())})))


# --- driver --------------------------------------------------------------------------------------

def run_stack(stack: str, args, deadline_at: float, log) -> list[dict]:
    left = deadline_at - time.time()
    expected = [dict(stack=stack, weights=w, shape=f"{b}x{s}") for w in args.weights for b, s in args.shapes]
    if left < 30:
        return [dict(r, error="skipped: time budget") for r in expected]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", stack, "--deadline-at", str(deadline_at),
           "--model", args.model, "--stacks", ",".join(args.all_stacks), "--weights", ",".join(args.weights),
           "--shapes", ",".join(f"{b}x{s}" for b, s in args.shapes), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--checkpointing", args.checkpointing, "--ckpt-dir", args.ckpt_dir or "",
           "--auto-budget-gib", str(args.auto_budget_gib),
           "--profile", ",".join(args.profile), "--profile-steps", str(args.profile_steps),
           "--host-profile", ",".join(args.host_profile)] \
        + (["--trace", args.trace] if args.trace else []) \
        + (["--smoke"] if args.smoke else []) + (["--no-lora-widen"] if args.no_lora_widen else []) \
        + (["--no-residual-norms"] if args.no_residual_norms else []) \
        + (["--reuse-forward-lora"] if args.reuse_forward_lora else []) \
        + ["--attention-stash", args.attention_stash] \
        + (["--mlp-stash"] if args.mlp_stash else []) \
        + ["--o-proj-stash", args.o_proj_stash] \
        + (["--no-grad-forward"] if args.no_grad_forward else []) \
        + (["--forward-graphs"] if args.forward_graphs else []) \
        + (["--backward-graphs"] if args.backward_graphs else []) \
        + ["--gc", args.gc] + (["--padded"] if args.padded else []) \
        + ([] if args.loss_workspace_mib is None else ["--loss-workspace-mib", str(args.loss_workspace_mib)]) \
        + ([] if args.memory_budget_gb is None else ["--memory-budget-gb", str(args.memory_budget_gb)])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1",
               PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    rows, tail = [], []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    killer = threading.Timer(max(1.0, deadline_at + 20 - time.time()), proc.kill)  # a hung worker too
    killer.start()
    try:
        for line in proc.stdout:
            if line.startswith("RESULT "):
                rows.append(json.loads(line[len("RESULT "):]))
                log(fmt_row(rows[-1]))
            elif line.startswith("  "):
                log(line.rstrip())
            tail = (tail + [line.rstrip()])[-15:]
        proc.wait()
    finally:
        killer.cancel()
    done = {(r["weights"], r["shape"]) for r in rows}
    why = f"worker exit {proc.returncode}: " + " | ".join(tail[-4:])[-300:]
    rows += [dict(r, error=why) for r in expected if (r["weights"], r["shape"]) not in done]
    return rows


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['stack']} | {r['weights']} | {r['shape']} | {r['error']} | | | |"
    b2b = f" (back to back {r['tokens_per_s_back_to_back']:,})" if "tokens_per_s_back_to_back" in r else ""
    return (f"| {r['stack']} | {r['weights']} | {r['shape']} | {r['ms']:.0f} | {r['tokens_per_s']:,}{b2b} "
            f"| {r['peak_gib']} / {r.get('peak_reserved_gib', '-')} | {r['loss_step1']} |")


def markdown(rows: list[dict], args) -> str:
    """Tokens/s and peak GiB per stack × weights, one column pair per shape, speed-ups vs hf and unsloth."""
    shapes = [f"{b}x{s}" for b, s in args.shapes]
    by = {(r["stack"], r["weights"], r["shape"]): r for r in rows}
    head = ("| stack | weights | " + " | ".join(f"{s} tok/s (× hf, × unsloth) | {s} peak GiB alloc / reserved" for s in shapes)
            + " | step-1 loss |")
    lines = [head, "|---|---|" + "---|---|" * len(shapes) + "---|"]
    for stack in args.stacks:
        for w in args.weights:
            cells, loss = [], ""
            for s in shapes:
                r = by.get((stack, w, s), {})
                if "tokens_per_s" not in r:
                    cells += [r.get("error", "-")[:60], ""]
                    continue
                ratios = [f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}×"
                          for ref in (by.get((base, w, s), {}) for base in ("hf", "unsloth")) if "tokens_per_s" in ref]
                x = f" ({', '.join(ratios)})" if ratios else ""
                cells += [f"{r['tokens_per_s']:,}{x}", f"{r['peak_gib']} / {r.get('peak_reserved_gib', '-')}"]
                loss = loss or str(r["loss_step1"])
            lines.append(f"| {stack} | {w} | " + " | ".join(cells) + f" | {loss} |")
    return "\n".join(lines)


def versions() -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("triton", "transformers", "peft", "bitsandbytes", "liger-kernel", "unsloth"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated subset of " + ", ".join(STACKS))
    p.add_argument("--model", default="llama3.1-8b", choices=list(MODELS),
                   help="the random-init shape: Llama-3.1-8B, Qwen2.5-7B (q/k/v biases) or Qwen3-8B (q/k norms)")
    p.add_argument("--weights", default=",".join(WEIGHTS), help="bf16, nf4 or both")
    p.add_argument("--shapes", default="4x2048,1x8192", help="batch x sequence, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, optimizer states)")
    p.add_argument("--checkpointing", default="offload", choices=("offload", "recompute", "auto"),
                   help="fasttune's checkpointing mode")
    p.add_argument("--auto-budget-gib", type=float, default=80.0,
                   help="GPU memory the fasttune-auto process may use (weights included)")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="auto stacks: FastConfig.memory_budget_gb, the activations' budget (default: free memory)")
    p.add_argument("--no-lora-widen", action="store_true",
                   help="fasttune stacks with FastConfig(lora_widen=False): the rank-r term as its own pass")
    p.add_argument("--attention-stash", nargs="?", const="on", default="default", choices=("default", "on", "off"),
                   help="fasttune offload/auto stacks with FastConfig(attention_stash=None, True or False); "
                        "bare: on")
    p.add_argument("--mlp-stash", action="store_true",
                   help="fasttune offload/auto stacks with FastConfig(mlp_stash=True)")
    p.add_argument("--o-proj-stash", default="default", choices=("default", "on", "off"),
                   help="fasttune offload/auto stacks with FastConfig(o_proj_stash=None, True or False)")
    p.add_argument("--no-grad-forward", action="store_true",
                   help="fasttune stacks with FastConfig(checkpoint_no_grad_forward=True) (on for dense families too)")
    p.add_argument("--forward-graphs", action="store_true",
                   help="fasttune stacks with FastConfig(checkpoint_forward_graphs=True) and the no-grad forward it needs")
    p.add_argument("--backward-graphs", action="store_true",
                   help="fasttune stacks with FastConfig(checkpoint_backward_graphs=True) and the forward graphs it needs")
    p.add_argument("--loss-workspace-mib", type=int, default=None,
                   help="fasttune stacks with FastConfig(loss_workspace_mib=N): the loss head's logit workspace")
    p.add_argument("--reuse-forward-lora", action="store_true",
                   help="fasttune stacks with FastConfig(reuse_forward_lora=True): each checkpointed layer's "
                        "recompute takes the LoRA products and casts its forward made")
    p.add_argument("--no-residual-norms", action="store_true",
                   help="fasttune stacks with FastConfig(residual_norms=False): the residual adds as their own kernels")
    p.add_argument("--padded", action="store_true",
                   help="right-padded rows (an SFT batch: lengths from half the sequence up, the first row full) "
                        "with an attention mask; tokens/s still counts the padding")
    p.add_argument("--gc", default="on", choices=("on", "freeze", "off"),
                   help="Python's garbage collector during the timed steps: on; freeze (gc.freeze() after the "
                        "warm-up: the model's objects leave the generations it scans); off")
    p.add_argument("--ckpt-dir", default=None,
                   help="where a worker saves the random model for unsloth ('' to skip; default "
                        "/tmp/fasttune_bench_step_llama8b, _qwen2.5-7b, _qwen3-8b, or with _smoke)")
    p.add_argument("--profile", nargs="?", const="fasttune", default="",
                   help="profile one extra step of these stacks (default when given: fasttune)")
    p.add_argument("--profile-steps", type=int, default=1,
                   help="profile this many extra steps back to back (a step-to-step stall shows in a few)")
    p.add_argument("--trace", help="also write Chrome traces of the profiled steps to this directory")
    p.add_argument("--host-profile", default="", help="cProfile one extra step of these stacks (host time by function)")
    p.add_argument("--budget-s", type=float, default=460.0, help="seconds for the whole run (workers stop after)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model: checks the script, measures nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.all_stacks = [s for s in args.stacks.split(",") if s]
    args.weights = [w for w in args.weights.split(",") if w]
    args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]
    args.profile = [s for s in args.profile.split(",") if s]
    args.host_profile = [s for s in args.host_profile.split(",") if s]
    if args.ckpt_dir is None:
        name = "llama8b" if args.model == "llama3.1-8b" else args.model
        args.ckpt_dir = f"/tmp/fasttune_bench_step_{'smoke_' + name if args.smoke else name}"
    bad = sorted(set(args.all_stacks + args.profile + args.host_profile) - set(STACKS)) + sorted(set(args.weights) - set(WEIGHTS))
    if bad:
        p.error(f"unknown stack/weights {bad}")
    if args.smoke and args.shapes == [(4, 2048), (1, 8192)]:
        args.shapes = [(2, 64), (1, 128)]
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    # hf first: it writes the checkpoint unsloth loads; unsloth last: the slowest to set up.
    args.stacks = sorted(args.all_stacks, key=lambda s: STACKS.index(s))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args)
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_step.py needs a CUDA GPU (or --smoke)")
    t0 = time.time()
    deadline_at = t0 + args.budget_s
    info = versions()

    def log(msg):
        print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)

    log(" ".join(f"{k}={v}" for k, v in info.items()))
    log("| stack | weights | shape | ms/step | tokens/s | peak GiB | step-1 loss |")
    rows = []
    for stack in args.stacks:
        rows += run_stack(stack, args, deadline_at, log)
    for r in rows:
        if "profile" in r:
            print(f"\n### profile {r['stack']} {r['weights']} {r['shape']}\n{r['profile']}")
    print("\n" + markdown(rows, args))
    print(f"\ntotal {time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"versions": info, "model": args.model, "smoke": args.smoke, "checkpointing": args.checkpointing,
                       "padded": args.padded, "rows": rows, "seconds": round(time.time() - t0, 1)}, f, indent=1)


if __name__ == "__main__":
    main()
