"""Patching is safe: unsupported models, modules and options stay stock and are reported; flags are
honoured; patches are per instance, repeatable and leave transformers' classes untouched."""

from __future__ import annotations

import copy
import importlib
import logging

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from fasttune import FAMILIES, FastConfig, patch_model, unpatch_model
from fasttune.model_patches.attention import FastAttentionForward
from fasttune.model_patches.mlp import FastMLPForward
from fasttune.model_patches.norm import FastRMSNormForward
from helpers.compare import assert_grads_close, rel_err
from helpers.tiny_models import FAMILY_TYPES, make_batch, tiny_model


def _forwards(model) -> dict[str, object]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


def _loss_and_grads(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def _assert_parity(fast, stock, seed=0):
    batch = make_batch(stock.config.vocab_size, seed=seed)
    assert rel_err(_loss_and_grads(fast, batch), _loss_and_grads(stock, batch)) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)


def test_unknown_model_type_stays_stock_and_says_why(caplog):
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    stock = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="fasttune"):
        report = patch_model(model, FastConfig())
    assert not report.patched
    assert [(f.op, f.where) for f in report.fallbacks] == [("*", "gpt2")]
    assert all(t in report.fallbacks[0].reason for t in FAMILIES)
    assert any("gpt2" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert _forwards(model) == {}
    batch = make_batch(500, seed=1)
    model.train(), stock.train()
    torch.manual_seed(2)
    a = model(**batch)
    torch.manual_seed(2)  # gpt2 has dropout: same seed, same masks
    b = stock(**batch)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


class _CustomMLP(nn.Module):
    """A user's replacement MLP (same math as LlamaMLP, another class)."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _CustomNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def test_modules_of_another_class_stay_stock_others_are_patched():
    stock = tiny_model("llama", seed=3)
    stock.model.layers[1].mlp = _CustomMLP(stock.model.layers[1].mlp)
    stock.model.layers[0].input_layernorm = _CustomNorm(stock.model.layers[0].input_layernorm)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert report.patched["mlp"] == 1 and report.patched["rms_norm"] == 4 and report.patched["rope"] == 2
    where = {(f.op, f.where): f.reason for f in report.fallbacks}
    assert "_CustomMLP" in where[("mlp", "model.layers.1.mlp")]
    assert "_CustomNorm" in where[("rms_norm", "model.layers.0.input_layernorm")]
    forwards = _forwards(fast)
    assert "model.layers.1.mlp" not in forwards and isinstance(forwards["model.layers.0.mlp"], FastMLPForward)
    assert "model.layers.0.input_layernorm" not in forwards
    _assert_parity(fast, stock)


def test_activation_without_kernel_falls_back():
    stock = tiny_model("llama", seed=4, hidden_act="relu2")
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert "mlp" not in report.patched and report.patched["rope"] == 2
    reasons = [f.reason for f in report.fallbacks if f.op == "mlp"]
    assert len(reasons) == 2 and all("'relu2'" in r and "silu" in r for r in reasons)
    _assert_parity(fast, stock)


def test_config_disagreeing_with_the_module_falls_back():
    # The MLPs were built with gelu_pytorch_tanh; a config edited afterwards says exact gelu.
    stock = tiny_model("gemma2", seed=5)
    stock.config.hidden_activation = "gelu"
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert "mlp" not in report.patched
    assert all("disagree" in f.reason for f in report.fallbacks if f.op == "mlp")
    _assert_parity(fast, stock)


def test_float64_model_stays_stock_and_runtime_dtypes_never_crash():
    stock = tiny_model("qwen3", seed=6).double()
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(cross_entropy=False))
    assert not report.patched
    assert {f.op for f in report.fallbacks} == {"rms_norm", "rope", "mlp"}
    assert all("float64" in f.reason for f in report.fallbacks)
    # Patched in fp32, then cast: every patched forward routes float64 tensors to the stock math.
    fast = copy.deepcopy(stock).float()
    patch_model(fast, FastConfig(cross_entropy=False))
    fast.double()
    _assert_parity(fast, stock)


@pytest.mark.parametrize("flags, expected", [
    (dict(rms_norm=False, rope=False, mlp=False, lora=False, cross_entropy=False), {}),
    (dict(rms_norm=False), {"rope": 2, "mlp": 2, "cross_entropy": 1}),
    (dict(rope=False), {"rms_norm": 9, "residual_norms": 2, "attention_hook": 2, "mlp": 2, "cross_entropy": 1}),
    (dict(rope=False, mlp=False, lora=False, cross_entropy=False), {"rms_norm": 9, "residual_norms": 2}),
    (dict(mlp=False, cross_entropy=False), {"rms_norm": 9, "residual_norms": 2, "rope": 2, "mlp_hook": 2}),
    (dict(residual_norms=False, cross_entropy=False), {"rms_norm": 9, "rope": 2, "mlp": 2}),
])
def test_config_flags_are_honoured(flags, expected):
    stock = tiny_model("qwen3", seed=7)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig(**flags))
    assert dict(report.patched) == expected and not report.fallbacks
    kinds = {type(f).__name__ for f in _forwards(fast).values()}
    assert ("FastRMSNormForward" in kinds) == ("rms_norm" in expected)
    assert ("FusedResidualLayerForward" in kinds) == ("residual_norms" in expected)
    assert ("FastAttentionForward" in kinds) == bool({"rope", "attention_hook"} & set(expected))
    assert ("FastMLPForward" in kinds) == bool({"mlp", "mlp_hook"} & set(expected))
    for fwd in _forwards(fast).values():
        if isinstance(fwd, FastAttentionForward):
            assert fwd.use_rope_kernel == ("rope" in expected)
        if isinstance(fwd, FastMLPForward):
            assert (fwd.activation is not None) == ("mlp" in expected)
    _assert_parity(fast, stock)


def test_patching_twice_repatches_cleanly():
    stock = tiny_model("gemma", seed=8)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    report = patch_model(fast, FastConfig(rope=False, lora=False))
    assert dict(report.patched) == {"rms_norm": 5, "residual_norms": 2, "mlp": 2, "cross_entropy": 1}
    forwards = _forwards(fast)
    assert not any(isinstance(f, FastAttentionForward) for f in forwards.values())
    for name, fwd in forwards.items():  # each wraps the class forward, not an earlier patch
        assert fwd.stock.__func__ is type(fwd.module).forward, name
    _assert_parity(fast, stock)
    unpatch_model(fast)
    assert _forwards(fast) == {}


def test_two_models_patched_differently_do_not_interfere():
    stock = tiny_model("mistral", seed=9)
    full, norms_only = copy.deepcopy(stock), copy.deepcopy(stock)
    patch_model(full, FastConfig())
    patch_model(norms_only, FastConfig(rope=False, mlp=False, lora=False, cross_entropy=False))
    kinds = lambda m: {type(f).__name__ for f in _forwards(m).values()}  # noqa: E731
    norms = {"FastRMSNormForward", "FusedResidualLayerForward"}
    assert kinds(norms_only) == norms
    assert kinds(full) == norms | {"FastAttentionForward", "FastMLPForward", "FusedLossCausalLMForward"}
    _assert_parity(full, stock, seed=1)
    _assert_parity(norms_only, stock, seed=2)
    unpatch_model(full)
    assert _forwards(full) == {} and kinds(norms_only) == norms


def _class_snapshot():
    """Every attribute of every class and function in the ten modeling modules, plus the bases."""
    from transformers import PreTrainedModel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    snap = {("nn.Module", k): v for k, v in vars(nn.Module).items()}
    snap.update({("PreTrainedModel", k): v for k, v in vars(PreTrainedModel).items()})
    snap.update({("ALL_ATTENTION_FUNCTIONS", k): v for k, v in dict(ALL_ATTENTION_FUNCTIONS).items()})
    for spec in FAMILIES.values():
        mod = importlib.import_module(spec.modeling_module)
        for name, obj in vars(mod).items():
            snap[(spec.modeling_module, name)] = obj
            if isinstance(obj, type):
                snap.update({(f"{spec.modeling_module}.{name}", k): v for k, v in vars(obj).items()})
    return snap


def test_transformers_classes_and_functions_are_untouched():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    saved = (LlamaAttention.forward, LlamaMLP.forward, LlamaRMSNorm.forward)
    models = [tiny_model(t, seed=10) for t in FAMILY_TYPES]  # building caches flags on classes: before
    before = _class_snapshot()
    for model in models:
        patch_model(model, FastConfig())
        assert _forwards(model)
    after = _class_snapshot()
    changed = [k for k in before.keys() | after.keys() if before.get(k, "missing") is not after.get(k, "missing")]
    assert not changed, changed[:10]
    assert (LlamaAttention.forward, LlamaMLP.forward, LlamaRMSNorm.forward) == saved


def test_patched_forwards_keep_the_stock_signatures():
    import inspect

    model = tiny_model("phi3", seed=11)
    stock = copy.deepcopy(model)
    patch_model(model, FastConfig())
    originals = dict(stock.named_modules())
    checked = 0
    for name, fwd in _forwards(model).items():
        assert inspect.signature(fwd) == inspect.signature(originals[name].forward), name
        checked += 1
    assert checked == 5 + 2 + 2 + 1
    assert isinstance(model.model.norm.forward, FastRMSNormForward)


def test_a_deep_copy_of_a_patched_model_runs_on_its_own_modules():
    # TRL builds reference models with deepcopy: the copy's forwards must drive the copy.
    model = tiny_model("llama", seed=12)
    patch_model(model, FastConfig())
    twin = copy.deepcopy(model)
    for name, fwd in _forwards(twin).items():
        assert fwd.module is twin.get_submodule(name) and fwd.stock.__self__ is fwd.module, name
    batch = make_batch(model.config.vocab_size, seed=13)
    with torch.no_grad():
        before = model(**batch).loss
        twin.model.layers[0].mlp.down_proj.weight.zero_()
        assert torch.equal(model(**batch).loss, before) and not torch.equal(twin(**batch).loss, before)


def test_unpatching_a_deep_copy_leaves_the_original_patched():
    model = tiny_model("llama", seed=14)
    patch_model(model, FastConfig())
    twin = copy.deepcopy(model)
    unpatch_model(twin)
    assert _forwards(twin) == {} and len(_forwards(model)) == 12  # 5 norms, 2 layers, 2 attn, 2 MLPs, the head
