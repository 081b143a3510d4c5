"""FP8 base matmuls against bf16, side by side: loss curves, held-out metric, per-projection error.

Issue #20's quality check of ``FastConfig(base_dtype="fp8")``, with no download:

1. A base model with structure. A random-init Llama-shaped model (``--preset gpu``: 12 layers,
   2048 wide, 5632 MLP, GQA 16/4 heads: 0.54B parameters) is fully trained (fp32 weights, bf16
   autocast on a GPU) on the embedded task (fasttune/embedded.py), ``shift: cab = dbc``; the log
   line says how well it learnt it (held-out exact match). Then its weights go to bf16 (fp32 on a CPU).
2. The fine-tune. LoRA r=16 on all seven projections, one new task (``shift2: cab = ecd``),
   ``--lora-steps`` (200) AdamW steps on the same batches in the same order, from the same
   adapter initialisation, once with the 16-bit bases (``base_dtype="auto"``) and once with FP8
   bases (``"fp8"``); a third run with the 16-bit bases and another adapter seed shows the
   run-to-run noise floor. The loss is logged as the mean of each 10 steps. ``--seeds N`` runs
   every arm with N adapter seeds: gaps are paired by seed and averaged, the 16-bit runs of
   consecutive seeds give the noise floor. ``--variants`` adds diagnostic FP8 runs that leave
   quantisations out (``VARIANTS``: dY, X, or both), to tell which one moves the curve.
3. Printed: the loss table, the max relative loss gap fp8 vs bf16 at the logged steps (target
   ≤ 1%), two held-out metrics on words never trained on, before and after, for each run
   (target: within 1 point): exact match of the greedy completion and the teacher-forced accuracy
   of the completion tokens; how the FP8 calls ran (``torch._scaled_mm`` or the
   reference), and each projection's output and dX error against float64 on real activations of
   the trained base, FP8 beside bf16.

Limits: the base is trained here from random weights for a few hundred steps; a pretrained LLM's
activations carry outlier features that per-row scaling of X meets differently. The seq lengths
are short (~30 tokens): the products' shapes, not the data, are 8B-like in width only.

Usage (H200, repo root; ≤ 4 minutes):
    python3 benchmarks/fp8_quality.py --out $OUT/fp8_quality.json
    python3 benchmarks/fp8_quality.py --seeds 3 --variants fp8,fp8-fwd,fp8-w   # seed spread, ablations
    python3 benchmarks/fp8_quality.py --preset cpu      # the same on a CPU (the FP8 reference path)
    python3 benchmarks/fp8_quality.py --preset cpu-wide # a 4-layer, 256-wide base on a CPU
    python3 benchmarks/fp8_quality.py --preset smoke    # checks the script in seconds
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import math
import random
import statistics
import sys
import time

import torch

PRESETS = {
    "gpu": dict(hidden=2048, layers=12, heads=16, kv_heads=4, inter=5632, pre_steps=800, pre_lr=5e-4,
                lora_steps=200, lr=1e-3, batch=64, eval_rows=256),
    "cpu": dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=384, pre_steps=600, pre_lr=3e-3,
                lora_steps=200, lr=3e-3, batch=32, eval_rows=128),
    "cpu-wide": dict(hidden=256, layers=4, heads=4, kv_heads=2, inter=768, pre_steps=600, pre_lr=3e-3,
                     lora_steps=200, lr=3e-3, batch=32, eval_rows=128),
    "smoke": dict(hidden=64, layers=1, heads=2, kv_heads=1, inter=128, pre_steps=4, pre_lr=3e-3,
                  lora_steps=20, lr=3e-3, batch=8, eval_rows=8),
}
PRE_TASKS = ("shift",)  # one task: a 2-layer model learns it in 600 steps (two did not, measured)
LORA_TASK = "shift2"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOG_EVERY = 10


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- data ------------------------------------------------------------------------------------------

def apply(task: str, word: str) -> str:
    from fasttune.embedded import LETTERS

    k = {"shift": 1, "shift2": 2}[task]
    return "".join(LETTERS[(LETTERS.index(c) + k) % 26] for c in word)


def make_rows(tasks, n: int, seed: int, exclude: set[str] = frozenset()) -> list[dict[str, str]]:
    from fasttune.embedded import LETTERS

    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8)))
        if word in exclude:
            continue
        task = rng.choice(tasks)
        rows.append({"prompt": f"{task}: {word} =", "completion": " " + apply(task, word), "word": word})
    return rows


class Batches:
    """The same batches, in the same order, for every run (a seeded sampler over encoded rows)."""

    def __init__(self, tokenizer, rows, batch: int, seed: int):
        from fasttune.embedded import PadCollator, TaskDataset

        self.data = TaskDataset(tokenizer, rows)
        self.collate = PadCollator(tokenizer.pad_token_id)
        self.batch, self.seed = batch, seed

    def __iter__(self):
        rng = random.Random(self.seed)
        while True:
            idx = rng.sample(range(len(self.data)), self.batch)
            yield {k: v.to(device()) for k, v in self.collate([self.data[i] for i in idx]).items()}


# --- model and training -----------------------------------------------------------------------------

def build_base(tokenizer, p: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=p["hidden"], intermediate_size=p["inter"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["kv_heads"], max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    with torch.device(device()):
        return LlamaForCausalLM(config)


def train(model, batches, steps: int, lr: float) -> list[tuple[int, float]]:
    """AdamW with warm-up and cosine decay; (step, mean loss of the last LOG_EVERY steps) rows."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device() == "cuda" or None)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    model.train()
    logged, window = [], []
    for step, batch in zip(range(steps), batches):
        with torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window.append(loss.item())
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            logged.append((step + 1, statistics.fmean(window)))
            window = []
    return logged


