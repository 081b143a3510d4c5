"""Decoder-layer checkpointing ("recompute", "offload", "auto"): bitwise-equal gradients, policy, undo.

Gradients are compared with ``torch.equal`` against a run without checkpointing: recompute and
offload run the same kernels on the same inputs (RNG restored for dropout), so nothing may differ.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model, unpatch_model
from fasttune.model_patches.checkpointing import (
    STATE_ATTR, SavedBytesMeter, install_checkpointing, layer_checkpointing, resident_layers)
from fasttune.model_patches.families import FAMILIES, family_for
from fasttune.model_patches.report import PatchReport
from helpers.tiny_models import make_batch, tiny_model

GIB = 1 << 30
KERNELS_OFF = dict(cross_entropy=False, rms_norm=False, rope=False, mlp=False, lora=False, fused_logprobs=False)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(mode, kernels=False, **kw):
    return FastConfig(checkpointing=mode, **({} if kernels else KERNELS_OFF), **kw)


def _model(model_type="llama", device="cpu", dtype=torch.float32, lora=False, seed=0, **overrides):
    model = tiny_model(model_type, dtype=dtype, seed=seed, **overrides).to(device)
    if lora:
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: B is random too, so every LoRA gradient is generic (not zero).
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                 lora_dropout=0.0, init_lora_weights=False))
    model.train()
    return model


def _step(model, batch, seed=1234, **kw):
    """One forward+backward; returns (loss, {name: grad}) of the trainable parameters."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout masks (CPU and CUDA generators)
    out = model(**batch, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return out.loss.detach(), grads


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    bad = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not bad, f"gradients differ bitwise: {bad[:5]}"


@functools.lru_cache(maxsize=None)
def _reference(model_type, device, batch_seed, step_items, model_items):
    """Loss and gradients of the unpatched model (cached: several tests compare against the same run)."""
    model = _model(model_type, device, **dict(model_items))
    batch = make_batch(model.config.vocab_size, seed=batch_seed, device=device)
    return _step(model, batch, **dict(step_items))


def _run(mode, model_type, device, batch_seed=0, patch_kw=None, step_kw=None, **model_kw):
    if mode == "stock":
        return None, _reference(model_type, device, batch_seed, tuple(sorted((step_kw or {}).items())),
                                tuple(sorted(model_kw.items())))
    model = _model(model_type, device, **model_kw)
    report = patch_model(model, _config(mode, **(patch_kw or {})))
    assert report.patched["checkpointing"] == model.config.num_hidden_layers
    batch = make_batch(model.config.vocab_size, seed=batch_seed, device=device)
    return model, _step(model, batch, **(step_kw or {}))


# --- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_full_finetune_with_dropout_is_bitwise_exact(device, model_type, mode):
    _, ref = _run("stock", model_type, device, attention_dropout=0.2)
    model, got = _run(mode, model_type, device, attention_dropout=0.2)
    _assert_same(got, ref)
    if mode == "offload":
        stats = layer_checkpointing(model).checkpointer.stats
        assert stats.packed == 2 and stats.misses == 0


def test_dropout_is_really_on():
    _, with_dropout = _run("stock", "llama", "cpu", attention_dropout=0.2)
    _, without = _run("stock", "llama", "cpu")
    assert not torch.equal(with_dropout[0], without[0])


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_lora_on_frozen_embeddings_without_input_require_grads(device, model_type, mode):
    """Non-reentrant checkpointing needs no enable_input_require_grads: the first layer's input has no grad."""
    _, ref = _run("stock", model_type, device, lora=True)
    model = _model(model_type, device, lora=True)
    first = model.get_base_model().model.layers[0]
    seen = []
    first.register_forward_pre_hook(lambda mod, args: seen.append(args[0].requires_grad))
    patch_model(model, _config(mode))
    got = _step(model, make_batch(model.config.vocab_size, seed=0, device=device))
    assert seen == [False]
    assert all("lora_" in n for n in got[1])
    _assert_same(got, ref)


# The dense text rows (the vision-language rows' checkpointing: test_vision.py; the MoE rows' experts: test_moe.py).
@pytest.mark.parametrize(
    "model_type", sorted(t for t, spec in FAMILIES.items() if spec.vision is None and spec.moe_block_class is None)
)
def test_lora_recompute_skips_the_unused_down_projection_exactly(model_type, monkeypatch):
    """Fused LoRA under recompute: families whose MLP output only enters the residual skip the down
    product in the recompute (the MLP Function sees output_unused=True there, once per layer);
    families that save it (post-feedforward norms) never do. Gradients equal an unchecked run's."""
    from fasttune.kernels import lora_glu

    flags = []
    real = lora_glu.LoRAMLPFunction.forward

    def spy(ctx, *args):
        flags.append(bool(args[-1]))
        return real(ctx, *args)

    monkeypatch.setattr(lora_glu.LoRAMLPFunction, "forward", staticmethod(spy))
    runs = []
    for mode in (None, "recompute"):
        model = _model(model_type, lora=True)
        report = patch_model(model, FastConfig(checkpointing=mode, cross_entropy=False, rms_norm=False, rope=False))
        layers = model.config.num_hidden_layers
        fused = report.patched.get("lora_mlp", 0)
        flags.clear()
        runs.append(_step(model, make_batch(model.config.vocab_size, seed=0)))
    # After the recompute run: forward (False per fused layer), then the recompute in backward.
    spec = family_for(model_type)
    assert fused == layers, str(report)
    if spec.mlp_layout == "fused":  # Phi-3's gate_up_proj: lora_linear → GLU → lora_linear, nothing to skip
        assert flags == []
    else:
        assert flags == [False] * layers + [not spec.mlp_output_saved] * layers, flags
    loss_ref, grads_ref = runs[0]
    loss, grads = runs[1]
    assert torch.equal(loss, loss_ref)
    for name, g in grads.items():
        assert torch.allclose(g, grads_ref[name], rtol=1e-6, atol=1e-9), name


@pytest.mark.parametrize("mode", ["offload", "auto"])
def test_lora_down_skip_under_offload_and_auto_is_exact(mode, monkeypatch):
    """The recompute flag reaches the MLP under "offload" and under "auto" (layers beyond the
    resident ones); gradients stay equal to an unchecked run's."""
    from fasttune.kernels import lora_glu

    flags = []
    real = lora_glu.LoRAMLPFunction.forward
    monkeypatch.setattr(lora_glu.LoRAMLPFunction, "forward",
                        staticmethod(lambda ctx, *args: flags.append(bool(args[-1])) or real(ctx, *args)))
    runs = []
    for m in (None, mode):
        model = _model("llama", lora=True)
        patch_model(model, FastConfig(checkpointing=m, cross_entropy=False, rms_norm=False, rope=False))
        flags.clear()
        runs.append(_step(model, make_batch(model.config.vocab_size, seed=2)))
    layers = model.config.num_hidden_layers
    # auto on a CPU without a budget: layer 0 runs resident once (measured), the rest offloaded
    recomputed = layers - 1 if mode == "auto" else layers
    assert flags == [False] * layers + [True] * recomputed, flags
    assert torch.equal(runs[0][0], runs[1][0])
    for name, g in runs[1][1].items():
        assert torch.allclose(g, runs[0][1][name], rtol=1e-6, atol=1e-9), name


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_lora_recompute_takes_the_forward_decision_without_checking_again(mode, monkeypatch):
    """The fused-LoRA hooks check every call (``call_specs``); a checkpoint recompute takes the
    decision of the forward it recomputes (``layer_memo``) and checks nothing: with the adapters'
    scaling changed between forward and backward (a re-check would read the new one), the recompute
    still computes what the forward did and the gradients equal a run without checkpointing."""
    from fasttune.model_patches import lora as lora_patch

    checks = []
    real = lora_patch.call_specs
    monkeypatch.setattr(lora_patch, "call_specs", lambda *a, **k: checks.append(1) or real(*a, **k))
    runs = []
    for m in (None, mode):
        model = _model("llama", lora=True)
        report = patch_model(model, FastConfig(checkpointing=m, cross_entropy=False))
        model.zero_grad(set_to_none=True)
        checks.clear()
        out = model(**make_batch(model.config.vocab_size, seed=3))
        forward_checks = len(checks)
        lora_layers = [mod for mod in model.modules() if hasattr(mod, "lora_A") and hasattr(mod, "scaling")]
        for mod in lora_layers:
            mod.scaling["default"] *= 4
        out.loss.backward()
        for mod in lora_layers:
            mod.scaling["default"] /= 4
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs.append((out.loss.detach(), grads, forward_checks, len(checks) - forward_checks))
    layers = model.config.num_hidden_layers
    assert report.patched["lora_qkv"] == report.patched["lora_o"] == report.patched["lora_mlp"] == layers
    assert runs[1][2:] == (3 * layers, 0)  # q/k/v, o and the MLP checked once each, in forward only
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys()
    for name, g in runs[1][1].items():
        assert torch.allclose(g, runs[0][1][name], rtol=1e-6, atol=1e-9), name


def test_lora_recompute_checks_again_with_zero3_parameters(monkeypatch):
    """ZeRO-3 parameters are gathered anew for the recompute: their calls are checked again there."""
    from fasttune.model_patches import lora as lora_patch

    checks = []
    real = lora_patch.call_specs
    monkeypatch.setattr(lora_patch, "call_specs", lambda *a, **k: checks.append(1) or real(*a, **k))
    monkeypatch.setattr(lora_patch, "is_zero3_param", lambda p: p is not None)
    model = _model("llama", lora=True)
    patch_model(model, FastConfig(checkpointing="recompute", cross_entropy=False))
    out = model(**make_batch(model.config.vocab_size, seed=3))
    forward_checks = len(checks)
    out.loss.backward()
    assert len(checks) == 2 * forward_checks == 6 * model.config.num_hidden_layers


def test_with_every_kernel_patched_too():
    """Checkpointing wraps the layer; the norm/attention/MLP/head patches inside it are unaffected."""
    results = []
    for mode in (None, "offload"):
        model = _model("llama", attention_dropout=0.1)
        patch_model(model, FastConfig(checkpointing=mode))  # every kernel (Triton interpreter on CPU)
        results.append(_step(model, make_batch(model.config.vocab_size, batch=1, seq=9, seed=0)))
    assert layer_checkpointing(model).checkpointer.stats.packed == 2
    _assert_same(results[1], results[0])


@pytest.mark.parametrize("model_type", ["exaone4", "exaone4_no_window"])
def test_offload_with_every_kernel_and_fused_lora_on_post_norm_layers(model_type):
    """EXAONE 4's post-norm layers (the MLP's output is saved for its norm's backward; with a window, a NoPE
    full-attention layer): offload with every kernel and the fused LoRA on gives the gradients of the same
    patched model without checkpointing."""
    results = []
    for mode in (None, "offload"):
        model = _model(model_type, lora=True, vocab_size=1000)
        report = patch_model(model, FastConfig(checkpointing=mode))
        results.append(_step(model, make_batch(model.config.vocab_size, seed=4)))
    assert report.patched["lora_mlp"] == report.patched["rope"] == 2, str(report)
    assert layer_checkpointing(model).checkpointer.stats.packed == 2
    _assert_same(results[1], results[0])


def test_training_forward_with_a_cache(device):
    """use_cache=True in training: a checkpointed layer gets cache=None (the recompute must not write twice)."""
    _, ref = _run("stock", "llama", device, step_kw=dict(use_cache=True))
    _, got = _run("offload", "llama", device, step_kw=dict(use_cache=True))
    _assert_same(got, ref)


def test_hidden_states_passed_by_keyword(device):
    model = _model("llama", device, num_hidden_layers=1)
    layer = model.model.layers[0]
    h = torch.randn(2, 9, model.config.hidden_size, device=device, requires_grad=True)
    pos = torch.arange(9, device=device)[None]
    kw = dict(position_embeddings=model.model.rotary_emb(h, pos), position_ids=pos, attention_mask=None)

    def grads():
        model.zero_grad(set_to_none=True)
        h.grad = None
        out = layer(hidden_states=h, **kw)
        out.square().sum().backward()
        return out.detach(), [h.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    ref = grads()
    patch_model(model, _config("offload"))
    got = grads()
    assert layer_checkpointing(model).checkpointer.stats.packed == 1
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_eval_and_no_grad_run_stock(device):
    model = _model("llama", device)
    patch_model(model, _config("offload"))
    batch = make_batch(model.config.vocab_size, device=device)
    with torch.no_grad():
        model(**batch)
    model.eval()
    model(**batch).loss.backward()
    assert layer_checkpointing(model).checkpointer.stats.packed == 0


def test_two_models_interleaved_share_no_state(device):
    _, ref_a = _run("stock", "llama", device, seed=1)
    _, ref_b = _run("stock", "llama", device, seed=2, batch_seed=5)
    a, b = _model("llama", device, seed=1), _model("llama", device, seed=2)
    patch_model(a, _config("offload"))
    patch_model(b, _config("offload"))
    batch_a = make_batch(a.config.vocab_size, seed=0, device=device)
    batch_b = make_batch(b.config.vocab_size, seed=5, device=device)
    torch.manual_seed(1234)
    loss_a = a(**batch_a).loss
    torch.manual_seed(1234)
    loss_b = b(**batch_b).loss
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a.detach(), ref_a[0]) and torch.equal(loss_b.detach(), ref_b[0])
    for model, ref in ((a, ref_a), (b, ref_b)):
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, ref[1][n]), n
    sa, sb = layer_checkpointing(a), layer_checkpointing(b)
    assert sa is not sb and sa.checkpointer is not sb.checkpointer
    assert sa.checkpointer.stats.misses == 0 and sb.checkpointer.stats.misses == 0


