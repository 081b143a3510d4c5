"""Every README entry point runs fasttune's kernels, in bf16 mixed precision and in fp32.

FastTrainer; FastPatchCallback on transformers.Trainer and on TRL's SFT/DPO/GRPO/KTO/RLOO trainers;
FastSFTTrainer/FastDPOTrainer/FastGRPOTrainer/FastKTOTrainer/FastRLOOTrainer. One optimizer step
each, on a tiny Llama. The calls are counted at the kernel level (the autograd Functions' ``apply``,
the entry every kernel call goes through) against the forwards the model's backbone ran (its class
``forward``, counted the same way): every backbone forward must have run the fused loss head once,
its 5 RMSNorms (2 per layer + the final one), and RoPE and SwiGLU once per layer; under bf16 the
head must get bf16 hidden states (autocast reached it, as it reaches the stock head). Neither the
patch table nor the report's own counters are trusted for that; a second test checks that the
run-time counts fasttune logs after the first step agree with the kernel counts. DPO and KTO have
an explicit reference model, RLOO one built from the policy's path: the callback patches those too.
Each entry point runs once per module (``runs``); both tests read its result.
"""

import logging
import random
import re
from collections import Counter

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.models.llama import modeling_llama

from fasttune import FastConfig, FastPatchCallback, FastTrainer, patch_model
from fasttune.embedded import PadCollator, TaskDataset, build_model, build_tokenizer
from fasttune.embedded import make_task as _make_task
from fasttune.kernels import cross_entropy, logprobs, rms_norm, rope, swiglu

trl = pytest.importorskip("trl")
from fasttune.hf_integration import trl as fast_trl  # noqa: E402

# op → (kernel Functions, kernel calls per backbone forward of the 2-layer model)
KERNELS = {
    "cross_entropy": ((cross_entropy.FusedLinearCrossEntropyFunction, logprobs.FusedLinearLogprobsFunction), 1),
    "rms_norm": ((rms_norm.RMSNormFunction, rms_norm.RMSNormKeepFunction, rms_norm.RMSNormAddFunction), 5),
    "rope": ((rope.RopeFunction,), 2),
    "mlp": ((swiglu.GatedActFunction,), 2),
}
BACKBONE = "backbone forwards"


def _long_task(n, seed=0):
    """Task rows with 11-12 letter words: every no-grad forward of a 4-row batch then carries more
    than STOCK_INFERENCE_MAX_ROWS (64) tokens, so reference/KL forwards take the kernels too."""
    return _make_task(n, seed=seed, min_len=11, max_len=12)  # and rows stay within max_length=32


def spy_kernels(monkeypatch) -> Counter:
    """Counter of kernel calls per op and of the backbone's forwards, counted by delegating wrappers."""
    calls = Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            if name == "cross_entropy":  # the hidden states reaching the loss head: autocast's dtype or fp32
                calls["head input", args[0].dtype] += 1
            return fn(*args, **kwargs)
        return wrapper

    for op, (functions, _) in KERNELS.items():
        for fn in functions:
            monkeypatch.setattr(fn, "apply", staticmethod(counting(op, fn.apply)))
    monkeypatch.setattr(modeling_llama.LlamaModel, "forward",
                        counting(BACKBONE, modeling_llama.LlamaModel.forward))
    return calls


# --------------------------------------------------------------------------------------------
# The trainers, one builder per kind: (trainer class, tokenizer, model, tmp dir, bf16, callbacks) → trainer
# --------------------------------------------------------------------------------------------

def _common(tmp_path, bf16, **kw):
    return dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], bf16=bf16, seed=0,
                use_cpu=not torch.cuda.is_available(),  # the GPU run takes the same entry points on CUDA
                gradient_checkpointing=False, disable_tqdm=True, dataloader_num_workers=0, **kw)