def exact_match(model, tokenizer, rows) -> float:
    from fasttune.embedded import exact_match as em

    with torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
        return em(model, tokenizer, rows, batch_size=128)


@torch.no_grad()
def token_accuracy(model, tokenizer, rows) -> float:
    """Teacher-forced accuracy of the completion tokens (the answer letters and the end token)."""
    from fasttune.embedded import PadCollator, TaskDataset

    data, collate = TaskDataset(tokenizer, rows), PadCollator(tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    hits = total = 0
    for s in range(0, len(data), 128):
        batch = {k: v.to(device()) for k, v in collate([data[i] for i in range(s, min(s + 128, len(data)))]).items()}
        labels = batch.pop("labels")
        with torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
            logits = model(**batch).logits
        pred, want = logits[:, :-1].argmax(-1), labels[:, 1:]
        mask = want != -100
        hits += int((pred[mask] == want[mask]).sum())
        total += int(mask.sum())
    model.train(was_training)
    return hits / max(total, 1)


VARIANTS = {
    "fp8": "as shipped: X and dY quantised per row, W as e4m3 codes",
    "fp8-fwd": "forward as shipped; dX = dY W of the dequantised codes, dY not quantised",
    "fp8-bwd": "backward as shipped; Y = X Wᵀ of the dequantised codes, X not quantised",
    "fp8-w": "the weight's codes only; X and dY not quantised, products of the dequantised codes",
}


@contextlib.contextmanager
def fp8_products(variant: str, calls: collections.Counter):
    """Run the FP8 bases as ``variant`` (VARIANTS), counting the products that ran. An ablation of
    this benchmark only: the diagnostic variants swap fasttune's FP8 product functions, as the fused
    LoRA path and ``fp8_linear`` look them up, for the dequantised-weight products, and put them back."""
    from fasttune.kernels import fp8 as fp8_module
    from fasttune.kernels import lora as lora_module

    modules = (fp8_module, lora_module)
    shipped = {m: (m.forward_product, m.grad_input_product) for m in modules}

    def forward(x2, w, xq=None):
        calls["forward"] += 1
        if variant in ("fp8-w", "fp8-bwd"):  # exact in x2's dtype: e4m3 codes times a power of two fit bf16
            return x2 @ w.dequantize(x2.dtype).t()
        return shipped[fp8_module][0](x2, w, xq)

    def grad_input(dy, w):
        calls["grad_input"] += 1
        if variant in ("fp8-w", "fp8-fwd"):
            return dy @ w.dequantize(dy.dtype)
        return shipped[fp8_module][1](dy, w)

    for m in modules:
        m.forward_product, m.grad_input_product = forward, grad_input
    try:
        yield
    finally:
        for m in modules:
            m.forward_product, m.grad_input_product = shipped[m]


def lora_run(base, tokenizer, train_rows, eval_rows, p, variant: str | None, adapter_seed: int, log) -> dict:
    """One LoRA fine-tune from ``base``: 16-bit bases (``variant`` None) or FP8 ones (VARIANTS)."""
    from peft import LoraConfig, get_peft_model

    from fasttune import FastConfig, patch_model

    model = copy.deepcopy(base)
    torch.manual_seed(adapter_seed)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                             task_type="CAUSAL_LM"))
    report = patch_model(model, FastConfig(base_dtype="auto" if variant is None else "fp8"))
    if variant is not None:
        missing = [t for t in LORA_TARGETS if report.patched["fp8_" + t] != p["layers"]]
        if missing:
            raise RuntimeError(f"FP8 bases missing on {missing}: {report}")
    calls = collections.Counter()
    with fp8_products(variant or "fp8", calls):
        before, acc_before = exact_match(model, tokenizer, eval_rows), token_accuracy(model, tokenizer, eval_rows)
        t0 = time.perf_counter()
        losses = train(model, iter(Batches(tokenizer, train_rows, p["batch"], seed=11)), p["lora_steps"], p["lr"])
        seconds = time.perf_counter() - t0
        after, acc_after = exact_match(model, tokenizer, eval_rows), token_accuracy(model, tokenizer, eval_rows)
    if variant is not None and not (calls["forward"] and calls["grad_input"]):
        raise RuntimeError(f"{variant}: the FP8 products did not run ({dict(calls)})")
    if variant is None and calls:
        raise RuntimeError(f"16-bit bases ran FP8 products ({dict(calls)})")
    lines, _ = report.call_summary()
    fp8_calls = [line for line in lines if line.startswith("fp8_")]
    log(f"  {variant or '16-bit'} bases (adapter seed {adapter_seed}): {seconds:.1f} s, exact match "
        f"{before:.1%} -> {after:.1%}, token accuracy {acc_before:.1%} -> {acc_after:.1%}"
        + ("".join(f"\n    {c}" for c in fp8_calls[:2])))
    del model
    release()
    return dict(adapter_seed=adapter_seed, losses=losses, exact_match_before=before, exact_match_after=after,
                token_accuracy_before=acc_before, token_accuracy_after=acc_after, seconds=round(seconds, 1),
                fp8_calls=fp8_calls, product_calls=dict(calls))


