"""The 8B LoRA step of bench_step.py on N GPUs with DDP, FSDP2 and DeepSpeed ZeRO-3: tokens/s scaling vs 1 GPU.

Model and step as in ``bench_step.py`` (its builders are imported): random-init Llama-3.1-8B shape
in bf16 (``--weights nf4``: QLoRA, the decoder projections as bitsandbytes NF4 with the codes stored in
bf16, FSDP2's param dtype, so its policy casts nothing), LoRA r=16 on the seven projections, fasttune patched with "offload" checkpointing,
forward under bf16 autocast, backward, AdamW. Per GPU a micro-batch of ``--shape`` (4×2048) random
tokens; the global batch is N of them. Phases (``--modes``; zero3 only when named), one model build each:

  1gpu   rank 0 alone (the others wait): the global batch as N accumulated micro-batches, then the
         timed steps on one micro-batch (tokens/s of one GPU)
  ddp    DistributedDataParallel (find_unused_parameters=False, as FastTrainer sets it)
  fsdp2  fully_shard as accelerate lays it out: one unit per decoder layer, the embeddings, lm_head
         in a unit of its own (reshard_after_forward=False; the fused loss unshards it), the root;
         MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
  fsdp2-prefetch2  the same, each decoder layer all-gathering the next two layers' weights in
         backward (``set_modules_to_backward_prefetch``; FSDP2's implicit prefetch is one layer)
  fsdp2-gathered  fsdp2, then fasttune's ``keep_adapter_layers_gathered`` (FastTrainer does it at
         train begin): the LoRA layers stay all-gathered from forward to backward when they fit
         half the free memory (one all-gather per step instead of three)
  zero3  DeepSpeed ZeRO stage 3 as accelerate's zero3_init_flag leaves the model: partitioned
         (``zero.Init(module=...)``) before fasttune patches it, then ``deepspeed.initialize`` with
         bf16 on, no gradient clipping and a torch AdamW client optimizer (no compiled DeepSpeed
         ops); lm_head registered with the causal LM and the LoRA projections with their attention
         / MLP (``register_zero3_lm_head``, ``register_zero3_fused_lora``: what FastTrainer does at
         train begin), so the fused loss and fused LoRA run on gathered weights; the frozen weights
         left to DeepSpeed's per-module gathers (``zero3_keep_frozen_gathered=False``). Skipped,
         with the reason in its row, when deepspeed is not installed.
  zero3-gathered  zero3, then fasttune's ``keep_frozen_gathered_zero3`` (FastTrainer's default at train
         begin): the frozen weights kept gathered from their first use in a step to the optimizer
         step when they fit half the free memory (one all-gather each per step)

Loss check (before the timed steps, same weights in every phase): the global batch's loss (mean
over all its tokens: each rank's token sum over the global count), the global gradient norm, one
SGD step of L2 length ``--sgd-step`` along the gradient (the direction matters, unlike in Adam's
first step) and the same batch's loss again. Each must equal the 1-GPU phase's up to bf16 rounding (``--rtol``).
ZeRO-3 keeps the gradients in its partitions: the norm sums their local parts, and the SGD step is
its AdamW's first step with eps ≫ |g|, which is lr/eps × g.
Timed: median of ``--steps`` after ``--warmup``; tokens/s counts every rank's tokens;
scaling = tokens/s ÷ (N × tokens/s of 1 GPU).

Usage (H200s, repo root; < 5 minutes for N=2):
    torchrun --nproc_per_node 2 benchmarks/bench_multi_gpu.py --out $OUT/bench_multi_gpu.json
    accelerate launch --num_processes 2 benchmarks/bench_multi_gpu.py --out $OUT/bench_multi_gpu.json
    torchrun --nproc_per_node 2 benchmarks/bench_multi_gpu.py --modes 1gpu,zero3,zero3-gathered --out $OUT/zero3.json
    torchrun --nproc_per_node 2 benchmarks/bench_multi_gpu.py --weights nf4 --modes 1gpu,ddp,fsdp2,fsdp2-gathered
    torchrun --nproc_per_node 2 benchmarks/bench_multi_gpu.py --smoke    # CPU, gloo: checks the script
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fasttune's kernels are imported

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    from bench_step import LLAMA_8B, SMOKE, add_lora, build_base  # the 8B LoRA step's own builders
except ImportError:  # bench_step.py absent: the same model, built here
    LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False)
    SMOKE = dict(LLAMA_8B, vocab_size=1031, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)

    def build_base(shape: dict):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        cuda = torch.cuda.is_available()
        with torch.device("cuda" if cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **shape),
                                                     dtype=torch.bfloat16 if cuda else torch.float32,
                                                     attn_implementation="sdpa")
        return model.requires_grad_(False)

    def add_lora(model):
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"], task_type="CAUSAL_LM"))

GIB = 1 << 30
MODES = ("1gpu", "ddp", "fsdp2", "fsdp2-gathered", "fsdp2-prefetch2", "zero3", "zero3-gathered")
DEFAULT_MODES = ("1gpu", "ddp", "fsdp2", "fsdp2-gathered")  # zero3 on request: it needs deepspeed and another ~1.5 min
SGD_EPS = 1e6  # AdamW's first step with eps this large is SGD with lr / eps (|g| ≪ eps)


def param_dtype() -> torch.dtype:
    """FSDP2's MixedPrecisionPolicy param_dtype here (bf16 on GPUs), also the NF4 codes' storage."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


