"""lora.py: fused LoRA QKV / O / gated MLP on PEFT models, dense and NF4, against PEFT's own path.

Stock PEFT vs a patched copy of the same tiny random model (tests/_lib/helpers/tiny_models.py;
GQA, two layers, each family's distinctive options), LoRA r=8 on every projection with B random
(``init_lora_weights=False``: a zero B would hide the adapter path), every other kernel on too.
A spy counts the fused Functions' calls, so a hook that silently took the default path fails.

Tolerances (relative; loss as a scalar, each adapter gradient in Frobenius norm):
- dense fp32: loss ≤ 1e-6, gradients ≤ 1e-5 — the same functions summed in another order
  (measured ≤ 3e-6 on gradients); a wrong scaling, a swapped gate/up, a missed bias, a wrong
  q/k/v split give ≥ 1e-2.
- NF4 fp32 compute (bitsandbytes Linear4bit, double quantisation): loss ≤ 1e-5, gradients
  ≤ 1e-4 — fasttune dequantises with its own kernel (bit-identical to bitsandbytes) and then
  runs fp32 products in another order; bitsandbytes on CPU only matches in train mode (its eval
  path repacks the weights), so NF4 comparisons run in train mode. NF4 models use widths that
  are multiples of 64: bitsandbytes 0.50.2 on CPU mis-dequantises rows 16·k but not 64·k wide.
- ineligible configurations run PEFT's path in the patched model: ≤ 1e-6 / 1e-5 as dense.
The vocabulary is small here: the large-vocab head is test_family_parity's business.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.kernels.lora_wide import BorderedNf4
from fasttune.model_patches import lora as lora_mod
from fasttune.model_patches.attention import FastAttentionForward, project_o, project_qkv_separate
from fasttune.model_patches.families import FAMILIES
from fasttune.model_patches.mlp import FastMLPForward
from fasttune.model_patches import patch_report
from helpers.compare import assert_grads_close, rel_err
from helpers.spies import count_fused_lora
from helpers.tiny_models import FAMILY_CASES, attention_layers, family_type, make_batch, stock_fallback_ops, tiny_model

LAYERS = 2
VOCAB = 1000
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]
LORA_OPS = ("lora_qkv", "lora_o", "lora_mlp")
# Widths bitsandbytes quantises correctly on CPU (multiples of its 64 blocksize).
NF4_SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32, query_pre_attn_scalar=32)


# --- helpers -------------------------------------------------------------------------------------


def quantize_nf4_(model: nn.Module) -> nn.Module:
    """Every attention/MLP nn.Linear of the decoder → bitsandbytes NF4 Linear4bit (double quant,
    fp32 compute), quantised from the random weights when moved to the device."""
    bnb = pytest.importorskip("bitsandbytes")
    for layer in model.model.layers:
        for parent in (getattr(layer, "self_attn", None), layer.mlp):  # Qwen3.5's linear-attention layers: MLP only
            if parent is None:
                continue
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                has_bias = child.bias is not None
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=has_bias,
                                      compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
                if has_bias:
                    q.bias = nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, q)
    return model


def lora_model(model_type, device, seed=0, nf4=False, targets=TARGETS, **lora_kw):
    """A tiny PEFT LoRA model (r=8, alpha=16, dropout 0 unless given, B random)."""
    overrides = dict(vocab_size=VOCAB, **(NF4_SIZES if nf4 else {}))
    base = tiny_model(model_type, seed=seed, **overrides)
    if nf4:
        quantize_nf4_(base)
    kw = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False)
    kw.update(lora_kw)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, LoraConfig(**kw)).to(device)


def stock_and_fast(model_type, device, config=None, **kw):
    """(stock, patched copy, report); NF4 models are built twice (quantisation is deterministic)."""
    stock = lora_model(model_type, device, **kw)
    fast = lora_model(model_type, device, **kw) if kw.get("nf4") else copy.deepcopy(stock)
    return stock, fast, patch_model(fast, config or FastConfig())


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the fused Functions the hooks run (by name)."""
    return count_fused_lora(monkeypatch)


def fused_calls_per_forward(model_type) -> int:
    """Fused Function calls per forward: qkv, o per attention layer, mlp per layer; a fused gate_up MLP
    (Phi-3, GLM-4) is two lora_linear."""
    return 2 * attention_layers(model_type) + LAYERS * (2 if FAMILIES[family_type(model_type)].mlp_layout == "fused"
                                                        else 1)


