"""The o_proj stash (``FastConfig.o_proj_stash``): an offloaded layer's fused LoRA o_proj copies its output to the
host, and the recompute takes it back instead of running the product again.

Gradients are compared with ``torch.equal`` against a run without checkpointing. "Not recomputed" is counted as
the base products ``kernels.lora.project`` runs: one fewer per layer and step than with the stash off.
"""

from __future__ import annotations

import pytest
import torch

from fasttune.config import FastConfig
from fasttune.kernels import lora as lora_kernels
from fasttune.kernels.lora import lora_linear
from fasttune.model_patches import patch_model
from fasttune.model_patches.attention_stash import OUTPUT
from fasttune.model_patches.checkpointing import layer_checkpointing
from helpers.stash_steps import assert_bitwise, seeded_step, steps_with_the_budget_forced_open
from helpers.tiny_models import make_batch, tiny_model

from .test_lora import lora_model

ALONE = dict(attention_stash=False)  # the o_proj stash by itself (the attention stash is on by default too)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(model_type="llama", device="cpu", dtype=torch.float32, **overrides):
    from peft import LoraConfig, get_peft_model

    model = tiny_model(model_type, dtype=dtype, seed=0, **overrides)
    model.set_attn_implementation("sdpa")
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if model_type == "phi3" else LORA_TARGETS
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                             init_lora_weights=False))
    return model.to(device).train()


def _count_products(monkeypatch) -> list:
    calls = []
    real = lora_kernels.project
    monkeypatch.setattr(lora_kernels, "project", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _products_per_step(model, batch, monkeypatch) -> int:
    calls = _count_products(monkeypatch)
    seeded_step(model, batch)
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "phi3", "olmo2", "gemma"])
def test_bitwise_equal_to_no_checkpointing_and_o_proj_is_not_multiplied_again(model_type, monkeypatch):
    """q/k/v biases (Qwen2), q/k norms (Qwen3, OLMo2), a fused qkv (Phi-3), OLMo2's norm of the attention output,
    Gemma's scaled embeddings and GeGLU: on by default with "offload"; one base product fewer per layer."""
    batch = make_batch(tiny_model(model_type).config.vocab_size, seed=0)
    reference = _model(model_type)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    model, off = _model(model_type), _model(model_type)
    patch_model(model, FastConfig(checkpointing="offload", **ALONE))
    patch_model(off, FastConfig(checkpointing="offload", o_proj_stash=False, **ALONE))
    assert layer_checkpointing(off).stash is None
    chain = layer_checkpointing(model).stash
    chain.min_bytes = 0  # tiny outputs: below the 1 MiB floor they would be recomputed
    assert OUTPUT in chain.kinds
    layers = model.config.num_hidden_layers
    assert _products_per_step(off, batch, monkeypatch) - _products_per_step(model, batch, monkeypatch) == layers
    assert_bitwise(seeded_step(model, batch), ref)
    assert chain.stats.outputs_kept == chain.stats.outputs_reused == 2 * layers, chain.stats  # two steps
    assert chain.host_bytes == 0, "blocks outlived the backward"


def test_nf4_bases_only_when_asked_for_and_then_bitwise():
    """QLoRA (bitsandbytes NF4, fp32 compute): by default an NF4 o_proj is recomputed (measured slower with the
    stash); with ``o_proj_stash=True`` its recompute skips the product and the backward dequantises the weight
    for dX = dY W as without checkpointing: gradients bitwise those of the unchecked run."""
    pytest.importorskip("bitsandbytes")
    batch = make_batch(1000, seed=5)
    reference = lora_model("llama", "cpu", nf4=True).train()
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    for forced in (None, True):
        model = lora_model("llama", "cpu", nf4=True).train()
        patch_model(model, FastConfig(checkpointing="offload", o_proj_stash=forced, **ALONE))
        chain = layer_checkpointing(model).stash
        chain.min_bytes = 0
        assert_bitwise(seeded_step(model, batch), ref)
        kept = model.config.num_hidden_layers if forced else 0
        assert chain.stats.outputs_kept == chain.stats.outputs_reused == kept, (forced, chain.stats)


