"""TRL trainers on several CPU ranks (DPO, GRPO): scenarios of ``dist_worker.py``, dispatched by name there.

Each runs a TRL trainer + ``FastPatchCallback`` on ``world`` CPU ranks (accelerate's DDP over gloo) with
``per_device`` samples per rank and step, a LoRA policy (the reference = adapters off) and 2 SGD steps, and
returns the logged metrics, the trained adapter and the fused head's calls. The test compares 2 ranks × 2
with 1 rank × 4 (the same global batches: accelerate gives rank r the r-th slice of each step's samples).
"""

from __future__ import annotations

from pathlib import Path

_TIMINGS = ("runtime", "per_second", "step_time", "peak_memory", "total_flos")  # metrics not compared


def _lora_policy(seed: int, lora_seed: int):
    """(tokenizer, the embedded tiny Llama with LoRA r=4 on every projection, random B)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from fasttune.embedded import build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, hidden_size=64, seed=seed)
    torch.manual_seed(lora_seed)
    return tok, get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))


def _common(name: str, world: int, per_device: str) -> dict:
    """Two SGD steps, one log line each, fp32 on the CPU."""
    return dict(output_dir=str(Path.cwd() / f"{name}-{world}"), max_steps=2, learning_rate=0.05, optim="sgd",
                max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                seed=0, gradient_checkpointing=False, disable_tqdm=True, dataloader_num_workers=0,
                per_device_train_batch_size=int(per_device))


def _result(trainer, world: int) -> dict:
    from fasttune.model_patches import find_causal_lm
    from fasttune.model_patches.patch import patch_report

    calls = {f"{op}/{why}": n for (op, why), n in patch_report(find_causal_lm(trainer.model)).calls.items()}
    adapter = {n: p.detach().reshape(-1).tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}
    logs = [{k: v for k, v in h.items() if isinstance(v, float) and not any(s in k for s in _TIMINGS)}
            for h in trainer.state.log_history if "loss" in h]
    return {"wrapped": type(trainer.model_wrapped).__name__, "world": world, "calls": calls, "adapter": adapter,
            "logs": logs}


def scenario_dpo(rank: int, world: int, per_device: str) -> dict:
    """DPOTrainer, ``per_device`` preference pairs per rank and step, β = 0.5."""
    import trl
    from datasets import Dataset

    from fasttune import FastPatchCallback
    from fasttune.embedded import make_task

    tok, model = _lora_policy(seed=3, lora_seed=0)
    rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"][::-1]}
            for r in make_task(8, seed=2)]
    args = trl.DPOConfig(**_common("dpo", world, per_device), max_length=32, beta=0.5)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             callbacks=[FastPatchCallback()])
    trainer.train()
    return _result(trainer, world)


def _vowel_reward(completions, **kwargs):
    return [float(sum(c in "aeiou" for c in text)) - 0.2 * len(text) for text in completions]


def scenario_grpo(rank: int, world: int, per_device: str) -> dict:
    """GRPOTrainer, ``per_device`` completions per rank and step (4 generations per prompt, β > 0, T = 0.7).
    Completions come from a seeded generator keyed by the sample's place in the step's global order, so
    both layouts score the same sequences; rewards are gathered across ranks for the group advantages
    as in a real run."""
    import random

    import trl
    from datasets import Dataset

    from fasttune import FastPatchCallback
    from fasttune.embedded import make_task

    class FixedCompletions(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            tok, n = self.processing_class, len(prompt_ids)
            self._calls = getattr(self, "_calls", -1) + 1
            first = self._calls * n * world + rank * n  # this rank's first sample in the step's global order
            letters = tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
            out = []
            for i in range(n):
                rng = random.Random(first + i)
                ids = [rng.choice(letters) for _ in range(rng.randint(2, 7))]
                out.append(ids + ([tok.eos_token_id] if rng.random() < 0.5 else []))
            return out, None

    tok, model = _lora_policy(seed=6, lora_seed=1)
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in make_task(8, seed=5)])
    args = trl.GRPOConfig(**_common("grpo", world, per_device), num_generations=4, max_completion_length=8,
                          temperature=0.7, beta=0.04)
    trainer = FixedCompletions(model=model, reward_funcs=_vowel_reward, args=args, train_dataset=prompts,
                               processing_class=tok, callbacks=[FastPatchCallback()])
    trainer.train()
    return _result(trainer, world)