def release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- per-projection error --------------------------------------------------------------------------

@torch.no_grad()
def projection_errors(base, batch) -> list[dict]:
    """Per projection (layers pooled): ‖Y − Y64‖/‖Y64‖ and ‖dX − dX64‖/‖dX64‖ in bf16 (or the
    base's dtype) and with FP8 bases, on the inputs one forward of the trained base gives them
    (dY random Gaussian)."""
    from fasttune.kernels.fp8 import Fp8Weight, forward_product, grad_input_product

    inputs: dict[str, list] = {t: [] for t in LORA_TARGETS}
    hooks = []
    for name, module in base.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in inputs:
            hooks.append(module.register_forward_pre_hook(lambda m, args, leaf=leaf: inputs[leaf].append(
                (args[0].detach().reshape(-1, args[0].shape[-1]), m.weight))))
    base.eval()
    with torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
        base(**{k: v for k, v in batch.items() if k != "labels"})
    for h in hooks:
        h.remove()
    rows = []
    g = torch.Generator(device=device()).manual_seed(0)
    for leaf, pairs in inputs.items():
        errs = {"y_16": [], "y_fp8": [], "dx_16": [], "dx_fp8": []}
        for x, w in pairs:
            dt = w.dtype
            x = x.to(dt)
            fw = Fp8Weight.quantize(w)
            dy = torch.randn(x.shape[0], w.shape[0], device=x.device, generator=g).to(dt)
            y64, dx64 = x.double() @ w.double().t(), dy.double() @ w.double()
            rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
            errs["y_16"].append(rel(x @ w.t(), y64))
            errs["y_fp8"].append(rel(forward_product(x, fw), y64))
            errs["dx_16"].append(rel(dy @ w, dx64))
            errs["dx_fp8"].append(rel(grad_input_product(dy, fw), dx64))
        rows.append(dict(projection=leaf, **{k: statistics.fmean(v) for k, v in errs.items()}))
    return rows


# --- comparison --------------------------------------------------------------------------------------

def paired_gaps(ref_runs: list[dict], runs: list[dict]) -> list[list[float]]:
    """Per run of ``runs`` with a same-seed run in ``ref_runs``: its signed relative loss gap at each
    logged step (positive: a higher loss than the reference's)."""
    ref = {r["adapter_seed"]: r for r in ref_runs}
    return [[(lb - la) / la for (_, la), (_, lb) in zip(ref[r["adapter_seed"]]["losses"], r["losses"])]
            for r in runs if r["adapter_seed"] in ref]


