"""TRL's DPO and GRPO steps on fasttune's fused head vs stock TRL, Llama-3.1-8B-shaped LoRA model (H200).

One training step = what TRL's trainer runs per batch, on fixed sequences (no generation, no
optimizer): the policy forward through the fused LM head (``model(..., labels, fused_lm_head=True)``),
for DPO also the reference forward under no_grad (LoRA adapters disabled, as TRL does with PEFT),
TRL's default loss (DPO "sigmoid", GRPO "dapo" with one iteration so old = current log-probs,
β = 0), the metrics TRL reads from the head (entropy, mean logits, top-1 for DPO), and backward.
Model: random-init bf16 Llama-3.1-8B shape (V = 128,256), LoRA r=16 on all 7 projections,
activation checkpointing on. DPO: 2 pairs × 2,048 tokens (prompt 512); GRPO: 8 completions of
up to 1,024 tokens after a 512-token prompt, temperature 0.7.

Stacks (each row of the table):
  trl-logits        TRL's head disabled: full [tokens, vocab] logits, then TRL's
                    ``selective_log_softmax_and_entropy`` (its path before the fused head), HF checkpointing
  trl-fused         stock TRL 1.15/1.16: its chunked fused LM head (``add_fused_lm_head``), HF checkpointing
  fasttune-head     fasttune's head answering TRL's calls (what FastPatchCallback adds), other layers stock
  fasttune          FastDPOTrainer/FastGRPOTrainer: every fasttune kernel, fasttune "recompute" checkpointing
  trl-fused+liger   ``use_liger_kernel=True`` as TRL 1.15/1.16 applies it: Liger's RMSNorm/RoPE/SwiGLU with
                    TRL's fused head (TRL now forces Liger's fused cross-entropy off and no longer wires
                    Liger's DPO/GRPO losses). Runs last: Liger patches transformers' llama module globally.
Columns: median ms per step, tokens/s, peak GPU memory (GiB, weights included) and the loss and
LoRA-gradient relative differences from trl-fused (a correctness check on the same inputs).

Usage (H200, repo root; trl 1.15.0, datasets and liger-kernel from the carried wheels):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/trl-*.whl .whl/datasets-*.whl \\
        .whl/liger_kernel-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl && export PYTHONPATH=/tmp/site
    python3 benchmarks/bench_trl.py --out $OUT/bench_trl.json        # < 3 minutes
    python3 benchmarks/bench_trl.py --smoke                          # tiny model, CPU or GPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fasttune's kernels are imported

import torch.nn.functional as F  # noqa: E402

GIB = 1 << 30
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 17,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=3)
SMOKE = dict(LLAMA_8B, vocab_size=1031, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STACKS = ("trl-fused", "trl-logits", "fasttune-head", "fasttune", "trl-fused+liger")
HEAD_ONLY = dict(rms_norm=False, rope=False, mlp=False, lora=False)


# --- model and batches --------------------------------------------------------------------------

def build_model(shape: dict, device: str, dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    with torch.no_grad():  # B ≠ 0: the policy differs from the reference and every LoRA gradient is generic
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)
    model.train()
    return model


def batches(vocab: int, device: str, smoke: bool) -> dict[str, dict]:
    g = torch.Generator().manual_seed(1)
    pairs, dpo_len, prompt = (2, 64, 16) if smoke else (2, 2048, 512)
    n, completion = (4, 32) if smoke else (8, 1024)
    ids = torch.randint(4, vocab, (2 * pairs, dpo_len), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = -100
    dpo = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    ids = torch.randint(4, vocab, (n, prompt + completion), generator=g)
    lengths = torch.randint(completion // 4, completion + 1, (n,), generator=g)
    valid = torch.arange(prompt + completion)[None] < (prompt + lengths)[:, None]
    labels = ids.masked_fill(~valid, -100)
    labels[:, :prompt] = -100
    grpo = dict(input_ids=ids, attention_mask=valid.long(), labels=labels,
                advantages=torch.randn(n, generator=g))
    to = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return {"dpo": to(dpo), "grpo": to(grpo)}


# --- the log-probability providers --------------------------------------------------------------

def fused_head(model, batch, temperature):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                fused_lm_head=True)
    return {k: getattr(out, k) for k in ("log_probs", "entropy", "mean_logits", "is_top1")}


def full_logits(model, batch, temperature):
    from trl.trainer.utils import selective_log_softmax_and_entropy

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    y = batch["labels"][:, 1:]
    mask = y != -100
    logp, ent = selective_log_softmax_and_entropy(logits, y.clamp(min=0), entropy_requires_grad=False,
                                                  temperature=temperature, row_mask=mask)
    with torch.no_grad():
        mean = logits.mean(-1, dtype=torch.float32) / temperature
        top1 = (logits.argmax(-1) == y) & mask
    return {"log_probs": logp * mask, "entropy": ent, "mean_logits": mean, "is_top1": top1}


# --- the steps (TRL's default losses and metrics) ------------------------------------------------

def dpo_step(model, batch, provider, beta=0.1):
    mask = batch["labels"][:, 1:] != -100
    out = provider(model, batch, 1.0)
    with torch.no_grad(), model.disable_adapter():
        ref = provider(model, batch, 1.0)["log_probs"].sum(1)
    chosen, rejected = out["log_probs"].sum(1).chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    loss = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
    loss.backward()
    # The metrics TRL logs from the head's outputs (one host sync each, as there).
    n = mask.sum()
    _ = [(out["entropy"].detach() * mask).sum() / n, (out["mean_logits"] * mask).sum() / n,
         (out["is_top1"] & mask).sum() / n]
    return float(loss.detach()), [float(x) for x in _]


def grpo_step(model, batch, provider, temperature=0.7):
    mask = (batch["labels"][:, 1:] != -100).float()
    out = provider(model, batch, temperature)
    logp = out["log_probs"]
    ratio = torch.exp(logp - logp.detach())  # num_iterations = 1: old log-probs are the current ones
    per_token = -ratio * batch["advantages"][:, None]
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1)  # "dapo"
    loss.backward()
    return float(loss.detach()), [float((out["entropy"].detach() * mask).sum() / mask.sum())]


# --- stacks --------------------------------------------------------------------------------------

def setup(stack: str, model, task: str, temperature: float):
    """Put ``model`` in ``stack``'s configuration; returns the provider and an undo."""
    import trl
    from trl.trainer.utils import add_fused_lm_head

    from fasttune import FastConfig, patch_model, unpatch_model
    from fasttune.hf_integration.trl import trl_head_settings
    from fasttune.model_patches.head import configure_trl_head

    base = model.get_base_model()
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(output_dir=tmp, report_to=[], bf16=False)
        cfg = trl.DPOConfig(**kw) if task == "dpo" else trl.GRPOConfig(temperature=temperature, **kw)
    settings = trl_head_settings(cfg)
    hf_ckpt = stack != "fasttune"
    if stack == "trl-fused+liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=base, fused_linear_cross_entropy=False)
    if stack != "trl-logits":
        add_fused_lm_head(base, temperature=settings.temperature, outputs=settings.outputs)
    if stack.startswith("fasttune"):
        extra = HEAD_ONLY if stack == "fasttune-head" else dict(checkpointing="recompute")
        report = patch_model(model, FastConfig(**extra))
        assert configure_trl_head(base, settings), report
    if hf_ckpt:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def undo():
        if hf_ckpt:
            base.gradient_checkpointing_disable()
        unpatch_model(model)
        base.__dict__.pop("forward", None)  # TRL's head

    return (full_logits if stack == "trl-logits" else fused_head), undo


