"""TRL trainers on several CPU ranks (DPO, GRPO): scenarios of ``dist_worker.py``, dispatched by name there."""

from __future__ import annotations

from pathlib import Path


def scenario_dpo(rank: int, world: int, per_device: str) -> dict:
    """TRL's DPOTrainer + FastPatchCallback on ``world`` CPU ranks (accelerate's DDP over gloo) with
    ``per_device`` preference pairs per rank and step, LoRA policy (reference = adapters off), 2 SGD
    steps: the logged metrics, the trained adapter and the fused head's calls. The test compares
    2 ranks × 2 pairs with 1 rank × 4 pairs (the same global batches: accelerate gives rank r the
    r-th micro-batch of the sampler's order)."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from fasttune import FastPatchCallback
    from fasttune.embedded import build_model, build_tokenizer, make_task
    from fasttune.model_patches import find_causal_lm
    from fasttune.model_patches.patch import patch_report

    tok = build_tokenizer()
    rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"][::-1]}
            for r in make_task(8, seed=2)]
    model = build_model(tok, hidden_size=64, seed=3)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    callback = FastPatchCallback()
    args = trl.DPOConfig(output_dir=str(Path.cwd() / f"dpo-{world}"), max_steps=2, learning_rate=0.05, optim="sgd",
                         max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                         bf16=False, seed=0, gradient_checkpointing=False, disable_tqdm=True,
                         dataloader_num_workers=0, per_device_train_batch_size=int(per_device), max_length=32,
                         beta=0.5)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             callbacks=[callback])
    trainer.train()
    calls = {f"{op}/{why}": n for (op, why), n in patch_report(find_causal_lm(trainer.model)).calls.items()}
    adapter = {n: p.detach().reshape(-1).tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"wrapped": type(trainer.model_wrapped).__name__, "world": world, "calls": calls, "adapter": adapter,
            "logs": [{k: v for k, v in h.items() if isinstance(v, float) and not any(
                s in k for s in ("runtime", "per_second", "step_time", "peak_memory", "total_flos"))}
                     for h in trainer.state.log_history if "loss" in h]}


def _vowel_reward(completions, **kwargs):
    return [float(sum(c in "aeiou" for c in text)) - 0.2 * len(text) for text in completions]


def scenario_grpo(rank: int, world: int, per_device: str) -> dict:
    """TRL's GRPOTrainer + FastPatchCallback on ``world`` CPU ranks with ``per_device`` completions per rank
    and step (4 generations per prompt, LoRA policy, β > 0: reference = adapters off, T = 0.7), 2 SGD steps.
    Completions come from a seeded generator keyed by the sample's place in the global batch (accelerate
    gives rank r the r-th slice of each step's samples), so 2 ranks × 2 and 1 rank × 4 score the same
    sequences; rewards are gathered across ranks for the group advantages as in a real run."""
    import random

    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from fasttune import FastPatchCallback
    from fasttune.embedded import build_model, build_tokenizer, make_task
    from fasttune.model_patches import find_causal_lm
    from fasttune.model_patches.patch import patch_report

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

    tok = build_tokenizer()
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in make_task(8, seed=5)])
    model = build_model(tok, hidden_size=64, seed=6)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    args = trl.GRPOConfig(output_dir=str(Path.cwd() / f"grpo-{world}"), max_steps=2, learning_rate=0.05, optim="sgd",
                          max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                          bf16=False, seed=0, gradient_checkpointing=False, disable_tqdm=True,
                          dataloader_num_workers=0, per_device_train_batch_size=int(per_device), num_generations=4,
                          max_completion_length=8, temperature=0.7, beta=0.04)
    trainer = FixedCompletions(model=model, reward_funcs=_vowel_reward, args=args, train_dataset=prompts,
                               processing_class=tok, callbacks=[FastPatchCallback()])
    trainer.train()
    calls = {f"{op}/{why}": n for (op, why), n in patch_report(find_causal_lm(trainer.model)).calls.items()}
    adapter = {n: p.detach().reshape(-1).tolist() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"wrapped": type(trainer.model_wrapped).__name__, "world": world, "calls": calls, "adapter": adapter,
            "logs": [{k: v for k, v in h.items() if isinstance(v, float) and not any(
                s in k for s in ("runtime", "per_second", "step_time", "peak_memory", "total_flos"))}
                     for h in trainer.state.log_history if "loss" in h]}