# --- HF's own checkpointing, undo ------------------------------------------------------------------

def test_replaces_hf_checkpointing_and_undo_restores_it(device, caplog):
    _, ref = _run("stock", "llama", device)
    model = _model("llama", device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = list(model.model.layers)
    assert all(layer.gradient_checkpointing for layer in layers)
    patch_model(model, _config("offload"))
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert not model.model.gradient_checkpointing  # model-level flag too: is_gradient_checkpointing is False
    _assert_same(_step(model, make_batch(model.config.vocab_size, device=device)), ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert layer_checkpointing(model).reclaim() == len(layers) + 1  # what a callback does in on_train_begin

    # Turned on again behind our back: turned off again, with a warning, and still exact.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with caplog.at_level(logging.WARNING, logger="fasttune"):
        _assert_same(_step(model, make_batch(model.config.vocab_size, device=device)), ref)
    assert "turning it off" in caplog.text
    assert not any(layer.gradient_checkpointing for layer in layers)

    unpatch_model(model)
    assert all(layer.gradient_checkpointing for layer in layers) and model.model.gradient_checkpointing
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert STATE_ATTR not in model.__dict__ and layer_checkpointing(model) is None
    _assert_same(_step(model, make_batch(model.config.vocab_size, device=device)), ref)


def test_repatch_and_undo(device):
    model = _model("llama", device)
    patch_model(model, _config("recompute"))
    first = layer_checkpointing(model)
    patch_model(model, _config("offload"))
    second = layer_checkpointing(model)
    assert second is not first and second.mode == "offload"
    assert type(model.model.layers[0].forward).__name__ == "CheckpointedLayerForward"
    patch_model(model, _config(None))
    assert layer_checkpointing(model) is None
    assert "forward" not in model.model.layers[0].__dict__


def test_missing_layer_class_is_a_reported_fallback():
    model = _model("llama")
    report = PatchReport(model_type="llama")
    install_checkpointing(model, family_for("llama"), {}, _config("offload"), report)
    assert [fb.op for fb in report.fallbacks] == ["checkpointing"]
    assert "checkpointing" not in report.patched


# --- "auto" -------------------------------------------------------------------------------------

def test_resident_layers_policy():
    assert resident_layers(32, GIB, 40 * GIB) == 32
    assert resident_layers(32, GIB, 32 * GIB) == 32
    assert resident_layers(32, GIB, 20 * GIB) == 19  # one layer reserved for the backward recompute
    assert resident_layers(32, GIB, 20 * GIB, working_bytes=GIB // 2) == 18
    assert resident_layers(32, GIB, GIB) == 0
    assert resident_layers(32, GIB, None) == 0
    assert resident_layers(0, GIB, GIB) == 0
    with pytest.raises(ValueError, match="layer_bytes"):
        resident_layers(4, -1, GIB)
    with pytest.raises(ValueError, match="n_layers"):
        resident_layers(-1, 1, GIB)


def test_saved_bytes_meter_counts_distinct_storages_once():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedBytesMeter(x.device, exclude={w.untyped_storage().data_ptr()})
    with meter:
        y = (x @ w).exp()  # mm saves x and w (w excluded), exp saves its output
        z = y * y  # saves y twice: same storage, counted once
    assert meter.nbytes == (4 * 8 + 4 * 8) * 4
    z.sum().backward()  # still differentiable
    assert x.grad is not None


def test_auto_keeps_what_fits_and_logs_it(device, caplog):
    n = 4
    _, ref = _run("stock", "llama", device, num_hidden_layers=n, attention_dropout=0.1)
    # Ample budget: everything resident, nothing offloaded.
    model, got = _run("auto", "llama", device, patch_kw=dict(memory_budget_gb=1000.0),
                      num_hidden_layers=n, attention_dropout=0.1)
    _assert_same(got, ref)
    state = layer_checkpointing(model)
    decision = state.decision
    hidden_bytes = 2 * 17 * model.config.hidden_size * 4
    assert decision.resident == n and state.checkpointer.stats.packed == 0
    assert 2 * hidden_bytes <= decision.layer_bytes <= 200 * hidden_bytes

    # A budget for one resident layer plus the recompute reserve: 1 resident, 3 offloaded.
    budget = 2.5 * decision.layer_bytes + 3 * hidden_bytes
    with caplog.at_level(logging.INFO, logger="fasttune"):
        model, got = _run("auto", "llama", device, patch_kw=dict(memory_budget_gb=budget / GIB),
                          num_hidden_layers=n, attention_dropout=0.1)
    _assert_same(got, ref)
    state = layer_checkpointing(model)
    assert state.decision.resident == 1 and state.decision.layer_bytes == decision.layer_bytes
    assert state.checkpointer.stats.packed == n - 1
    assert "auto: 1/4 layers resident, 3 offloaded" in caplog.text


def test_auto_measures_once_per_shape_then_follows_the_plan(device):
    n = 3
    _, ref = _run("stock", "llama", device, num_hidden_layers=n)
    model, got = _run("auto", "llama", device, patch_kw=dict(memory_budget_gb=1e-6), num_hidden_layers=n)
    _assert_same(got, ref)
    state = layer_checkpointing(model)
    assert state.decision.resident == 0
    assert state.checkpointer.stats.packed == n - 1  # first step of a shape: layer 0 ran measured, resident
    _assert_same(_step(model, make_batch(model.config.vocab_size, seed=0, device=device)), ref)
    assert state.checkpointer.stats.packed == (n - 1) + n  # same shape again: all offloaded
    _step(model, make_batch(model.config.vocab_size, seq=23, device=device))
    assert len(state.policy.layer_bytes) == 2  # a new shape is measured once more


def test_auto_without_a_budget_on_cpu_offloads_everything():
    model, _ = _run("auto", "llama", "cpu")
    assert layer_checkpointing(model).decision.budget_bytes is None
    assert layer_checkpointing(model).decision.resident == 0


# --- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["offload", "recompute", "auto"])
def test_cuda_bitwise_exact(deterministic, dtype, mode):
    kw = dict(dtype=dtype, attention_dropout=0.1, num_hidden_layers=4)
    _, ref = _run("stock", "llama", "cuda", **kw)
    patch_kw = dict(memory_budget_gb=1e-6) if mode == "auto" else None
    model, got = _run(mode, "llama", "cuda", patch_kw=patch_kw, **kw)
    _assert_same(got, ref)
    if mode != "recompute":
        assert layer_checkpointing(model).checkpointer.pool.pin


@pytest.mark.gpu
def test_cuda_lora_bitwise_exact(deterministic):
    _, ref = _run("stock", "qwen3", "cuda", lora=True, dtype=torch.bfloat16)
    _, got = _run("offload", "qwen3", "cuda", lora=True, dtype=torch.bfloat16)
    _assert_same(got, ref)


@pytest.mark.gpu
def test_cuda_pinned_buffers_reused_across_steps():
    model = _model("llama", "cuda", dtype=torch.bfloat16, num_hidden_layers=4)
    patch_model(model, _config("offload"))
    ck = layer_checkpointing(model).checkpointer
    batch = make_batch(model.config.vocab_size, batch=2, seq=64, device="cuda")
    for step in range(4):
        _step(model, batch)
        torch.cuda.synchronize()
        assert ck.pool.bytes_in_use == 0
        assert ck.pool.allocations == 4, f"step {step}: pinned buffers re-allocated"
    assert ck.stats.misses == 0 and ck.stats.prefetch_hits == 4 * 3


@pytest.mark.gpu
def test_cuda_offload_takes_layer_inputs_off_the_device():
    """LoRA (tiny gradients), 8 layers: recompute keeps 8 layer inputs on the GPU, offload keeps the last one."""
    shape = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=128, num_hidden_layers=8, vocab_size=1000, max_position_embeddings=4096)
    batch = make_batch(1000, batch=2, seq=4096, device="cuda")
    held, peaks = {}, {}
    for mode in ("recompute", "offload"):
        model = _model("llama", "cuda", dtype=torch.bfloat16, lora=True, **shape)
        patch_model(model, _config(mode))
        _step(model, batch)  # warm-up (pinned buffers, cuBLAS workspaces)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(**batch).loss
        held[mode] = torch.cuda.memory_allocated() - base  # what the forward leaves for backward
        loss.backward()
        del loss
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    layer_input = 2 * 4096 * 1024 * 2
    assert held["offload"] <= held["recompute"] - 6.5 * layer_input, held
    assert peaks["offload"] <= peaks["recompute"] - 3 * layer_input, peaks


@pytest.mark.gpu
def test_cuda_auto_without_budget_uses_free_memory():
    model, _ = _run("auto", "llama", "cuda", num_hidden_layers=4)
    decision = layer_checkpointing(model).decision
    assert decision.budget_bytes is not None and decision.budget_bytes > 0
    assert decision.resident == 4  # a tiny model fits an H200 many times over