def lora_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])


def measure(model, step, batch, provider, steps: int) -> dict:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    model.zero_grad(set_to_none=True)
    loss, _ = step(model, batch, provider)  # warm-up: Triton compiles and autotunes here
    grads = lora_grads(model)
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step(model, batch, provider)
        sync()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")
    tokens = int(batch["attention_mask"].sum())
    ms = statistics.median(times) * 1e3
    return dict(ms=ms, tokens_per_s=tokens / (ms / 1e3), peak_gib=peak, loss=loss, grads=grads)


def run(args) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = SMOKE if args.smoke else LLAMA_8B
    start = time.perf_counter()
    model = build_model(shape, device, dtype)
    data = batches(shape["vocab_size"], device, args.smoke)
    steps = {"dpo": dpo_step, "grpo": grpo_step}
    rows, reference = [], {}
    for stack in args.stacks:
        for task in args.tasks:
            row = dict(task=task, stack=stack)
            rows.append(row)
            row.update(run_row(stack, task, model, data[task], steps[task], reference, args, start))
            print(fmt_row(row), flush=True)
    return rows


def run_row(stack, task, model, batch, step, reference, args, start) -> dict:
    if time.perf_counter() - start > args.budget_s:
        return {"error": "skipped: time budget"}
    try:
        provider, undo = setup(stack, model, task, 0.7)
    except Exception as err:  # a peer that does not install here is a row, not a crash
        return {"error": f"{type(err).__name__}: {err}"[:160]}
    try:
        result = measure(model, step, batch, provider, args.steps)
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as err:  # e.g. a peer's kernel failing on this stack: report, go on
        return {"error": f"{type(err).__name__}: {err}"[:160]}
    finally:
        undo()
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    grads = result.pop("grads")
    if stack == "trl-fused":
        reference[task] = (result["loss"], grads)
    if task in reference:
        ref_loss, ref_grads = reference[task]
        result["loss_rel"] = abs(result["loss"] - ref_loss) / max(abs(ref_loss), 1e-30)
        result["grad_rel"] = float((grads - ref_grads).norm() / ref_grads.norm().clamp(min=1e-30))
    return result


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['task']} | {r['stack']} | {r['error']} | | | | |"
    rel = lambda k: f"{r[k]:.1e}" if k in r else "n/a"  # noqa: E731
    return (f"| {r['task']} | {r['stack']} | {r['ms']:.0f} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | "
            f"{rel('loss_rel')} | {rel('grad_rel')} |")


def versions() -> dict:
    import importlib.metadata as md

    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("triton", "transformers", "peft", "trl", "liger-kernel"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated subset of " + ", ".join(STACKS))
    p.add_argument("--tasks", default="dpo,grpo")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up)")
    p.add_argument("--budget-s", type=float, default=140.0, help="start no row after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny model: checks the script, measures nothing")
    args = p.parse_args()
    args.stacks = [s for s in args.stacks.split(",") if s]
    args.tasks = [t for t in args.tasks.split(",") if t]
    bad = sorted(set(args.stacks) - set(STACKS)) + sorted(set(args.tasks) - {"dpo", "grpo"})
    if bad:
        p.error(f"unknown stack/task {bad}")
    # trl-fused first (the reference of the Δ columns); Liger patches transformers' llama module
    # globally, so it comes last.
    args.stacks.sort(key=lambda s: (s != "trl-fused", s == "trl-fused+liger"))
    info = versions()
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    print("| task | stack | ms/step | tokens/s | peak GiB | loss Δrel | LoRA grad Δrel |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"versions": info, "smoke": args.smoke, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