# --- models ----------------------------------------------------------------------------------------

def build(args, mode: str):
    """(the patched LoRA model, identical on every rank (seeded builders), in training mode; its
    patch report). ZeRO-3 partitions the weights before the patch, as a zero.Init load would."""
    from fasttune import FastConfig, patch_model

    base = build_base(SMOKE if args.smoke else LLAMA_8B)
    if args.weights == "nf4":  # QLoRA: codes stored in the dtype FSDP2's policy hands the layers (no cast)
        from bench_step import to_nf4

        to_nf4(base, quant_storage=param_dtype())
    model = add_lora(base)
    if mode.startswith("zero3"):
        import deepspeed

        deepspeed.zero.Init(module=model, config_dict_or_path=zero3_config(args))
    report = patch_model(model, FastConfig(checkpointing=args.checkpointing))
    if not report.patched["cross_entropy"]:
        raise RuntimeError(f"fused loss not installed: {report}")
    return model.train(), report


def zero3_config(args) -> dict:
    """accelerate's DeepSpeed ZeRO-3 settings, bf16 on GPUs; no clipping (the other phases do none)."""
    return {"train_micro_batch_size_per_gpu": args.shape[0], "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
            "bf16": {"enabled": torch.cuda.is_available()},
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}}


def zero3_engine(model, args, mode: str):
    """``deepspeed.initialize`` with a torch AdamW client optimizer; lm_head and the LoRA projections
    registered for the fused paths."""
    import deepspeed
    from fasttune.hf_integration.distributed import register_zero3_fused_lora, register_zero3_lm_head

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0,
                            fused=torch.cuda.is_available() or None)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=zero3_config(args))
    if not register_zero3_lm_head(engine):
        raise RuntimeError("lm_head is not a ZeRO-3 parameter: the fused loss would not run")
    log(f"zero3: LoRA projections registered with {register_zero3_fused_lora(engine)} attention/MLP modules")
    if mode == "zero3-gathered":  # FastConfig's default ("auto"); forced on the CPU smoke run
        from fasttune import FastConfig
        from fasttune.hf_integration.distributed import keep_frozen_gathered_zero3

        keep = None if torch.cuda.is_available() else True
        log(f"zero3-gathered: {keep_frozen_gathered_zero3(engine, FastConfig(zero3_keep_frozen_gathered=keep))} "
            "frozen parameters kept gathered")
    return engine


def wrap(model, mode: str, args):
    if mode.startswith("zero3"):
        return zero3_engine(model, args, mode)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        return DDP(model, device_ids=ids, find_unused_parameters=False, gradient_as_bucket_view=True)
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype(), reduce_dtype=torch.float32)
        base = model.get_base_model()
        layers = list(base.model.layers)
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
        if mode == "fsdp2-prefetch2":  # all-gather two layers ahead in backward (implicit: one)
            for i, layer in enumerate(layers):
                layer.set_modules_to_backward_prefetch(layers[max(0, i - 2):i][::-1])
        fully_shard(base.model.embed_tokens, mp_policy=mp)
        fully_shard(base.lm_head, mp_policy=mp, reshard_after_forward=False)
        model = fully_shard(model, mp_policy=mp)
        if mode == "fsdp2-gathered":  # what FastTrainer does at train begin (FastConfig's default: "auto")
            from fasttune import FastConfig
            from fasttune.hf_integration.distributed import keep_adapter_layers_gathered

            log(f"fsdp2-gathered: {keep_adapter_layers_gathered(model, FastConfig())} units kept gathered")
        return model
    return model


# --- batches and the loss check ------------------------------------------------------------------------

def global_batch(args, world: int, seed: int) -> torch.Tensor:
    b, s = args.shape
    vocab = (SMOKE if args.smoke else LLAMA_8B)["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (world * b, s), generator=g)


def backward(model, loss: torch.Tensor, mode: str) -> None:
    if mode.startswith("zero3"):
        model.backward(loss)  # the engine reduce-scatters the gradients into its partitions
    else:
        loss.backward()


def micro_loss(model, mode: str, ids: torch.Tensor, n_items: int, scale: float, grad: bool = True) -> torch.Tensor:
    """Token sum of ``ids`` over the global count ``n_items`` (× ``scale``), backward done (``grad``);
    returns it unscaled."""
    ids = ids.to(device())
    with torch.autocast(device().type, dtype=torch.bfloat16, enabled=torch.cuda.is_available()), \
            torch.set_grad_enabled(grad):
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(n_items, device=device())).loss
    if grad:
        backward(model, loss * scale, mode)
    return loss.detach().float()


