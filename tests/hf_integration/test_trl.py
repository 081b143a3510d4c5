"""TRL's trainers on fasttune's fused head: same gradients and logged metrics as stock TRL, step by step.

FastSFTTrainer / FastDPOTrainer / FastGRPOTrainer / FastKTOTrainer / FastRLOOTrainer (and DPOTrainer +
FastPatchCallback) against the stock TRL trainer on the same tiny model and data: per step, the
gradient of every trainable parameter (recorded before the optimizer step) and every logged metric.
GRPO's and RLOO's completions are fixed (a subclass returns them instead of sampling), so both runs
score the same sequences. The head itself is tested in tests/model_patches/test_trl_head.py.
"""

import copy
import random

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from fasttune import FastConfig, FastPatchCallback, patch_model
from fasttune.embedded import build_model, build_tokenizer, make_task
from fasttune.model_patches import find_causal_lm
from fasttune.model_patches.head import head_forward
from fasttune.model_patches.trl_head import FIELDS
from helpers.compare import rel_err
from helpers.tiny_models import make_batch, tiny_model

trl = pytest.importorskip("trl")
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from fasttune.hf_integration.trl import (FastDPOTrainer, FastGRPOTrainer, FastKTOTrainer,  # noqa: E402
                                         FastRLOOTrainer, FastSFTTrainer, attach_trl_head, trl_head_settings)

HEAD_ONLY = FastConfig(rms_norm=False, rope=False, mlp=False, lora=False)
RTOL = 1e-5
_KW = dict(output_dir="unused", report_to=[], use_cpu=True, bf16=False)


def test_settings_follow_each_trainers_config():
    kw = _KW
    grpo = trl_head_settings(trl.GRPOConfig(temperature=0.6, cast_lm_head_to_fp32=True, **kw))
    assert (grpo.temperature, grpo.outputs, grpo.entropy_grad, grpo.fp32_head) == (0.6, ("log_probs", "entropy"),
                                                                                   True, True)
    assert trl_head_settings(trl.RLOOConfig(temperature=0.8, **kw), reference=True).temperature == 0.8
    dpo = trl_head_settings(trl.DPOConfig(use_weighting=True, **kw))
    assert set(dpo.outputs) == set(FIELDS) and dpo.temperature == 1.0 and not dpo.entropy_grad
    assert trl_head_settings(trl.DPOConfig(**kw), reference=True).outputs == ("log_probs",)
    assert trl_head_settings(trl.SFTConfig(**kw)).outputs == ("log_probs", "entropy", "is_top1")
    assert trl_head_settings(trl.KTOConfig(**kw)).outputs == ("log_probs", "entropy", "mean_logits")
    assert trl_head_settings(TrainingArguments(**kw)) is None


def test_attach_puts_the_head_back_over_trls_with_its_temperature():
    """FastPatchCallback's order: patched at on_init_end, wrapped by TRL, attached at on_train_begin."""
    model = tiny_model("llama", vocab_size=501)
    patch_model(model, HEAD_ONLY)
    add_fused_lm_head(model, temperature=0.6, outputs=("log_probs", "entropy"))
    trl_forward = model.__dict__["forward"]
    assert not attach_trl_head(model, TrainingArguments(**_KW))  # unknown trainer: TRL's head stays
    assert not attach_trl_head(model, trl.GRPOConfig(**_KW), FastConfig(fused_logprobs=False))
    assert model.__dict__["forward"] is trl_forward
    assert attach_trl_head(model, trl.GRPOConfig(temperature=0.6, **_KW))
    assert head_forward(model).trl_settings.temperature == 0.6
    batch = make_batch(model.config.vocab_size, seed=9)
    a, b = model(**batch, fused_lm_head=True), trl_forward(**batch, fused_lm_head=True)
    assert rel_err(a.log_probs, b.log_probs) <= RTOL and rel_err(a.entropy, b.entropy) <= RTOL


# --------------------------------------------------------------------------------------------
# The trainers: stock TRL vs fasttune, step by step
# --------------------------------------------------------------------------------------------