def test_with_the_attention_and_mlp_stashes_and_under_auto():
    batch = make_batch(_model().config.vocab_size, seed=1)
    reference = _model()
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    layers = reference.config.num_hidden_layers
    for config in (dict(checkpointing="offload", attention_stash=True, mlp_stash=True), dict(checkpointing="auto")):
        model = _model()
        patch_model(model, FastConfig(**config))
        chain = layer_checkpointing(model).stash
        chain.min_bytes = 0
        assert_bitwise(seeded_step(model, batch), ref)
        # "auto" without CUDA keeps nothing resident, but a shape's first forward measures layer 0 resident.
        offloaded = layers - 1 if config["checkpointing"] == "auto" else layers
        assert chain.stats.outputs_reused == offloaded, (config, chain.stats)


def test_off_where_the_layers_forward_runs_without_autograd_unless_asked_for():
    """Mixture-of-experts families run a checkpointed layer's forward without autograd by default; the stash
    would make each layer record it again, so it stays off there unless set."""
    model_type = "qwen3_moe"
    batch = make_batch(tiny_model(model_type).config.vocab_size, seed=2)
    reference = _model(model_type)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    plain = _model(model_type)
    patch_model(plain, FastConfig(checkpointing="offload"))
    assert layer_checkpointing(plain).stash is None
    model = _model(model_type)
    patch_model(model, FastConfig(checkpointing="offload", o_proj_stash=True, **ALONE))
    layer_checkpointing(model).stash.min_bytes = 0
    assert_bitwise(seeded_step(model, batch), ref)
    assert layer_checkpointing(model).stash.stats.outputs_reused == model.config.num_hidden_layers


def test_outputs_under_the_floor_are_recomputed():
    batch = make_batch(_model().config.vocab_size, seed=3)
    model = _model()
    patch_model(model, FastConfig(checkpointing="offload", **ALONE))
    chain = layer_checkpointing(model).stash
    seeded_step(model, batch)
    assert chain.stats.outputs_kept == chain.stats.outputs_reused == chain.stats.blocks == 0, chain.stats


def test_recompute_mode_refuses_it_and_keeps_nothing():
    with pytest.raises(ValueError, match="o_proj_stash"):
        FastConfig(checkpointing="recompute", o_proj_stash=True)
    model = _model()
    patch_model(model, FastConfig(checkpointing="recompute"))
    assert layer_checkpointing(model).stash is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_given_its_output_saves_the_same_and_multiplies_nothing(dtype, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    w = torch.randn(40, 24, dtype=dtype)
    a = torch.randn(4, 24, requires_grad=True)
    b = torch.randn(40, 4, requires_grad=True)
    y = lora_linear(x, w, a, b, 2.0)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, (x, a, b), dy)
    calls = _count_products(monkeypatch)
    again = lora_linear(x, w, a, b, 2.0, known_output=y.detach().clone())
    assert not calls and torch.equal(again, y)
    got = torch.autograd.grad(again, (x, a, b), dy)
    assert all(torch.equal(g, e) for g, e in zip(got, want))
    with pytest.raises(ValueError, match="known_output"):
        lora_linear(x, w, a, b, 2.0, known_output=y[..., :39])
    with pytest.raises(ValueError, match="known_output"):
        lora_linear(x, w, a, b, 2.0, known_output=y.double())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bitwise_equal_with_the_outputs_sent_and_taken_back(deterministic, dtype):
    """The first steps send nothing (the link is measured), then every o_proj output goes (budget forced open):
    every step equals the run without checkpointing, nothing is held after a backward, the reserve is steady."""
    batch = make_batch(tiny_model("llama").config.vocab_size, batch=4, seq=1024, seed=9, device="cuda")
    kw = dict(dtype=dtype, num_hidden_layers=6, hidden_size=512, intermediate_size=2048)
    reference, model = _model("llama", "cuda", **kw), _model("llama", "cuda", **kw)
    patch_model(reference, FastConfig())
    patch_model(model, FastConfig(checkpointing="offload", **ALONE))
    chain = layer_checkpointing(model).stash
    ref = seeded_step(reference, batch)
    layers = model.config.num_hidden_layers

    def measured(stats):
        assert stats.outputs_kept == 0, stats

    steps_with_the_budget_forced_open(model, chain, batch, ref, measured)
    assert chain.stats.outputs_kept >= 3 * layers and chain.stats.outputs_reused == 3 * layers, chain.stats
    assert chain.host_bytes == 0
