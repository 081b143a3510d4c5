"""The attention stash (``FastConfig.attention_stash``): an offloaded layer's attention core keeps its
saved tensors in host memory and is skipped in the recompute.

Gradients are compared with ``torch.equal`` against a run without checkpointing: the core's own
nodes run in backward on exact copies of what they saved. Tiny models save tensors far below the
stash's 1 MiB floor, so each test lowers it to 0.
"""

from __future__ import annotations

import pytest
import torch

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model
from fasttune.model_patches.checkpointing import layer_checkpointing
from helpers.stash_steps import MEASURING_STEPS, assert_bitwise, seeded_step
from helpers.tiny_models import make_batch, tiny_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(model_type="llama", device="cpu", dtype=torch.float32, lora=True, attn="sdpa", lora_dropout=0.0,
           **overrides):
    model = tiny_model(model_type, dtype=dtype, seed=0, **overrides)
    model.set_attn_implementation(attn)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if model_type == "phi3" else LORA_TARGETS
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=lora_dropout,
                                                 init_lora_weights=False))
    return model.to(device).train()


def _stashed(model, mode="offload", budget=None, **config):
    patch_model(model, FastConfig(checkpointing=mode, attention_stash=True, **config))
    chain = layer_checkpointing(model).stash
    chain.min_bytes = 0
    chain.fixed_budget = budget
    return chain


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "olmo2"])
def test_bitwise_equal_to_no_checkpointing_and_the_core_is_not_recomputed(model_type, lora):
    """q/k norms over heads (Qwen3) or the whole projection (OLMo2), a fused qkv (Phi-3), every kernel on."""
    batch = make_batch(tiny_model(model_type).config.vocab_size, seed=0)
    reference = _model(model_type, lora=lora)
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    model = _model(model_type, lora=lora)
    chain = _stashed(model)
    got = seeded_step(model, batch)
    assert_bitwise(got, ref)
    layers = model.config.num_hidden_layers
    assert chain.stats.cores_stashed == layers and chain.stats.cores_skipped == layers, chain.stats
    assert chain.stats.inputs_recomputed == layers, "the projections' input was copied, not recomputed"
    assert chain.stats.blocks > layers  # the saved tensors went too, not only the core's output


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "exaone4", "olmo2", "hunyuan_v1_dense"])
def test_normed_q_and_k_are_remade_in_backward_not_copied(model_type):
    """With q/k norms the attention saves the normed, rotated q/k and the norms save their inputs: the first are
    remade from the second in backward (one remake per core and backward: norms before RoPE per head, over the whole
    projection, or after RoPE), not copied; gradients stay bitwise. Without the remake, the bytes sent would be
    those of a Llama core plus the normed q/k (the link-budget test below pins the bytes)."""
    batch = make_batch(tiny_model(model_type).config.vocab_size, seed=11)
    reference, model = _model(model_type), _model(model_type)
    patch_model(reference, FastConfig())
    chain = _stashed(model)
    ref = seeded_step(reference, batch)
    for step in (1, 2):
        assert_bitwise(seeded_step(model, batch), ref)
        layers = model.config.num_hidden_layers
        assert chain.stats.cores_stashed == chain.stats.tensors_remade == step * layers, chain.stats
        assert chain.host_bytes == 0


def test_the_core_is_skipped_in_the_recompute(monkeypatch):
    """The q/k/v projections run once per layer (forward), not again in backward."""
    from fasttune.model_patches import attention

    calls = []
    real = attention.FastAttentionForward._core
    monkeypatch.setattr(attention.FastAttentionForward, "_core",
                        lambda self, *a: calls.append(1) or real(self, *a))
    model = _model()
    _stashed(model)
    seeded_step(model, make_batch(model.config.vocab_size, seed=3))
    assert len(calls) == model.config.num_hidden_layers


def test_host_memory_comes_back_after_each_backward():
    model = _model()
    chain = _stashed(model)
    batch = make_batch(model.config.vocab_size, seed=4)
    first = seeded_step(model, batch)
    assert chain.host_bytes == 0, "blocks outlived the backward"
    pool = layer_checkpointing(model).checkpointer.pool
    for _ in range(2):
        assert_bitwise(seeded_step(model, batch), first)
        assert chain.host_bytes == 0
        assert pool.bytes_in_use == 0 and pool.bytes_total <= pool.peak_bytes_in_use