def grad_sq(model, mode: str) -> torch.Tensor:
    """Sum of squared gradient entries held by this rank (float64)."""
    from torch.distributed.tensor import DTensor

    sq = torch.zeros((), device=device(), dtype=torch.float64)
    for p in model.parameters():
        if mode.startswith("zero3") and p.requires_grad:
            from deepspeed.utils import safe_get_local_grad

            sq += safe_get_local_grad(p).double().pow(2).sum()  # this rank's partition of the fp32 gradient
        elif p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq += g.double().pow(2).sum()
    return sq


def sgd_step(model, opt, mode: str, lr: float) -> None:
    """One SGD step of ``lr`` (ZeRO-3: its AdamW's first step with eps ≫ |g|, see module doc)."""
    if not mode.startswith("zero3"):
        opt.param_groups[0]["lr"] = lr
        opt.step()
        return
    saved = [dict(g) for g in model.optimizer.param_groups]
    for g in model.optimizer.param_groups:
        g.update(lr=lr * SGD_EPS, eps=SGD_EPS)
    model.step()
    for g, old in zip(model.optimizer.param_groups, saved):
        g.update(lr=old["lr"], eps=old["eps"])


def loss_check(model, mode: str, args, world: int) -> dict:
    """Loss and gradient norm of a global batch, one SGD step, its loss again (see module doc)."""
    rank = dist.get_rank()
    b = args.shape[0]
    out = {}
    opt = None if mode.startswith("zero3") else torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                                                lr=0.0)
    ids = global_batch(args, world, 1)
    n_items = ids.shape[0] * (ids.shape[1] - 1)
    for key in ("loss", "loss_after_sgd"):
        grad = key == "loss" or not mode.startswith("zero3")  # ZeRO-3: no gradient to clear after the second loss
        if mode == "1gpu":  # the whole global batch here, as `world` accumulated micro-batches
            loss = sum(micro_loss(model, mode, ids[r * b:(r + 1) * b], n_items, 1.0) for r in range(world))
        else:  # DDP/FSDP/ZeRO average the gradients: scale by the world size, as transformers does
            loss = micro_loss(model, mode, ids[rank * b:(rank + 1) * b], n_items, float(world), grad)
            dist.all_reduce(loss)
        out[key] = float(loss)
        if key == "loss":
            sq = grad_sq(model, mode)
            if mode.startswith("fsdp2") or mode.startswith("zero3"):
                dist.all_reduce(sq)  # shards: sum of squares over ranks
            out["grad_norm"] = math.sqrt(float(sq))
            sgd_step(model, opt, mode, args.sgd_step / max(out["grad_norm"], 1e-12))
        if opt is not None:
            opt.zero_grad(set_to_none=True)
    return out


# --- timing ----------------------------------------------------------------------------------------

