"""What Python's full garbage collections cost a training loop, with and without ``gc.freeze()``.

A LoRA model of as many layers and modules as an 8B Llama (32 layers, the seven projections adapted) but
tiny widths, patched by fasttune ("offload" checkpointing), trains ``--steps`` steps on the CPU, once as is
and once with the objects alive after the warm-up frozen (what ``FastConfig.gc_freeze`` does after the first
optimizer step). The object count and the full (generation-2) collections' number and time are what a GPU run
of the real model pays on its host too: they depend on the modules and the loop, not on the widths.

    python benchmarks/bench_gc.py --steps 200
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time


def run(mode: str, steps: int, layers: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fasttune import FastConfig, patch_model

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(
        r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    patch_model(model, FastConfig(checkpointing="offload"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 512, (2, 64))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    full, start = [], []
    gc.callbacks.append(lambda phase, info: info["generation"] == 2 and (
        start.append(time.perf_counter()) if phase == "start" else full.append(time.perf_counter() - start[-1])))
    step()  # warm-up: optimizer states, caches
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    objects = len(gc.get_objects()) + gc.get_freeze_count()
    full.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t0
    return (f"| {mode} | {objects:,} ({gc.get_freeze_count():,} frozen) | {steps} | {dt / steps * 1e3:.1f} | "
            f"{len(full)} | {sum(full) * 1e3:.0f} | {max(full, default=0) * 1e3:.0f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--mode", choices=("on", "freeze"), help=argparse.SUPPRESS)  # one arm, in its own process
    args = p.parse_args(argv)
    if args.mode:
        print(run(args.mode, args.steps, args.layers), flush=True)
        return
    print("| collector | objects tracked | steps | ms/step | full collections | their total ms | longest ms |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("on", "freeze"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--steps", str(args.steps),
                              "--layers", str(args.layers)], capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