def test_a_second_backward_through_a_retained_graph():
    batch = make_batch(_model().config.vocab_size, seed=5)
    reference, model = _model(), _model()
    once = dict(cross_entropy=False, lora=False, mlp=False)  # kernels whose backward runs once (they say so)
    patch_model(reference, FastConfig(**once))
    chain = _stashed(model, **once)
    results = []
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward(retain_graph=True)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}))
    assert_bitwise(results[1], results[0])
    assert chain.stats.cores_skipped == 2 * chain.stats.cores_stashed == 2 * model.config.num_hidden_layers


def test_an_address_a_re_homed_parameter_gave_up_holds_an_activation_again():
    """A parameter re-homed during a core (``lora_widen`` moves a frozen weight into its bordered buffer
    at its first fused call) frees its old storage, and a new activation may get that address: it is
    stashed like any other (it was once kept on the device as "parameter memory", at random, as the
    allocator reused addresses). A view of a parameter as it is now still stays where it is."""
    from fasttune.model_patches.attention_stash import ATTENTION, LayerStash

    chain = _stashed(_model())
    stash = LayerStash(chain, None)
    lin = torch.nn.Linear(8, 8)
    stash._params = tuple(lin.parameters())  # as a core's start records them
    stash._alive, stash._by_address, stash._kind = [], {}, ATTENTION
    assert stash.ref(lin.weight.view(64)) is None  # a parameter's memory stays where it is
    old = lin.weight.detach()  # its storage, held here as a reused address would be by a new tensor
    lin.weight.data = torch.randn(8, 8)  # re-homed
    leaf = torch.empty(0).set_(old.untyped_storage(), 0, (8, 8), (8, 1)).requires_grad_()
    activation = leaf.view(8, 8)  # not a leaf, requires grad, at the parameter's old address
    assert activation.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
    assert stash.ref(activation) is not None
    assert stash.ref(lin.weight.view(64)) is None  # its new memory is the parameter's too