def timed(model, mode: str, args, world: int) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = torch.cuda.is_available() and not mode.startswith("fsdp2")  # fused AdamW on plain tensors; foreach on DTensors
    opt = None if mode.startswith("zero3") else torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0,
                                                                  fused=fused or None)
    b, s = args.shape
    ids = global_batch(args, world, 3)[dist.get_rank() * b:(dist.get_rank() + 1) * b].to(device())

    def step():
        with torch.autocast(device().type, dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
            loss = model(input_ids=ids, labels=ids).loss
        backward(model, loss, mode)
        if mode.startswith("zero3"):
            model.step()  # the engine's AdamW on its partitions; zeroes the gradients
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if mode != "1gpu":
            dist.barrier()  # time the step every rank takes together
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    gpus = 1 if mode == "1gpu" else world
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")
    return dict(gpus=gpus, ms=round(ms, 1), tokens_per_s=round(gpus * b * s / (ms / 1e3)), peak_gib=round(peak, 2))


def run_mode(mode: str, args, world: int) -> dict:
    row = dict(mode=mode)
    if mode == "1gpu" and dist.get_rank() != 0:
        return row
    if mode.startswith("zero3") and importlib.util.find_spec("deepspeed") is None:
        row["error"] = "skipped: deepspeed is not installed"
        return row
    if mode.startswith("zero3") and args.weights == "nf4":
        row["error"] = "skipped: NF4 bases under ZeRO-3 are not measured by this script"
        return row
    t0 = time.perf_counter()
    try:
        model, report = build(args, mode)
        row["patched"] = dict(report.patched)
        row["fallbacks"] = sorted({f"{fb.op}: {fb.reason}" for fb in report.fallbacks})
        model = wrap(model, mode, args)
        row["setup_s"] = round(time.perf_counter() - t0, 1)
        row.update(loss_check(model, mode, args, world))
        row.update(timed(model, mode, args, world))
    except Exception as err:  # noqa: BLE001 - reported as the mode's row (a failing rank may leave others waiting)
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    model = None
    release()
    return row


def compare(rows: list[dict], args) -> None:
    """Scaling and loss agreement of each distributed row against the 1-GPU row (in place)."""
    ref = next((r for r in rows if r["mode"] == "1gpu" and "error" not in r), None)
    if ref is None:
        return
    for r in rows:
        if r["mode"] == "1gpu" or "error" in r:
            continue
        r["scaling"] = round(r["tokens_per_s"] / (r["gpus"] * ref["tokens_per_s"]), 3)
        diffs = {k: abs(r[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm", "loss_after_sgd")}
        r["rel_diff_vs_1gpu"] = {k: float(f"{v:.2e}") for k, v in diffs.items()}
        r["loss_matches_1gpu"] = all(v <= args.rtol for v in diffs.values())


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | GPUs | ms/step | tokens/s | scaling | peak GiB | loss | grad norm | loss after SGD | = 1 GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | error: {r['error']} |||||||||")
            continue
        lines.append(f"| {r['mode']} | {r['gpus']} | {r['ms']} | {r['tokens_per_s']:,} | {r.get('scaling', '-')} | "
                     f"{r['peak_gib']} | {r['loss']:.5f} | {r['grad_norm']:.4g} | {r['loss_after_sgd']:.5f} | "
                     f"{r.get('loss_matches_1gpu', '-')} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated subset of " + ", ".join(MODES) + " (default: %(default)s)")
    p.add_argument("--shape", default="4x2048", help="per-GPU micro-batch, rows x sequence length")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpointing", default="offload", choices=("offload", "recompute", "auto"))
    p.add_argument("--weights", default="bf16", choices=("bf16", "nf4"),
                   help="the frozen bases: bf16, or NF4 codes (QLoRA) stored in the FSDP2 param dtype")
    p.add_argument("--sgd-step", type=float, default=1.0, help="L2 length of the loss check's SGD update")
    p.add_argument("--rtol", type=float, default=2e-2, help="loss/grad-norm agreement with 1 GPU (bf16 rounding)")
    p.add_argument("--budget-s", type=float, default=270.0, help="modes not started by then are skipped")
    p.add_argument("--out", help="write the results as JSON here (rank 0)")
    p.add_argument("--smoke", action="store_true", help="tiny model (CPU/gloo or GPU): checks the script")
    p.add_argument("--one-rank", action="store_true", help="run the distributed modes on a world of one too: "
                   "the wrappers' code paths on one GPU (nothing sharded, no scaling measured)")
    args = p.parse_args(argv)
    args.modes = [m for m in MODES if m in args.modes.split(",")]
    b, s = args.shape.lower().split("x")
    args.shape = (int(b), int(s)) if not args.smoke or args.shape != "4x2048" else (2, 64)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_multi_gpu.py needs CUDA GPUs (or --smoke)")
    t_start = time.time()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" not in os.environ:  # not under torchrun / accelerate launch: one process, the 1-GPU row only
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=8))
    world = dist.get_world_size()
    import peft
    import transformers

    info = dict(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                world_size=world, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                shape=f"{args.shape[0]}x{args.shape[1]}", checkpointing=args.checkpointing, weights=args.weights,
                smoke=args.smoke)
    log(" ".join(f"{k}={v}" for k, v in info.items()))
    rows = []
    for mode in args.modes:
        if mode != "1gpu" and world == 1 and not args.one_rank:
            continue
        go = torch.tensor(int(time.time() - t_start < args.budget_s), device=device())  # NCCL: on the GPU
        dist.broadcast(go, 0)  # every rank skips or runs the same modes
        if not go:
            rows.append(dict(mode=mode, error="skipped: time budget"))
            continue
        row = run_mode(mode, args, world)
        every = [None] * world
        dist.all_gather_object(every, row)
        errors = [f"rank {r}: {x['error']}" for r, x in enumerate(every) if "error" in x]
        if errors:  # any rank's error is the row's
            row = dict(mode=mode, error="; ".join(errors)[:400])
        rows.append(row)
        log(f"[{time.time() - t_start:5.0f} s] {json.dumps(row)}")
    if dist.get_rank() == 0:
        compare(rows, args)
        print("\n" + markdown(rows) + f"\n\ntotal {time.time() - t_start:.0f} s", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"versions": info, "rows": rows, "seconds": round(time.time() - t_start, 1)}, f, indent=1)
    dist.barrier()  # leave together: a rank tearing down early can abort the others' transport
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