def step(model, batch, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both models where dropout is on
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


def assert_parity(fast, stock, batch, loss_tol=1e-6, grad_tol=1e-5):
    fast.train(), stock.train()
    loss_fast, loss_stock = step(fast, batch), step(stock, batch)
    assert rel_err(loss_fast, loss_stock) <= loss_tol, (loss_fast, loss_stock)
    assert_grads_close(fast, stock, grad_tol)


def lora_counts(report) -> dict[str, int]:
    return {op: n for op, n in report.patched.items() if op in LORA_OPS}


def lora_fallbacks(report):
    return [f for f in report.fallbacks if f.op in LORA_OPS]


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


# --- parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILY_CASES)
def test_every_family_matches_peft_and_unpatches(model_type, device, spy):
    stock, fast, report = stock_and_fast(model_type, device, seed=2)
    attn = attention_layers(model_type)
    assert lora_counts(report) == {"lora_qkv": attn, "lora_o": attn, "lora_mlp": LAYERS}, str(report)
    assert [f.op for f in report.fallbacks] == stock_fallback_ops(model_type), str(report)
    batch = make_batch(VOCAB, seed=12, device=device)
    assert_parity(fast, stock, batch)
    assert sum(spy.values()) == fused_calls_per_forward(model_type), spy

    unpatch_model(fast)
    assert [n for n, m in fast.named_modules() if "forward" in m.__dict__] == []
    fast.eval(), stock.eval()
    assert torch.equal(logits(fast, batch), logits(stock, batch))


# SwiGLU, q/k/v bias, GeGLU, fused gate/up; GLM-4: fused with post-norms; Qwen3.5: q_proj with its gate;
# EXAONE 4: post-norms, a NoPE layer; Seed-OSS: biases on q/k/v, o_proj and the MLP
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma", "phi3", "glm4", "qwen3_5_text", "exaone4",
                                        "seed_oss"])
def test_nf4_qlora_matches_peft(model_type, device, spy):
    stock, fast, report = stock_and_fast(model_type, device, seed=3, nf4=True)
    attn = attention_layers(model_type)
    assert type(fast.base_model.model.model.layers[-1].self_attn.o_proj.base_layer).__name__ == "Linear4bit"
    assert lora_counts(report) == {"lora_qkv": attn, "lora_o": attn, "lora_mlp": LAYERS}, str(report)
    assert [f.op for f in report.fallbacks] == stock_fallback_ops(model_type), str(report)
    assert_parity(fast, stock, make_batch(VOCAB, seed=13, device=device), loss_tol=1e-5, grad_tol=1e-4)
    assert sum(spy.values()) == fused_calls_per_forward(model_type), spy


@pytest.mark.parametrize("reference_first", [False, True], ids=["policy_first", "reference_first"])
@pytest.mark.parametrize("model_type", ["llama", "gemma", "phi3"])
def test_fresh_adapter_output_is_bitwise_the_disabled_adapter_output(model_type, reference_first, device, spy):
    """B = 0 (PEFT's default init): the fused path's output equals the adapters-disabled pass
    exactly, as in stock PEFT, so DPO's policy/reference log-ratios start at exactly 0 — also
    when the reference pass comes first (TRL's precompute_ref_log_probs), before any training
    call has widened the weights (lora_widen.py)."""
    model = lora_model(model_type, device, init_lora_weights=True)
    patch_model(model, FastConfig())
    model.train()
    ids = make_batch(VOCAB, batch=4, seq=20, seed=3, device=device)["input_ids"]  # > 64 rows: no-grad stays fused

    def reference():
        with model.disable_adapter(), torch.no_grad():
            return model(input_ids=ids).logits

    with torch.enable_grad():  # the training path (fused Functions), logits returned without labels
        ref = reference() if reference_first else None
        policy = model(input_ids=ids).logits
        ref = reference() if not reference_first else ref
    assert spy["lora_qkv"] + spy["lora_linear"] + spy["lora_mlp"] >= fused_calls_per_forward(model_type) - LAYERS
    assert torch.equal(policy, ref)