@pytest.mark.parametrize("budget_layers", [0, 1])
def test_past_the_host_budget_layers_are_recomputed_exactly(budget_layers, caplog):
    batch = make_batch(_model().config.vocab_size, seed=6)
    reference = _model()
    patch_model(reference, FastConfig())
    ref = seeded_step(reference, batch)
    probe = _model()
    probe_chain = _stashed(probe)
    probe(**batch).loss.backward()
    one_core = probe_chain.stats.bytes // probe.config.num_hidden_layers
    model = _model()
    chain = _stashed(model, budget=budget_layers * one_core + one_core // 2)
    with caplog.at_level("INFO", logger="fasttune"):
        got = seeded_step(model, batch)
    assert_bitwise(got, ref)
    layers = model.config.num_hidden_layers
    assert chain.stats.cores_stashed == budget_layers
    assert chain.stats.cores_over_budget == layers - budget_layers
    assert "attention stash full" in caplog.text


@pytest.mark.parametrize("case", ["eager", "dropout", "lora_dropout"])
def test_eager_attention_and_dropout_inside_are_recomputed(case):
    """Eager attention saves [S, S] probabilities; dropout's RNG (the attention's, or PEFT's lora_dropout in the
    projections) would shift for what follows in the recompute if the core were skipped."""
    kw = {"eager": dict(attn="eager"), "dropout": dict(attention_dropout=0.2),
          "lora_dropout": dict(lora_dropout=0.3)}[case]
    batch = make_batch(_model().config.vocab_size, seed=7)
    reference, model = _model(**kw), _model(**kw)
    patch_model(reference, FastConfig())
    chain = _stashed(model)
    assert_bitwise(seeded_step(model, batch), seeded_step(reference, batch))
    assert chain.stats.cores_stashed == 0


def test_auto_stashes_the_offloaded_layers():
    """"auto" on a CPU without a budget: layer 0 runs resident once (measured), the rest are offloaded."""
    batch = make_batch(_model().config.vocab_size, seed=8)
    reference, model = _model(), _model()
    patch_model(reference, FastConfig())
    chain = _stashed(model, mode="auto")
    assert_bitwise(seeded_step(model, batch), seeded_step(reference, batch))
    assert chain.stats.cores_stashed == model.config.num_hidden_layers - 1


def test_on_by_default_where_the_layers_record_their_forward():
    """Dense families with "offload" or "auto" stash their attention by default; families with q/k norms (their
    cores too large for the link), mixture-of-experts families, whose checkpointed forward runs without autograd by
    default, FP8 bases (not measured) and "recompute" do not; False turns it off, True on."""
    kinds = {}
    for name, model_type, config in (("dense", "llama", dict(checkpointing="offload")),
                                     ("auto", "llama", dict(checkpointing="auto")),
                                     ("off", "llama", dict(checkpointing="offload", attention_stash=False)),
                                     ("qk norms", "qwen3", dict(checkpointing="offload")),
                                     ("qk norms on", "qwen3", dict(checkpointing="offload", attention_stash=True)),
                                     ("moe", "qwen3_moe", dict(checkpointing="offload")),
                                     ("moe on", "qwen3_moe", dict(checkpointing="offload", attention_stash=True)),
                                     ("fp8", "llama", dict(checkpointing="offload", base_dtype="fp8")),
                                     ("recompute", "llama", dict(checkpointing="recompute"))):
        model = _model(model_type)
        patch_model(model, FastConfig(**config))
        chain = layer_checkpointing(model).stash
        kinds[name] = "attention" in chain.kinds if chain is not None else False
    assert kinds == {"dense": True, "auto": True, "off": False, "qk norms": False, "qk norms on": True, "moe": False,
                     "moe on": True, "fp8": False, "recompute": False}
    batch = make_batch(_model().config.vocab_size, seed=4)
    reference, model = _model(), _model()
    patch_model(reference, FastConfig())
    patch_model(model, FastConfig(checkpointing="offload"))
    chain = layer_checkpointing(model).stash
    chain.min_bytes = 0
    assert_bitwise(seeded_step(model, batch), seeded_step(reference, batch))
    assert chain.stats.cores_skipped == model.config.num_hidden_layers, chain.stats


def test_recompute_mode_refuses_it():
    with pytest.raises(ValueError, match="attention_stash"):
        FastConfig(checkpointing="recompute", attention_stash=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_cuda_bitwise_equal_with_pinned_copies_on_the_side_stream(deterministic, model_type, dtype):
    batch = make_batch(tiny_model(model_type).config.vocab_size, batch=4, seq=257, seed=9, device="cuda")
    kw = dict(dtype=dtype, num_hidden_layers=4, hidden_size=256, intermediate_size=512)
    reference, model = _model(model_type, "cuda", **kw), _model(model_type, "cuda", **kw)
    patch_model(reference, FastConfig())
    chain = _stashed(model)
    ref = seeded_step(reference, batch)
    for _ in range(MEASURING_STEPS):  # on CUDA the first steps stash nothing: they measure the link and the layers
        assert_bitwise(seeded_step(model, batch), ref)
    torch.cuda.synchronize()
    chain.link.admits = lambda nbytes: True  # then every core goes, whatever the tiny layers' link budget
    for _ in range(2):
        assert_bitwise(seeded_step(model, batch), ref)
    torch.cuda.synchronize()
    state = layer_checkpointing(model)
    assert state.checkpointer.pool.pin and chain.host_bytes == 0
    stats, layers = chain.stats, model.config.num_hidden_layers
    assert stats.cores_stashed == stats.cores_skipped == stats.inputs_recomputed == 2 * layers, stats
    # Qwen3's normed q/k are remade, not copied, where the attention saves them as they are: bf16 (in fp32 torch's
    # CUDA attention saved no tensor of theirs on the H100: nothing to remake, the stash copies what it saved).
    assert stats.tensors_remade == (2 * layers if (model_type, dtype) == ("qwen3", torch.bfloat16) else 0), stats
    assert stats.cores_link_busy == MEASURING_STEPS * layers, stats
    # Each step's first recompute (the last layer) takes its core's output on the spot; the rest was fetched ahead.
    assert state.checkpointer.stats.misses <= 2 * 2, state.checkpointer.stats


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "olmo2"])
def test_the_link_budget_is_charged_what_a_core_copies(model_type, monkeypatch):
    """The link budget admits a core by its estimated bytes (``FastAttentionForward._stash_bytes``): exactly what
    its saved tensors then move (full fine-tuning: no rank-r products; with q/k norms, their inputs and not the
    normed q/k, which backward remakes); the projections' input is not among them (the recompute makes it)."""
    from fasttune.model_patches import attention

    charged = []
    real = attention.FastAttentionForward._stash_bytes
    monkeypatch.setattr(attention.FastAttentionForward, "_stash_bytes",
                        lambda self, m, h: charged.append(real(self, m, h)) or charged[-1])
    model = _model(model_type, lora=False)
    chain = _stashed(model)
    chain.min_bytes = 1
    seeded_step(model, make_batch(model.config.vocab_size, seed=6))
    stats, layers = chain.stats, model.config.num_hidden_layers
    assert stats.cores_stashed == stats.inputs_recomputed == layers
    assert stats.bytes == sum(charged[:layers]) > 0, (stats, charged)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_the_link_budget_settles_what_a_core_really_sent(padded, monkeypatch):
    """The charge is an estimate; each stashed core then settles the bytes it queued. With padding transformers'
    sdpa repeats k and v to every head (no ``enable_gqa`` with a mask), and the kernel saves those: the core
    sends more than it was charged, and the budget has to learn it."""
    model = _model("llama", lora=False)
    chain = _stashed(model)
    chain.min_bytes = 1
    settled = []
    monkeypatch.setattr(chain, "settle", lambda charged, sent, device: settled.append((charged, sent)))
    batch = make_batch(model.config.vocab_size, seed=6)
    if padded:
        batch["attention_mask"][0, :5] = 0
    seeded_step(model, batch)
    layers = model.config.num_hidden_layers
    assert len(settled) == chain.stats.cores_stashed == layers
    charged, sent = (sum(x) for x in zip(*settled))
    assert sent == chain.stats.bytes
    kv_width = 2 * model.config.num_key_value_heads * model.config.head_dim
    repeated = (2 * model.config.num_attention_heads * model.config.head_dim - kv_width) * 2 * 17 * 4 * layers
    assert sent == charged + (repeated if padded else 0), (charged, sent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_batch_shares_one_additive_bias_across_the_stashed_cores(dtype):
    """With a padding mask sdpa would make an additive bias per layer, which a stashed core keeps on the GPU
    until the backward; the stashed cores share one per forward (``mask_bias.py``), bit for bit."""
    batch = make_batch(tiny_model("llama").config.vocab_size, batch=3, seq=37, seed=5)
    batch["attention_mask"][1, 30:] = 0
    batch["attention_mask"][2, 20:] = 0
    reference = _model(dtype=dtype)
    patch_model(reference, FastConfig())
    model = _model(dtype=dtype)
    chain = _stashed(model)
    ref = seeded_step(reference, batch)
    for step in (1, 2):
        assert_bitwise(seeded_step(model, batch), ref)
        assert chain.stats.cores_stashed == step * model.config.num_hidden_layers, chain.stats
        assert chain.mask_bias.made == step  # one bias per forward, for every layer


@pytest.mark.gpu
def test_cuda_a_padded_batch_keeps_one_bias_for_all_stashed_cores(deterministic, monkeypatch):
    """On CUDA sdpa's memory-efficient kernel saves the additive bias it makes of a boolean mask; a stashed core
    keeps it until the backward. Shared, the layers hold one bias instead of one each, with the same numbers."""
    from fasttune.model_patches import attention

    seq, layers = 1000, 4
    batch = make_batch(tiny_model("llama").config.vocab_size, batch=4, seq=seq, seed=9, device="cuda")
    batch["attention_mask"][1:, seq // 2:] = 0
    kw = dict(dtype=torch.bfloat16, num_hidden_layers=layers, hidden_size=256, intermediate_size=512)
    peaks, results = {}, {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(attention, "shareable", lambda *a: False)
        model = _model("llama", "cuda", **kw)
        chain = _stashed(model)
        for _ in range(MEASURING_STEPS):
            seeded_step(model, batch)
        torch.cuda.synchronize()
        chain.link.admits = lambda nbytes: True
        torch.cuda.reset_peak_memory_stats()
        results[shared] = seeded_step(model, batch)
        torch.cuda.synchronize()
        peaks[shared] = torch.cuda.max_memory_allocated()
        assert chain.stats.cores_stashed == layers, chain.stats
        assert chain.mask_bias.made == (MEASURING_STEPS + 1 if shared else 0)
        del model, chain
        torch.cuda.empty_cache()
    # The forward is bitwise; the memory-efficient kernel's backward adds in no fixed order (warn-only determinism).
    (loss, grads), (ref_loss, ref_grads) = results[True], results[False]
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert (g.float() - ref_grads[name].float()).abs().max() <= 2e-2 * ref_grads[name].float().abs().max(), name
    bias_bytes = 4 * seq * 1008 * 2
    assert peaks[False] - peaks[True] >= (layers - 1) * bias_bytes * 0.9, (peaks, bias_bytes)
