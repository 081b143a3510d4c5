"""The MLP stash (``FastConfig.mlp_stash``): an offloaded layer's gated MLP keeps what it saves (its input, the
gate/up products) in host memory, and the recompute skips it.

Gradients are compared with ``torch.equal`` against a run without checkpointing: the MLP's own nodes run in
backward on exact copies of what they saved. Tiny models save tensors far below the stash's 1 MiB floor, so
each test lowers it to 0. The MLP comes last in a layer and then saves nothing through the checkpoint, so
torch's recompute usually stops before reaching it (its early stop): "not recomputed" is counted as the MLP's
computations, not as the stash's ``cores_skipped``.
"""

from __future__ import annotations

import pytest
import torch

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model
from fasttune.model_patches.checkpointing import layer_checkpointing
from fasttune.model_patches.mlp import FastMLPForward
from helpers.stash_steps import MEASURING_STEPS, assert_bitwise, seeded_step, steps_with_the_budget_forced_open
from helpers.tiny_models import make_batch, tiny_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(model_type="llama", device="cpu", dtype=torch.float32, lora=True, lora_dropout=0.0, **overrides):
    model = tiny_model(model_type, dtype=dtype, seed=0, **overrides)
    model.set_attn_implementation("sdpa")
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if model_type == "phi3" else LORA_TARGETS
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=lora_dropout,
                                                 init_lora_weights=False))
    return model.to(device).train()


def _stashed(model, mode="offload", **config):
    patch_model(model, FastConfig(checkpointing=mode, **{"mlp_stash": True, "attention_stash": False, **config}))
    chain = layer_checkpointing(model).stash
    chain.min_bytes = 0
    return chain


def _count_mlp_computes(monkeypatch) -> list:
    calls = []
    real = FastMLPForward._compute
    monkeypatch.setattr(FastMLPForward, "_compute", lambda self, x: calls.append(1) or real(self, x))
    return calls


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "olmo2", "gemma"])
def test_bitwise_equal_to_no_checkpointing_and_the_mlp_is_not_recomputed(model_type, lora, monkeypatch):
    """Separate and fused (Phi-3) gate/up, SwiGLU and GeGLU (Gemma); OLMo2's post-MLP norm saves the MLP's output,
    which then goes to the host too (``mlp_output_saved``)."""
    batch = make_batch(tiny_model(model_type).config.vocab_size, seed=0)
    reference = _model(model_type, lora=lora)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    model = _model(model_type, lora=lora)
    chain = _stashed(model)
    calls = _count_mlp_computes(monkeypatch)
    got = seeded_step(model, batch)
    assert_bitwise(got, ref)
    layers = model.config.num_hidden_layers
    assert chain.stats.cores_stashed == layers, chain.stats
    assert len(calls) == layers  # forward only: no recompute ran the MLP again
    assert chain.stats.blocks >= 2 * layers  # its input and the gate/up products, not only an output


def test_with_the_attention_stash_both_cores_of_each_layer_go(monkeypatch):
    batch = make_batch(_model().config.vocab_size, seed=1)
    reference, model = _model(), _model()
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    chain = _stashed(model, attention_stash=True)
    calls = _count_mlp_computes(monkeypatch)
    assert_bitwise(seeded_step(model, batch), ref)
    layers = model.config.num_hidden_layers
    assert chain.stats.cores_stashed == 2 * layers and chain.stats.cores_skipped >= layers, chain.stats
    assert len(calls) == layers


def test_host_memory_comes_back_and_steps_repeat_bitwise():
    model = _model()
    chain = _stashed(model)
    batch = make_batch(model.config.vocab_size, seed=2)
    first = seeded_step(model, batch)
    pool = layer_checkpointing(model).checkpointer.pool
    for _ in range(2):
        assert chain.host_bytes == 0, "blocks outlived the backward"
        assert_bitwise(seeded_step(model, batch), first)
        assert pool.bytes_in_use == 0 and pool.bytes_total <= pool.peak_bytes_in_use