class _FixedCompletions:
    """GRPO/RLOO: seeded completions instead of sampling (no generation forwards to count)."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        tok = self.processing_class
        rng = self.__dict__.setdefault("_fixed_rng", random.Random(0))
        letters = tok.convert_tokens_to_ids(list("abcdefgh"))
        out = [[rng.choice(letters) for _ in range(rng.randint(3, 7))] + [tok.eos_token_id] for _ in prompt_ids]
        return (out, None) if isinstance(self, trl.GRPOTrainer) else out


def _reward(completions, **kwargs):
    return [float(sum(c in "aeiou" for c in text)) for text in completions]


def _prompts(n):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"]} for r in _long_task(n, seed=5)])


def _trainer(cls, tok, model, tmp_path, bf16, callbacks):
    args = TrainingArguments(**_common(tmp_path, bf16))
    return cls(model=model, args=args, train_dataset=TaskDataset(tok, _long_task(8)),
               data_collator=PadCollator(tok.pad_token_id), callbacks=callbacks)


def _sft(cls, tok, model, tmp_path, bf16, callbacks):
    from datasets import Dataset

    cfg = trl.SFTConfig(**_common(tmp_path, bf16, max_length=32))
    return cls(model=model, args=cfg, train_dataset=Dataset.from_list(_long_task(8)), processing_class=tok,
               callbacks=callbacks)


def _dpo(cls, tok, model, tmp_path, bf16, callbacks):
    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"][::-1]}
            for r in _long_task(8, seed=2)]
    cfg = trl.DPOConfig(**_common(tmp_path, bf16, max_length=32))
    return cls(model=model, ref_model=build_model(tok, hidden_size=64, seed=1), args=cfg,
               train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=callbacks)


def _kto(cls, tok, model, tmp_path, bf16, callbacks):
    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "completion": r["completion"] if i % 2 else r["completion"][::-1],
             "label": bool(i % 2)} for i, r in enumerate(_long_task(8, seed=3))]
    cfg = trl.KTOConfig(**_common(tmp_path, bf16, max_length=32))
    return cls(model=model, ref_model=build_model(tok, hidden_size=64, seed=1), args=cfg,
               train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=callbacks)


def _grpo(cls, tok, model, tmp_path, bf16, callbacks):
    cls = type(f"Fixed{cls.__name__}", (_FixedCompletions, cls), {})
    cfg = trl.GRPOConfig(**_common(tmp_path, bf16, num_generations=4, max_completion_length=8, temperature=0.7))
    return cls(model=model, reward_funcs=_reward, args=cfg, train_dataset=_prompts(4), processing_class=tok,
               callbacks=callbacks)


def _rloo(cls, tok, model, tmp_path, bf16, callbacks):
    cls = type(f"Fixed{cls.__name__}", (_FixedCompletions, cls), {})
    model.save_pretrained(tmp_path / "policy")  # RLOO builds its reference model from the policy's path
    cfg = trl.RLOOConfig(**_common(tmp_path, bf16, num_generations=2, max_completion_length=8, beta=0.05))
    return cls(model=str(tmp_path / "policy"), reward_funcs=_reward, args=cfg, train_dataset=_prompts(4),
               processing_class=tok, callbacks=callbacks)


# entry point → (builder, the stock trainer class the callback rides on, fasttune's trainer class)
KINDS = {
    "trainer": (_trainer, Trainer, FastTrainer),
    "sft": (_sft, trl.SFTTrainer, fast_trl.FastSFTTrainer),
    "dpo": (_dpo, trl.DPOTrainer, fast_trl.FastDPOTrainer),
    "grpo": (_grpo, trl.GRPOTrainer, fast_trl.FastGRPOTrainer),
    "kto": (_kto, trl.KTOTrainer, fast_trl.FastKTOTrainer),
    "rloo": (_rloo, trl.RLOOTrainer, fast_trl.FastRLOOTrainer),
}
ENTRY_POINTS = [(kind, how) for kind in KINDS for how in ("callback", "fast")]


class _Records(logging.Handler):
    """The messages of the "fasttune" logger during one run."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_entry_point(kind, how, bf16, tmp_path):
    """Build the trainer of ``kind`` through ``how`` ("callback": the stock trainer with
    FastPatchCallback; "fast": fasttune's trainer class), run one optimizer step.

    Returns:
        (kernel and backbone-forward counts, the messages fasttune logged, the step's logged metrics).
    """
    build, stock_cls, fast_cls = KINDS[kind]
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=64)
    log, records = logging.getLogger("fasttune"), _Records()
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(records)
    try:
        with pytest.MonkeyPatch.context() as mp:
            calls = spy_kernels(mp)
            if how == "callback":
                trainer = build(stock_cls, tok, model, tmp_path, bf16, [FastPatchCallback()])
            else:
                trainer = build(fast_cls, tok, model, tmp_path, bf16, [])
            trainer.train()
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    return calls, records.messages, trainer.state.log_history[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(kind, how, dtype) → ``run_entry_point``'s result, each run once for the module's tests."""
    cache = {}

    def get(kind, how, dtype):
        if (kind, how, dtype) not in cache:
            tmp = tmp_path_factory.mktemp(f"{kind}-{how}-{dtype}")
            cache[kind, how, dtype] = run_entry_point(kind, how, dtype == "bf16", tmp)
        return cache[kind, how, dtype]
    return get


def kernel_table(calls: Counter) -> dict[str, tuple[int, int]]:
    """op → (kernel calls, calls the backbone forwards needed)."""
    return {op: (calls[op], per_forward * calls[BACKBONE]) for op, (_, per_forward) in KERNELS.items()}


def logged_counts(messages) -> dict[str, tuple[int, int]]:
    """op → (fused, calls) summed over the logged reports (model and reference model)."""
    fused, total = Counter(), Counter()
    for message in messages:
        for op, a, b in re.findall(r"^  (\w+): (\d+)/(\d+) calls fused", message, re.M):
            fused[op] += int(a)
            total[op] += int(b)
    return {op: (fused[op], total[op]) for op in total}


DTYPES = ["bf16", "fp32"]
ENTRY_IDS = [f"{k}-{h}" for k, h in ENTRY_POINTS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,how", ENTRY_POINTS, ids=ENTRY_IDS)
def test_entry_point_runs_the_fused_ops(kind, how, dtype, runs):
    calls, _, _ = runs(kind, how, dtype)
    table = kernel_table(calls)
    print(f"\n{kind}-{how}-{dtype}: " + ", ".join(f"{op} {a}/{b}" for op, (a, b) in table.items()))
    assert calls[BACKBONE] > 0
    assert all(a == b for a, b in table.values()), table
    # Under bf16 mixed precision the head runs in autocast's dtype, as the stock head would.
    dtype_calls = calls["head input", torch.bfloat16 if dtype == "bf16" else torch.float32]
    assert dtype_calls == table["cross_entropy"][0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,how", ENTRY_POINTS, ids=ENTRY_IDS)
def test_logged_counts_match_the_kernels(kind, how, dtype, runs):
    """The run-time counts fasttune logs after the first optimizer step tell the kernels' story."""
    calls, messages, _ = runs(kind, how, dtype)
    logged = logged_counts(messages)
    assert {op: logged.get(op, (0, 0)) for op in KERNELS} == {op: (a, a) for op, (a, _) in kernel_table(calls).items()}
    assert not [m for m in messages if "ran no call fused" in m]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_callback_computes_what_the_fast_trainer_computes(kind, dtype, runs):
    """Same kernels under the same autocast: the callback's step logs the Fast*Trainer's metrics."""
    _, _, callback = runs(kind, "callback", dtype)
    _, _, fast = runs(kind, "fast", dtype)
    keys = [k for k in callback if isinstance(callback[k], float) and not any(
        s in k for s in ("time", "per_second", "flos"))]
    assert "loss" in keys
    assert {k: fast.get(k) for k in keys} == pytest.approx({k: callback[k] for k in keys}, rel=1e-5, abs=1e-7)


def test_a_head_nobody_calls_is_reported_with_the_reason(caplog):
    """What the bf16 callback rows used to do: a forward installed over fasttune's head answers the calls."""
    from fasttune.model_patches.report import log_calls

    tok = build_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # TRL's head is Triton: CUDA tensors there
    model = build_model(tok, hidden_size=64).to(device)
    report = patch_model(model, FastConfig())
    trl.trainer.utils.add_fused_lm_head(model)  # TRL's head over ours, never re-attached
    batch = PadCollator(tok.pad_token_id)([TaskDataset(tok, _long_task(4))[i] for i in range(4)])
    batch = {k: v.to(device) for k, v in batch.items()}
    model(**batch, fused_lm_head=True).loss.backward()
    caplog.set_level(logging.INFO, logger="fasttune")
    log_calls(report)
    text = caplog.text
    assert "cross_entropy: 0/0 calls fused" in text and "rms_norm: 5/5 calls fused" in text
    assert "cross_entropy is patched but ran no call fused: LlamaForCausalLM.forward was replaced" in text
    assert "add_fused_lm_head" in text
    model.train(False)
    with torch.no_grad():
        model(**batch)
    assert report.calls["cross_entropy", "eval mode (logits computed)"] == 1  # TRL's head passed it down to ours