@pytest.mark.parametrize("reference_first", [False, True], ids=["policy_first", "reference_first"])
def test_nf4_fresh_adapter_output_is_bitwise_the_disabled_adapter_output(reference_first, device, spy):
    """The same over NF4 bases, whose q/k/v, gate/up and down groups are bordered (lora_widen.py): those
    stay fused in the no-grad reference pass, so both passes compute the same products; o_proj (out = in:
    never bordered) runs bitsandbytes' path there and the base product first in training. The layout
    sits on the six base layers only and goes with unpatch_model."""
    model = lora_model("llama", device, seed=5, nf4=True, init_lora_weights=True)
    patch_model(model, FastConfig())
    model.train()
    ids = make_batch(VOCAB, batch=4, seq=20, seed=3, device=device)["input_ids"]

    def reference():
        with model.disable_adapter(), torch.no_grad():
            return model(input_ids=ids).logits

    with torch.enable_grad():
        ref = reference() if reference_first else None
        policy = model(input_ids=ids).logits
        ref = reference() if not reference_first else ref
    assert spy["lora_qkv"] == spy["lora_mlp"] == 2 * LAYERS and spy["lora_linear"] == LAYERS, spy
    assert torch.equal(policy, ref)
    bordered = sorted(n.split("layers.")[1] for n, m in model.named_modules() if isinstance(
        m.__dict__.get("_fasttune_wide"), BorderedNf4))
    assert bordered == sorted(f"{i}.{g}.{p}.base_layer" for i in range(LAYERS) for g, ps in (
        ("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps)
    unpatch_model(model)
    assert not any("_fasttune_wide" in m.__dict__ for m in model.modules())


def test_adapters_on_some_projections_only(device, spy):
    """PEFT's default targets (q, v): k runs base-only inside lora_qkv; O and MLP have nothing to fuse."""
    stock, fast, report = stock_and_fast("llama", device, seed=4, targets=["q_proj", "v_proj"])
    assert lora_counts(report) == {"lora_qkv": LAYERS}, str(report)
    reasons = {(f.op, f.reason) for f in report.fallbacks}
    assert reasons == {("lora_o", "no active LoRA adapter on o_proj"),
                       ("lora_mlp", "no active LoRA adapter on gate_proj, up_proj, down_proj")}
    assert {f.where for f in report.fallbacks if f.op == "lora_o"} == {f"model.layers.{i}.self_attn"
                                                                       for i in range(LAYERS)}
    assert_parity(fast, stock, make_batch(VOCAB, seed=14, device=device))
    assert dict(spy) == {"lora_qkv": LAYERS}


# --- configurations that keep PEFT's path --------------------------------------------------------


def _two_active_adapters(model):
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    model.base_model.set_adapter(["default", "other"])


@pytest.mark.parametrize("model_type, lora_kw, setup, expected", [
    ("llama", dict(lora_dropout=0.1), None, dict.fromkeys(LORA_OPS, "lora_dropout > 0")),
    ("llama", dict(use_dora=True), None, dict.fromkeys(LORA_OPS, "LoRA variant")),
    ("qwen2", dict(bias="lora_only"), None, {"lora_qkv": "base layer bias is trainable"}),
    ("qwen2", dict(bias="all"), None, {"lora_qkv": "base layer bias is trainable"}),
    ("llama", dict(lora_bias=True), None, dict.fromkeys(LORA_OPS, "LoRA bias")),
    ("llama", {}, _two_active_adapters, dict.fromkeys(LORA_OPS, "several active LoRA adapters")),
    ("llama", dict(targets=TARGETS[:6], modules_to_save=["down_proj"]), None,
     {"lora_mlp": "down_proj: base layer weight is trainable"}),
    ("llama", dict(modules_to_save=["lm_head"]), None, {}),
], ids=["dropout", "dora", "bias_lora_only", "bias_all", "lora_bias", "two_adapters", "modules_to_save_proj",
        "modules_to_save_head"])
def test_ineligible_modules_keep_peft_path(model_type, lora_kw, setup, expected, device, spy):
    stock = lora_model(model_type, device, seed=5, **lora_kw)
    if setup is not None:
        setup(stock)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    fallbacks = lora_fallbacks(report)
    for op in LORA_OPS:
        mine = [f for f in fallbacks if f.op == op]
        if op in expected:
            assert len(mine) == LAYERS and all(expected[op] in f.reason for f in mine), str(report)
            assert op not in report.patched
        else:
            assert not mine and report.patched[op] == LAYERS, str(report)
    assert_parity(fast, stock, make_batch(VOCAB, seed=15, device=device))
    assert sum(spy.values()) == LAYERS * sum(op not in expected for op in LORA_OPS), spy


# --- adapter state changes after patching ----------------------------------------------------------


@pytest.mark.parametrize("widen", [True, False], ids=["widened", "not_widened"])
def test_disable_merge_and_unload_after_patching(widen, device, spy):
    stock, fast, report = stock_and_fast("llama", device, FastConfig(lora_widen=widen), seed=6)
    batch = make_batch(VOCAB, batch=4, seq=20, seed=16, device=device)  # > 64 rows: no-grad calls stay fused
    fast.eval(), stock.eval()
    with_adapter = logits(stock, batch)
    assert rel_err(logits(fast, batch), with_adapter) <= 1e-6  # the first fused calls widen (lora_widen.py)
    spy.clear()

    with fast.disable_adapter(), stock.disable_adapter():  # DPO's reference pass
        assert rel_err(logits(fast, batch), logits(stock, batch)) <= 1e-6
    # Widened weights run the disabled pass through their widened product (zero tail); O is not
    # widened (its input copy would cost what it saves) and takes PEFT's path, as everything does
    # without widening.
    assert dict(spy) == ({"lora_qkv": LAYERS, "lora_mlp": LAYERS} if widen else {})
    spy.clear()
    assert rel_err(logits(fast, batch), with_adapter) <= 1e-6  # adapters back on: fused again
    assert sum(spy.values()) == fused_calls_per_forward("llama")
    spy.clear()

    fast.merge_adapter(), stock.merge_adapter()
    assert rel_err(logits(fast, batch), logits(stock, batch)) <= 1e-6 and sum(spy.values()) == 0
    fast.unmerge_adapter(), stock.unmerge_adapter()
    assert_parity(fast, stock, batch)
    assert sum(spy.values()) == fused_calls_per_forward("llama")
    spy.clear()

    merged, merged_stock = fast.merge_and_unload(), stock.merge_and_unload()
    merged.eval(), merged_stock.eval()
    assert rel_err(logits(merged, batch), logits(merged_stock, batch)) <= 1e-6 and sum(spy.values()) == 0
    assert patch_report(merged) is report
    unpatch_model(merged)
    assert torch.equal(logits(merged, batch), logits(merged_stock, batch))


def test_deepcopy_of_patched_model_is_patched_independently(device, spy):
    """TRL deep-copies the policy into a reference model: the copy's hooks are its own."""
    stock, fast, report = stock_and_fast("phi3", device, seed=7)
    twin = copy.deepcopy(fast)
    unpatch_model(fast)  # the original's undo must leave the copy patched
    assert lora_counts(patch_report(twin)) == dict.fromkeys(LORA_OPS, LAYERS)
    assert_parity(twin, stock, make_batch(VOCAB, seed=17, device=device))
    assert sum(spy.values()) == fused_calls_per_forward("phi3")


def test_forward_hooks_on_a_projection_keep_its_module_stock(device, spy):
    stock, fast, _ = stock_and_fast("llama", device, seed=8)
    seen = []
    q0 = fast.base_model.model.model.layers[0].self_attn.q_proj
    handle = q0.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    batch = make_batch(VOCAB, seed=18, device=device)
    assert_parity(fast, stock, batch)
    assert len(seen) == 1 and spy["lora_qkv"] == LAYERS - 1  # layer 0's QKV ran PEFT's path per call
    handle.remove()
    report = patch_model(fast, FastConfig())  # at patch time the hook is reported
    assert not lora_fallbacks(report)
    q0.register_forward_hook(lambda *a: None)
    report = patch_model(fast, FastConfig())
    assert [(f.op, f.where) for f in lora_fallbacks(report)] == [("lora_qkv", "model.layers.0.self_attn")]
    assert "forward hooks" in lora_fallbacks(report)[0].reason


def test_lora_off_installs_nothing():
    stock, fast, report = stock_and_fast("qwen3", "cpu", seed=9, config=FastConfig(lora=False))
    assert not lora_counts(report) and not lora_fallbacks(report), str(report)
    forwards = [m.__dict__["forward"] for m in fast.modules() if "forward" in m.__dict__]
    attn = [f for f in forwards if isinstance(f, FastAttentionForward)]
    mlp = [f for f in forwards if isinstance(f, FastMLPForward)]
    assert len(attn) == len(mlp) == LAYERS
    assert all(f.project_qkv is project_qkv_separate and f.project_o is project_o for f in attn)
    assert all(f.fused_mlp is None for f in mlp)


def test_full_finetuning_model_is_left_alone():
    report = patch_model(tiny_model("llama", vocab_size=VOCAB), FastConfig())
    assert not lora_counts(report) and not lora_fallbacks(report), str(report)


# --- per-call rules ------------------------------------------------------------------------------


def test_call_specs_dtype_rules():
    model = lora_model("llama", "cpu", seed=10)
    attn = model.base_model.model.model.layers[0].self_attn
    names = lora_mod.QKV_NAMES["separate"]
    x = torch.randn(2, 3, 96)
    assert isinstance(lora_mod.call_specs(attn, names, x), list)
    assert "compute dtype" in lora_mod.call_specs(attn, names, x.bfloat16())  # stock would raise/upcast
    assert "float64" in lora_mod.call_specs(attn, names, x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert isinstance(lora_mod.call_specs(attn, names, x), list)
        attn.q_proj.lora_A["default"].half()
        assert "adapter is torch.float16" in lora_mod.call_specs(attn, names, x)


def test_call_specs_follow_bitsandbytes_compute_dtype(device):
    model = lora_model("llama", device, seed=11, nf4=True)
    attn = model.base_model.model.model.layers[0].self_attn
    names = lora_mod.QKV_NAMES["separate"]
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16, device=device)
    for name in names:
        proj = getattr(attn, name)
        proj.lora_A["default"].bfloat16(), proj.lora_B["default"].bfloat16()
        proj.base_layer.compute_dtype = torch.bfloat16  # BitsAndBytesConfig(bnb_4bit_compute_dtype=bf16)
    assert isinstance(lora_mod.call_specs(attn, names, x), list)
    attn.k_proj.base_layer.compute_dtype = torch.float32  # stock upcasts x to fp32 there
    assert "k_proj: activations not in the layer's compute dtype" in lora_mod.call_specs(attn, names, x)
    # A Linear4bit built without a compute dtype adopts a bf16 input's dtype at its first forward.
    attn.k_proj.base_layer.compute_dtype, attn.k_proj.base_layer.compute_type_is_set = None, False
    assert isinstance(lora_mod.call_specs(attn, names, x), list)
    with torch.no_grad():  # inference: bitsandbytes' 4-bit kernels (dense layers stay fused)
        assert "NF4 inference" in lora_mod.call_specs(attn, names, x.repeat(1, 30, 1))
        assert "decode step" in lora_mod.call_specs(attn, names, x)  # 6 rows: stock, whatever the base
    qs = attn.q_proj.base_layer.weight.quant_state
    qs.packing_format_for_cpu = True
    assert "repacked" in lora_mod.projection_specs(attn, names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="bitsandbytes' CPU inference path")
def test_nf4_weights_repacked_by_cpu_inference_fall_back(spy):
    """bitsandbytes repacks NF4 weights in place on a CPU eval forward without grad (when the CPU
    has AVX512-BF16); the fused path must not read the repacked bytes as NF4 afterwards."""
    model = lora_model("llama", "cpu", seed=12, nf4=True)
    report = patch_model(model, FastConfig())
    batch = make_batch(VOCAB, seed=19)
    model.eval()
    with torch.no_grad():  # the stock path through bitsandbytes (NF4 inference, no bordered group yet)
        logits(model, batch)
    attn = model.base_model.model.model.layers[0].self_attn
    if not getattr(attn.q_proj.base_layer.weight.quant_state, "packing_format_for_cpu", False):
        pytest.skip("bitsandbytes does not repack NF4 weights on this CPU")
    assert "repacked" in lora_mod.projection_specs(attn, lora_mod.QKV_NAMES["separate"])
    assert lora_counts(report) == dict.fromkeys(LORA_OPS, LAYERS)
    model.train()
    assert torch.isfinite(step(model, batch)) and sum(spy.values()) == 0


# --- mixed precision and training ------------------------------------------------------------------


def _autocast_errors(device, nf4):
    """Loss and adapter-gradient errors of stock and fast bf16-autocast runs vs the fp32 run."""
    stock, fast, _ = stock_and_fast("llama", device, seed=13, nf4=nf4)
    batch = make_batch(VOCAB, seed=20, device=device)
    stock.train(), fast.train()
    ref_loss = step(stock, batch)
    ref = {n: p.grad.double() for n, p in stock.named_parameters() if p.requires_grad}
    errs = {}
    for name, model in (("stock", stock), ("fast", fast)):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = step(model, batch)
        errs[name] = [rel_err(loss, ref_loss)] + [rel_err(p.grad, ref[n]) for n, p in model.named_parameters()
                                                  if p.requires_grad]
    return errs


@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_autocast_bf16_within_bf16_noise(device, nf4, spy):
    """Under bf16 autocast (Trainer bf16=True) the fused path is taken and, against the fp32 run,
    errs no more than 2× stock PEFT under the same autocast, + 2e-3 (tiny model, 34 tokens: both
    err up to ~3e-2 on single gradients; measured max(fast − 2·stock) ≈ 2e-6)."""
    errs = _autocast_errors(device, nf4)
    assert sum(spy.values()) == fused_calls_per_forward("llama")
    assert sum(spy.values()) == fused_calls_per_forward("llama")
    bad = [(i, f, s) for i, (f, s) in enumerate(zip(errs["fast"], errs["stock"])) if not f <= 2 * s + 2e-3]
    assert not bad, bad


def test_fasttrainer_qlora_matches_stock_trainer(tmp_path, device):
    from transformers import Trainer, TrainingArguments

    from fasttune import FastTrainer
    from fasttune.embedded import PadCollator
    from helpers.train_data import random_lm_rows

    def args(sub):
        return TrainingArguments(output_dir=str(tmp_path / sub), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=device == "cpu", seed=0, dataloader_num_workers=0, disable_tqdm=True)

    rows = random_lm_rows(VOCAB, n=8)
    kw = dict(train_dataset=rows, data_collator=PadCollator(pad_token_id=0))
    stock = Trainer(model=lora_model("llama", device, seed=14, nf4=True), args=args("s"), **kw)
    fast = FastTrainer(model=lora_model("llama", device, seed=14, nf4=True), args=args("f"),
                       fast_config=FastConfig(checkpointing="recompute"), **kw)
    assert lora_counts(fast.patch_report) == dict.fromkeys(LORA_OPS, LAYERS), str(fast.patch_report)
    losses = []
    for trainer in (fast, stock):
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(losses[0]) == len(losses[1]) == 2
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(b), losses


# --- GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_bf16_model_larger_shapes_gpu(nf4, spy):
    """bf16 weights (no autocast), 8B-like widths per layer, sequence 512: fused vs stock PEFT,
    both against an fp32 run of the same (dequantised) weights, within 2× stock's error + 5e-3."""
    sizes = dict(hidden_size=1024, intermediate_size=2816, head_dim=128, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024)
    base = tiny_model("llama", seed=15, **sizes)
    if nf4:
        quantize_nf4_(base)
    kw = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS[:7], init_lora_weights=False)
    torch.manual_seed(16)
    ref = get_peft_model(base, LoraConfig(**kw)).cuda()  # fp32 (NF4: fp32 compute) reference
    stock = copy.deepcopy(ref)
    for name, p in stock.named_parameters():  # a bf16 model with PEFT's float32 adapters
        if p.is_floating_point() and "lora_" not in name:
            p.data = p.data.bfloat16()
    for m in stock.modules():
        if type(m).__name__ == "Linear4bit":  # dequantises the same codes, computes in bf16
            m.compute_dtype, m.compute_type_is_set = torch.bfloat16, True
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert lora_counts(report) == dict.fromkeys(LORA_OPS, LAYERS), str(report)
    batch = make_batch(VOCAB, batch=2, seq=512, seed=21, device="cuda")
    for m in (ref, stock, fast):
        m.train()
    ref_loss = step(ref, batch)
    ref_grads = {n: p.grad.double() for n, p in ref.named_parameters() if p.requires_grad}
    errs = {}
    for name, model in (("stock", stock), ("fast", fast)):
        loss = step(model, batch)
        errs[name] = [rel_err(loss, ref_loss)] + [rel_err(p.grad, ref_grads[n])
                                                  for n, p in model.named_parameters() if p.requires_grad]
    assert sum(spy.values()) == fused_calls_per_forward("llama")
    bad = [(i, f, s) for i, (f, s) in enumerate(zip(errs["fast"], errs["stock"])) if not f <= 2 * s + 5e-3]
    assert not bad, bad