def seed_gaps(runs: list[dict]) -> list[list[float]]:
    """The run-to-run noise: relative loss gaps between 16-bit runs of consecutive adapter seeds."""
    return [[abs(lb - la) / la for (_, la), (_, lb) in zip(a["losses"], b["losses"])] for a, b in zip(runs, runs[1:])]


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _points(ref_runs, runs, key: str) -> float:
    """Mean over same-seed pairs of the held-out metric's difference, in points."""
    ref = {r["adapter_seed"]: r[key] for r in ref_runs}
    return 100 * statistics.fmean(r[key] - ref[r["adapter_seed"]] for r in runs)


def compare(runs: dict[str, list[dict]], label16: str) -> dict:
    """Print the loss table and held-out metrics of every variant against the 16-bit runs; the summary."""
    ref, variants = runs["bf16"], [v for v in runs if v != "bf16"]
    noise = seed_gaps(ref)
    n = min(len(runs[v]) for v in variants) if variants else 0
    head = f"| step | {label16} (mean of {len(ref)}) |"
    for v in variants:
        head += f" {v} (mean of {len(runs[v])}) | {v} gap, mean" + (" ± sd |" if n > 1 else " |")
    if noise:
        head += f" {label16} between seeds (max) |"
    print("\n" + head + "\n|" + "---|" * (head.count("|") - 1))
    gaps = {v: paired_gaps(ref, runs[v]) for v in variants}
    steps = [s for s, _ in ref[0]["losses"]]
    for i, step in enumerate(steps):
        line = f"| {step} | {statistics.fmean(r['losses'][i][1] for r in ref):.4f} |"
        for v in variants:
            m, sd = _mean_sd([g[i] for g in gaps[v]])
            line += f" {statistics.fmean(r['losses'][i][1] for r in runs[v]):.4f} | {m:+.2%}"
            line += f" ± {sd:.2%} |" if n > 1 else " |"
        if noise:
            line += f" {max(g[i] for g in noise):.2%} |"
        print(line)
    per_variant = {}
    for v in variants:
        means = [statistics.fmean(g[i] for g in gaps[v]) for i in range(len(steps))]
        per_variant[v] = dict(
            description=VARIANTS[v], seeds=[r["adapter_seed"] for r in runs[v]],
            max_rel_loss_gap=max(abs(m) for m in means),
            step_of_max=steps[max(range(len(steps)), key=lambda i: abs(means[i]))],
            worst_pair_rel_loss_gap=max(abs(x) for g in gaps[v] for x in g), mean_gaps=means,
            exact_match_gap_points=_points(ref, runs[v], "exact_match_after"),
            token_accuracy_gap_points=_points(ref, runs[v], "token_accuracy_after"))
    noise_max = max(x for g in noise for x in g) if noise else None
    print()
    for v, r in per_variant.items():
        print(f"{v} ({r['description']}): largest relative loss gap to {label16}"
              + (f", mean over {len(gaps[v])} adapter seeds," if len(gaps[v]) > 1 else "")
              + f" {r['max_rel_loss_gap']:.2%} at step {r['step_of_max']} (target <= 1%); worst single pair "
              f"{r['worst_pair_rel_loss_gap']:.2%}")
    if noise_max is not None:
        print(f"{label16} vs {label16} with another adapter seed: largest gap {noise_max:.2%}")

    def held_out(key: str, name: str) -> None:
        arms = ", ".join(f"{v if v != 'bf16' else label16} {statistics.fmean(r[key + '_before'] for r in rs):.1%} -> "
                         f"{statistics.fmean(r[key + '_after'] for r in rs):.1%}"
                         + (f" ({min(r[key + '_after'] for r in rs):.1%}-{max(r[key + '_after'] for r in rs):.1%})"
                            if len(rs) > 1 else "") for v, rs in runs.items())
        diffs = "; ".join(f"{v} vs {label16}: {per_variant[v][key + '_gap_points']:+.1f} points" for v in variants)
        print(f"held-out {name} (mean before -> after, range over seeds): {arms}; {diffs} (target within 1)")

    held_out("exact_match", "exact match")
    held_out("token_accuracy", "token accuracy")
    fp8 = per_variant.get("fp8", {})
    return dict(max_rel_loss_gap=fp8.get("max_rel_loss_gap"), noise_floor_max_rel_gap=noise_max,
                exact_match_gap_points=fp8.get("exact_match_gap_points"),
                token_accuracy_gap_points=fp8.get("token_accuracy_gap_points"), variants=per_variant)


