"""The experts stash (``FastConfig.experts_stash``): an offloaded mixture-of-experts layer's routed
experts keep what their grouped Function saves (the gate/up product, the input, the routing) in host
memory, and the recompute skips them.

Gradients are compared with ``torch.equal`` against a run without checkpointing (CPU: every kernel
is deterministic there). Tiny models save tensors far below the stash's 1 MiB floor, so each test
lowers it to 0.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model
from fasttune.model_patches.checkpointing import layer_checkpointing
from helpers.spies import grouped_mlp_output_unused
from helpers.stash_steps import MEASURING_STEPS, assert_bitwise, seeded_step
from helpers.tiny_models import make_batch, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

MOE_BLOCKS = {"qwen3_moe": 1, "mixtral": 2, "gpt_oss": 2, "qwen2_moe": 1}  # per tiny model (Qwen3-MoE's first layer is dense)
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model(model_type, lora, device="cpu", dtype=torch.float32):
    model = tiny_model(model_type, dtype=dtype, seed=0)
    if model_type != "gpt_oss":  # (no sdpa for gpt-oss's sinks)
        model.set_attn_implementation("sdpa")  # the attention stash takes no eager attention
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMS,
                            init_lora_weights=False)
        model = get_peft_model(model, config)
    return model.to(device).train()


def _stashed(model, mode="offload", **config):
    patch_model(model, FastConfig(checkpointing=mode, experts_stash=True, **config))
    chain = layer_checkpointing(model).stash
    chain.min_bytes = 0
    return chain


def _gate_up_bytes(model, batch) -> int:
    """Bytes of one MoE block's gate/up product [tokens·k, 2I] (what a custom Function saves)."""
    config = model.config
    experts = next(m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor))
    w = experts.gate_up_proj
    two_i = w.shape[2] if getattr(experts, "is_transposed", False) else w.shape[1]
    return batch["input_ids"].numel() * config.num_experts_per_tok * two_i * w.element_size()


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the Triton path's Function calls; on a CUDA machine "
                    "these CPU tensors take the reference path (the interpreter is on only without CUDA)")
@pytest.mark.parametrize("model_type,lora", [("qwen3_moe", True), ("gpt_oss", True), ("mixtral", False),
                                             ("qwen2_moe", True)])
def test_bitwise_equal_to_no_checkpointing_and_the_experts_are_not_recomputed(model_type, lora, monkeypatch):
    """LoRA on the experts (Qwen3-MoE; gpt-oss's transposed weights with biases) and full fine-tuning
    (Mixtral: router and experts train)."""
    flags = grouped_mlp_output_unused(monkeypatch)
    batch = make_batch(tiny_model(model_type).config.vocab_size, seed=0)
    reference = _model(model_type, lora)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    model = _model(model_type, lora)
    chain = _stashed(model)
    flags.clear()
    got = seeded_step(model, batch)
    assert_bitwise(got, ref)
    blocks = MOE_BLOCKS[model_type]
    # The forward's calls only: the recompute never reaches the experts (the checkpoint stops
    # recomputing once the router, the layer's last op that saves through it, has run).
    assert flags == [False] * blocks
    assert chain.stats.cores_stashed == blocks, chain.stats
    assert chain.stats.bytes >= blocks * _gate_up_bytes(model, batch)  # the products went to the host
    assert chain.host_bytes == 0, "blocks outlived the backward"


def test_with_the_attention_stash_both_cores_of_each_layer_go():
    batch = make_batch(tiny_model("mixtral").config.vocab_size, seed=1)
    reference = _model("mixtral", lora=True)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    model = _model("mixtral", lora=True)
    chain = _stashed(model, attention_stash=True)
    for _ in range(2):  # the second step reuses the pool's pinned buffers
        assert_bitwise(seeded_step(model, batch), ref)
        assert chain.host_bytes == 0
    layers = model.config.num_hidden_layers
    assert chain.kinds == {"attention", "experts"}
    assert chain.stats.cores_stashed == 2 * 2 * layers, chain.stats
    assert chain.stats.cores_skipped == 2 * layers, chain.stats  # the attention's; the experts' are never reached


def test_experts_stash_alone_leaves_the_attention_recomputed(monkeypatch):
    from fasttune.model_patches import attention

    cores = []
    real = attention.FastAttentionForward._core
    monkeypatch.setattr(attention.FastAttentionForward, "_core", lambda self, *a: cores.append(1) or real(self, *a))
    model = _model("mixtral", lora=False)
    chain = _stashed(model)
    seeded_step(model, make_batch(model.config.vocab_size, seed=2))
    layers = model.config.num_hidden_layers
    assert len(cores) == 2 * layers  # forward and recompute
    assert chain.kinds == {"experts"} and chain.stats.cores_stashed == layers


def test_auto_stashes_the_offloaded_layers_and_recompute_mode_refuses_it():
    model = _model("mixtral", lora=False)
    chain = _stashed(model, mode="auto", memory_budget_gb=1e-6)  # nothing fits: every layer offloaded
    batch = make_batch(model.config.vocab_size, seed=3)
    seeded_step(model, batch)  # layer 0 runs resident once, to measure its activations
    before = chain.stats.cores_stashed
    seeded_step(model, batch)
    assert chain.stats.cores_stashed - before == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="experts_stash"):
        FastConfig(checkpointing="recompute", experts_stash=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equal_with_pinned_copies_on_the_side_stream(dtype):
    """On CUDA the copies run on the side stream; the bias/segment sums add atomically, so the
    comparison is tight rather than bitwise."""
    batch = make_batch(tiny_model("gpt_oss").config.vocab_size, seed=4, device="cuda")
    reference = _model("gpt_oss", lora=True, device="cuda", dtype=dtype)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    model = _model("gpt_oss", lora=True, device="cuda", dtype=dtype)
    chain = _stashed(model)
    for _ in range(MEASURING_STEPS):  # on CUDA the first steps stash nothing: they measure the link and the layers
        seeded_step(model, batch)
    torch.cuda.synchronize()
    chain.link.admits = lambda nbytes: True  # then every core goes, whatever the tiny layers' link budget
    got = seeded_step(model, batch)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    assert torch.allclose(got[0], ref[0], **tol)
    for name, g in ref[1].items():
        assert torch.allclose(got[1][name], g, **tol), name
    assert chain.stats.cores_stashed == MOE_BLOCKS["gpt_oss"] and chain.host_bytes == 0