class GradRecorder(TrainerCallback):
    """Every trainable gradient just before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.requires_grad and p.grad is not None})


_NOT_COMPARED = ("runtime", "per_second", "step_time", "peak_memory", "total_flos")


def assert_same_run(fast, stock, fast_rec, stock_rec, steps, difference_scale=None):
    """Same gradients per step (relative, per tensor) and the same logged metrics.

    ``difference_scale(log) → {prefix: magnitude}``: metrics that are differences of large
    numbers (DPO's rewards = β·(logp − ref_logp), sums over ~30 tokens) can only agree to
    RTOL × the magnitude of the operands, not of the result.
    """
    assert len(fast_rec.steps) == len(stock_rec.steps) == steps
    for i, (ga, gb) in enumerate(zip(fast_rec.steps, stock_rec.steps)):
        assert ga.keys() == gb.keys() and ga, f"step {i}: different trainable parameters"
        errs = {n: rel_err(ga[n], gb[n]) if gb[n].abs().max() > 0 else float(ga[n].abs().max()) for n in gb}
        bad = {n: e for n, e in errs.items() if not e <= RTOL}
        assert not bad, f"step {i}: gradients differ: {dict(list(bad.items())[:4])}"
    logs_a = [h for h in fast.state.log_history if "loss" in h]
    logs_b = [h for h in stock.state.log_history if "loss" in h]
    assert len(logs_a) == len(logs_b) == steps
    for la, lb in zip(logs_a, logs_b):
        keys = [k for k in lb if not any(s in k for s in _NOT_COMPARED)]
        assert "loss" in keys and len(keys) > 3
        scales = difference_scale(lb) if difference_scale else {}
        for k in keys:
            scale = max([abs(lb[k])] + [v for p, v in scales.items() if k.startswith(p)])
            assert abs(la[k] - lb[k]) <= RTOL * scale + 1e-7, (k, la[k], lb[k])


def _common(tmp_path, device, **kw):
    """Two SGD steps, one log line each, fp32 on ``device`` (the Triton interpreter on CPU)."""
    return dict(output_dir=str(tmp_path), max_steps=2, learning_rate=0.05, optim="sgd", max_grad_norm=0.0,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=device == "cpu", bf16=False, seed=0,
                gradient_checkpointing=False, disable_tqdm=True, dataloader_num_workers=0, **kw)


def _lora(model, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg)


def _trainer_pair(make):
    """(fast, stock) trainers and their gradient recorders; ``make(tag, callbacks)``."""
    rec_f, rec_s = GradRecorder(), GradRecorder()
    return make("fast", [rec_f]), make("stock", [rec_s]), rec_f, rec_s


def test_fast_sft_trainer_matches_sft_trainer(tmp_path, device):
    from datasets import Dataset

    tok = build_tokenizer()
    ds = Dataset.from_list(make_task(16, seed=1))

    def make(tag, callbacks):
        cls = FastSFTTrainer if tag == "fast" else trl.SFTTrainer
        cfg = trl.SFTConfig(**{**_common(tmp_path / tag, device, per_device_train_batch_size=8, max_length=32),
                               "gradient_checkpointing": True})
        return cls(model=build_model(tok, hidden_size=64), args=cfg, train_dataset=ds, processing_class=tok,
                   callbacks=callbacks)

    fast, stock, rf, rs = _trainer_pair(make)
    assert fast.patch_report.patched["cross_entropy"] == 1
    # The config's checkpointing flag became fasttune's checkpointer (HF's own is off).
    assert fast.fast_config.checkpointing == "offload" and not fast.args.gradient_checkpointing
    assert fast.patch_report.patched["checkpointing"] == 2
    assert head_forward(find_causal_lm(fast.model)).trl_settings.outputs == ("log_probs", "entropy", "is_top1")
    fast.train(), stock.train()
    assert_same_run(fast, stock, rf, rs, steps=2)
    assert "tokens_per_second" in fast.state.log_history[0]


def test_fast_sft_trainer_keeps_trls_label_smoothing(tmp_path, device):
    """SFTTrainer smooths labels on the full logits itself; FastTrainer's hand-over to the fused
    loss would make it compute the unsmoothed loss instead, so FastSFTTrainer keeps TRL's."""
    from datasets import Dataset

    tok = build_tokenizer()
    cfg = trl.SFTConfig(**_common(tmp_path, device, per_device_train_batch_size=8, max_length=32,
                                  label_smoothing_factor=0.1))
    trainer = FastSFTTrainer(model=build_model(tok, hidden_size=64), args=cfg,
                             train_dataset=Dataset.from_list(make_task(8)), processing_class=tok)
    assert trainer.label_smoother is not None and trainer.label_smoother.epsilon == 0.1
    assert head_forward(find_causal_lm(trainer.model)).label_smoothing == 0.0


def _preference_rows(n, seed):
    rows = make_task(n, seed=seed)
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"][::-1]} for r in rows]


@pytest.mark.parametrize("setup", ["peft_callback", "ref_model_weighted"])
def test_dpo_matches_stock(tmp_path, device, setup):
    """PEFT LoRA policy (reference = adapters off) through FastPatchCallback; full fine-tune with a
    separate reference model (patched too) and WPO weighting (log_sum_sq_probs) through FastDPOTrainer."""
    from datasets import Dataset

    tok = build_tokenizer()
    ds = Dataset.from_list(_preference_rows(8, seed=2))
    base = build_model(tok, hidden_size=64, seed=3)
    ref = build_model(tok, hidden_size=64, seed=4)
    peft = setup == "peft_callback"
    if peft:
        base = _lora(base)
    callback = FastPatchCallback()

    def make(tag, callbacks):
        cfg = trl.DPOConfig(**_common(tmp_path / tag, device, per_device_train_batch_size=4, max_length=32, beta=0.5,
                                      use_weighting=not peft))
        kw = dict(args=cfg, train_dataset=ds, processing_class=tok)
        if peft:
            extra = [callback] if tag == "fast" else []
            return trl.DPOTrainer(model=copy.deepcopy(base), callbacks=callbacks + extra, **kw)
        cls = FastDPOTrainer if tag == "fast" else trl.DPOTrainer
        return cls(model=copy.deepcopy(base), ref_model=copy.deepcopy(ref), callbacks=callbacks, **kw)

    fast, stock, rf, rs = _trainer_pair(make)
    if peft:
        # TRL adds its head after on_init_end, over ours: FastPatchCallback.on_train_begin takes it back.
        attach_trl_head(fast.model, fast.args, callback.config)
        assert callback.report.patched["cross_entropy"] == 1 and sum(callback.report.patched.values()) > 1
    else:
        assert fast.ref_patch_report.patched["cross_entropy"] == 1
        assert head_forward(find_causal_lm(fast.ref_model)).trl_settings.outputs == ("log_probs",)
    head = head_forward(find_causal_lm(fast.model))
    assert head is not None and "is_top1" in head.trl_settings.outputs
    fast.train(), stock.train()
    assert_same_run(fast, stock, rf, rs, steps=2, difference_scale=_logp_difference_scales(fast.args.beta))


def _logp_difference_scales(beta):
    """DPO/KTO rewards = β·(logp − ref_logp) and KTO's kl = mean(logp − ref_logp): sequence sums."""
    def scales(log):
        logps = max(abs(log["logps/chosen"]), abs(log["logps/rejected"]))
        return {"rewards/": 2 * beta * logps, "kl": 2 * logps}
    return scales


class _FixedCompletions:
    """Completions drawn from a seeded generator instead of the model: both runs score the same."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        tok = self.processing_class
        if not hasattr(self, "_fixed_rng"):
            self._fixed_rng = random.Random(0)
        letters = tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
        out = []
        for _ in prompt_ids:
            n = self._fixed_rng.randint(2, 7)
            ids = [self._fixed_rng.choice(letters) for _ in range(n)]
            out.append(ids + ([tok.eos_token_id] if self._fixed_rng.random() < 0.5 else []))
        return (out, None) if isinstance(self, trl.GRPOTrainer) else out


def _vowel_reward(completions, **kwargs):
    return [float(sum(c in "aeiou" for c in text)) - 0.2 * len(text) for text in completions]


class _FixedGRPO(_FixedCompletions, trl.GRPOTrainer):
    pass


class _FixedFastGRPO(_FixedCompletions, FastGRPOTrainer):
    pass


def test_grpo_matches_stock_at_temperature(tmp_path, device):
    """PEFT LoRA policy, β > 0 (reference = adapters off), T = 0.7, entropy bonus (entropy gradient)."""
    from datasets import Dataset

    tok = build_tokenizer()
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in make_task(8, seed=5)])
    base = _lora(build_model(tok, hidden_size=64, seed=6), seed=1)

    def make(tag, callbacks):
        cls = _FixedFastGRPO if tag == "fast" else _FixedGRPO
        cfg = trl.GRPOConfig(**_common(tmp_path / tag, device, per_device_train_batch_size=4, num_generations=4,
                                       max_completion_length=8, temperature=0.7, beta=0.04, entropy_coef=0.05))
        return cls(model=copy.deepcopy(base), reward_funcs=_vowel_reward, args=cfg, train_dataset=ds,
                   processing_class=tok, callbacks=callbacks)

    fast, stock, rf, rs = _trainer_pair(make)
    settings = head_forward(find_causal_lm(fast.model)).trl_settings
    assert settings.temperature == 0.7 and settings.entropy_grad
    fast.train(), stock.train()
    assert_same_run(fast, stock, rf, rs, steps=2)
    assert "tokens_per_second" in fast.state.log_history[0]


class _FixedRLOO(_FixedCompletions, trl.RLOOTrainer):
    pass


class _FixedFastRLOO(_FixedCompletions, FastRLOOTrainer):
    pass


def test_rloo_matches_stock(tmp_path, device):
    """RLOO: temperature 1.3, separate reference model built from the policy's path."""
    from datasets import Dataset

    tok = build_tokenizer()
    # 11-12 letter words: the no-grad old-logprob forward then carries more than 64 tokens and takes
    # the kernels like the training forward (at 64 or fewer it is a decode step on the stock path,
    # and the two paths' last-bit differences show in RLOO's near-zero loss).
    prompts = Dataset.from_list([{"prompt": r["prompt"]} for r in make_task(4, seed=7, min_len=11, max_len=12)])
    model = build_model(tok, hidden_size=64, seed=8)
    # RLOO builds its reference model from the policy's path.
    model.save_pretrained(tmp_path / "policy")

    def make_rloo(tag, callbacks):
        cls = _FixedFastRLOO if tag == "fast" else _FixedRLOO
        cfg = trl.RLOOConfig(**_common(tmp_path / f"r{tag}", device, per_device_train_batch_size=4, num_generations=2,
                                       max_completion_length=8, temperature=1.3, beta=0.05))
        return cls(model=str(tmp_path / "policy"), reward_funcs=_vowel_reward, args=cfg, train_dataset=prompts,
                   processing_class=tok, callbacks=callbacks)

    fast, stock, rf, rs = _trainer_pair(make_rloo)
    assert head_forward(find_causal_lm(fast.model)).trl_settings.temperature == 1.3
    assert head_forward(find_causal_lm(fast.ref_model)).trl_settings.temperature == 1.3
    fast.train(), stock.train()
    assert_same_run(fast, stock, rf, rs, steps=2)


def test_kto_matches_stock(tmp_path, device):
    """KTO: separate reference model, mean_logits, KL batches."""
    from datasets import Dataset

    tok = build_tokenizer()
    model, ref = build_model(tok, hidden_size=64, seed=8), build_model(tok, hidden_size=64, seed=9)
    rows = [{"prompt": r["prompt"], "completion": r["completion"] if i % 2 else r["completion"][::-1],
             "label": bool(i % 2)} for i, r in enumerate(make_task(8, seed=10))]
    kto_ds = Dataset.from_list(rows)

    def make_kto(tag, callbacks):
        cls = FastKTOTrainer if tag == "fast" else trl.KTOTrainer
        cfg = trl.KTOConfig(**_common(tmp_path / f"k{tag}", device, per_device_train_batch_size=4, max_length=32))
        return cls(model=copy.deepcopy(model), ref_model=copy.deepcopy(ref), args=cfg, train_dataset=kto_ds,
                   processing_class=tok, callbacks=callbacks)

    fast, stock, rf, rs = _trainer_pair(make_kto)
    fast.train(), stock.train()
    assert_same_run(fast, stock, rf, rs, steps=2, difference_scale=_logp_difference_scales(fast.args.beta))