# --- main --------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lora-steps", type=int, default=None, help="override the preset's LoRA steps (200 on gpu)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="adapter seeds per arm (7, 8, ...); gaps are paired by seed, and the 16-bit runs of "
                         "different seeds are the noise floor")
    ap.add_argument("--variants", default="fp8", type=lambda v: v.split(","),
                    help=f"comma-separated FP8 runs: {'; '.join(f'{k}: {d}' for k, d in VARIANTS.items())}")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no adapter seed's runs that would end past this many seconds from the start")
    ap.add_argument("--no-noise-floor", action="store_true",
                    help="with --seeds 1: skip the second 16-bit run (adapter seed 8)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads when there is no GPU (1: small ops on a shared CPU are 10x faster)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or args.seeds < 1:
        ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}" if unknown else "--seeds: at least 1")
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    p = dict(PRESETS[args.preset])
    if args.lora_steps:
        p["lora_steps"] = args.lora_steps
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    from fasttune import FastConfig, patch_model, unpatch_model
    from fasttune.embedded import build_tokenizer

    tok = build_tokenizer()
    base = build_base(tok, p)
    n_params = sum(t.numel() for t in base.parameters())
    log(f"preset {args.preset}: {n_params / 1e9:.3f} B parameters, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")

    pre_rows = make_rows(PRE_TASKS, max(p["pre_steps"] * p["batch"] // 2, 256), seed=1)
    patch_model(base, FastConfig())
    pre = train(base, iter(Batches(tok, pre_rows, p["batch"], seed=2)), p["pre_steps"], p["pre_lr"])
    unpatch_model(base)
    log(f"base trained on {', '.join(PRE_TASKS)}: loss {pre[0][1]:.3f} -> {pre[-1][1]:.3f}, held-out "
        f"exact match {exact_match(base, tok, make_rows(PRE_TASKS, p['eval_rows'], seed=6)):.1%}")
    base.requires_grad_(False)
    if device() == "cuda":
        base.to(torch.bfloat16)
    release()

    train_rows = make_rows((LORA_TASK,), max(p["lora_steps"] * p["batch"] // 2, 256), seed=3)
    seen = {r["word"] for r in train_rows} | {r["word"] for r in pre_rows}
    eval_rows = make_rows((LORA_TASK,), p["eval_rows"], seed=4, exclude=seen)
    batch = next(iter(Batches(tok, train_rows, p["batch"], seed=5)))
    proj = projection_errors(base, batch)

    # Seed by seed, every arm, so that a cut by --budget-s leaves whole pairs.
    runs, group_s = {"bf16": [], **{v: [] for v in args.variants}}, 0.0
    for seed in range(7, 7 + args.seeds):
        if args.budget_s and runs["bf16"] and time.perf_counter() - t_start + group_s > args.budget_s:
            log(f"--budget-s {args.budget_s:.0f}: stopped before adapter seed {seed}")
            break
        t_group = time.perf_counter()
        runs["bf16"].append(lora_run(base, tok, train_rows, eval_rows, p, None, seed, log))
        for variant in args.variants:
            runs[variant].append(lora_run(base, tok, train_rows, eval_rows, p, variant, seed, log))
        group_s = time.perf_counter() - t_group
    if args.seeds == 1 and not args.no_noise_floor:  # the noise floor: a 16-bit run with another adapter seed
        runs["bf16"].append(lora_run(base, tok, train_rows, eval_rows, p, None, 8, log))
    label16 = "bf16" if device() == "cuda" else "fp32"
    summary = compare(runs, label16)
    print(f"\nper-projection error against float64 (mean over layers; dY Gaussian)\n"
          f"| projection | Y {label16} | Y fp8 | dX {label16} | dX fp8 |\n|---|---|---|---|---|")
    for r in proj:
        print(f"| {r['projection']} | {r['y_16']:.2e} | {r['y_fp8']:.2e} | {r['dx_16']:.2e} | {r['dx_fp8']:.2e} |")
    seconds = time.perf_counter() - t_start
    print(f"\ntotal {seconds:.0f} s")
    result = dict(preset=args.preset, params=p, n_params=n_params, pretrain_losses=pre, runs=runs,
                  projection_errors=proj, summary=summary, seconds=round(seconds, 1),
                  torch=torch.__version__,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