def test_a_core_with_nothing_large_enough_to_copy_keeps_its_tensors_on_the_device():
    """At the default 1 MiB floor a tiny model's MLP saves nothing worth a copy: the core is stashed with no
    blocks (everything stays on the device, held by the graph) and is still not recomputed."""
    batch = make_batch(_model().config.vocab_size, seed=6)
    reference, model = _model(), _model()
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    patch_model(model, FastConfig(checkpointing="offload", mlp_stash=True, attention_stash=False))
    chain = layer_checkpointing(model).stash
    assert_bitwise(seeded_step(model, batch), ref)
    assert chain.stats.cores_stashed == model.config.num_hidden_layers and chain.stats.blocks == 0, chain.stats


def test_lora_dropout_keeps_the_mlp_recomputed(monkeypatch):
    """Dropout inside the MLP (PEFT's lora_dropout, on the unfused path) draws random numbers: skipping the MLP
    in the recompute would shift them for what follows, so it is recomputed, as without the stash."""
    batch = make_batch(_model().config.vocab_size, seed=3)
    plain, model = _model(lora_dropout=0.1), _model(lora_dropout=0.1)
    patch_model(plain, FastConfig(checkpointing="offload"))
    chain = _stashed(model)
    assert_bitwise(seeded_step(model, batch), seeded_step(plain, batch))
    assert chain.stats.cores_stashed == 0


def test_moe_layers_stash_their_dense_mlp_not_a_shared_expert(monkeypatch):
    """Each tiny MoE model has one dense layer (``mlp_only_layers``): its MLP is stashed. Qwen2-MoE's shared
    expert is an MLP of the same class inside the other layer's MoE block, not a layer's MLP: it runs as usual
    (else two cores would go)."""
    for model_type in ("qwen3_moe", "qwen2_moe"):
        batch = make_batch(tiny_model(model_type).config.vocab_size, seed=4)
        reference, model = _model(model_type, lora=False), _model(model_type, lora=False)
        patch_model(reference, FastConfig())
        chain = _stashed(model)
        assert_bitwise(seeded_step(model, batch), seeded_step(reference, batch))
        assert chain.stats.cores_stashed == 1, (model_type, chain.stats)


def test_auto_stashes_both_cores_of_the_offloaded_layers():
    """"auto" on a CPU without a budget: layer 0 runs resident once (measured, nothing stashed), the rest are
    offloaded and each sends its attention core and its MLP."""
    batch = make_batch(_model().config.vocab_size, seed=5)
    reference, model = _model(), _model()
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    chain = _stashed(model, mode="auto", attention_stash=True)
    assert_bitwise(seeded_step(model, batch), ref)
    assert chain.stats.cores_stashed == 2 * (model.config.num_hidden_layers - 1), chain.stats


def test_recompute_mode_refuses_it():
    with pytest.raises(ValueError, match="mlp_stash"):
        FastConfig(checkpointing="recompute", mlp_stash=True)


def test_without_a_checkpointing_mode_nothing_is_stashed():
    model = _model()
    patch_model(model, FastConfig(mlp_stash=True))
    assert layer_checkpointing(model) is None or layer_checkpointing(model).stash is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bitwise_equal_with_copies_on_their_stream_and_originals_let_go_in_stream_order(deterministic, dtype):
    """The first steps stash nothing and measure the link and the layers; then every core goes (the budget
    forced open: the most copies in flight and originals held), on the stashes' own stream, the originals let go
    in stream order. Every step equals the run without checkpointing, nothing is held after a backward, and the
    reserve does not grow from step to step."""
    batch = make_batch(tiny_model("llama").config.vocab_size, batch=4, seq=1024, seed=9, device="cuda")
    kw = dict(dtype=dtype, num_hidden_layers=6, hidden_size=512, intermediate_size=2048)
    reference, model = _model("llama", "cuda", **kw), _model("llama", "cuda", **kw)
    patch_model(reference, FastConfig())
    chain = _stashed(model, attention_stash=True)
    ref = seeded_step(reference, batch)
    layers = model.config.num_hidden_layers

    def measured(stats):
        assert stats.cores_stashed == 0 and stats.cores_link_busy == MEASURING_STEPS * 2 * layers, stats

    steps_with_the_budget_forced_open(model, chain, batch, ref, measured)
    state = layer_checkpointing(model)
    assert state.checkpointer.pool.pin and chain.host_bytes == 0
    assert chain.stats.cores_stashed >= 3 * 2 * layers, chain.stats
