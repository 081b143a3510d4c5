"""Output dropout (``FamilySpec.output_dropout_attr``): Seed-OSS's ``residual_dropout`` after o_proj and after
the MLP's down_proj, as the released config keeps it (0.1, with attention_dropout 0.1), in training.

The patched forwards call ``nn.functional.dropout`` at the stock points, so with the same seed the masks are the
stock ones: the same loss and gradients (fp32: loss ≤ 1e-6 relative, every gradient ≤ 1e-5), full fine-tuning and
fused LoRA, without checkpointing and with the layer recompute (the checkpoint restores the RNG state of the
forward, so its recompute draws the same masks: its gradients are bitwise the unchecked patched run's). Under fused
LoRA the recompute still skips the MLP's down projection: the dropout after it needs only its mask, which it draws
again from the restored RNG state whatever its (discarded, NaN) input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model
from fasttune.model_patches.attention import check_attention, output_dropout
from fasttune.model_patches.families import FAMILIES
from fasttune.model_patches.forward_graphs import draws_dropout, layer_state
from fasttune.model_patches.mlp import check_mlp
from helpers.compare import rel_err
from helpers.tiny_models import make_batch, tiny_model

DROPOUT = dict(residual_dropout=0.1, attention_dropout=0.1)  # the released Seed-OSS-36B config's
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPEC = FAMILIES["seed_oss"]


def _model(lora: bool, seed: int = 3, **dropout):
    model = tiny_model("seed_oss", seed=seed, vocab_size=1000, **dropout)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                                 init_lora_weights=False))
    return model.train()


def _step(model, batch, seed=1234):
    """One forward+backward from a fixed RNG state: (loss, {name: gradient}) of the trainable parameters."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_close(fast, stock):
    (loss_f, grads_f), (loss_s, grads_s) = fast, stock
    assert rel_err(loss_f, loss_s) <= 1e-6, (loss_f, loss_s)
    assert grads_f.keys() == grads_s.keys() and grads_s
    bad = {n: e for n in grads_s if not (e := rel_err(grads_f[n], grads_s[n])) <= 1e-5}
    assert not bad, bad


def _fused_lora_mlp_flags(monkeypatch):
    """The ``output_unused`` flag of every ``LoRAMLPFunction`` call, in order."""
    from fasttune.kernels import lora_glu

    flags, real = [], lora_glu.LoRAMLPFunction.forward

    def spy(ctx, *args):
        flags.append(bool(args[-1]))
        return real(ctx, *args)

    monkeypatch.setattr(lora_glu.LoRAMLPFunction, "forward", staticmethod(spy))
    return flags


@pytest.mark.parametrize("attention_dropout", [0.1, 0.0], ids=["attn_dropout", "no_attn_dropout"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dropout_in_training_matches_stock_with_and_without_checkpointing(lora, attention_dropout, monkeypatch):
    """Same seed → stock's loss and gradients: unchecked, "recompute", "offload" (without attention dropout the
    offload's attention stash keeps the core, whose recompute is skipped: the output dropout comes after it) and
    the no-autograd forward (``no_grad_forward.py``, which restores the RNG state itself). Fused LoRA's recompute
    skips the down projection (``output_unused``) and stays exact."""
    flags = _fused_lora_mlp_flags(monkeypatch)
    stock = _model(lora, residual_dropout=0.1, attention_dropout=attention_dropout)
    batch = make_batch(1000, seed=5)
    ref = _step(stock, batch)
    runs = {}
    for mode, extra in ((None, {}), ("recompute", {}), ("offload", {}),
                        ("offload", dict(checkpoint_no_grad_forward=True))):
        fast = copy.deepcopy(stock)
        report = patch_model(fast, FastConfig(checkpointing=mode, **extra))
        assert report.patched["mlp"] == report.patched["rope"] == report.patched["residual_norms"] == 2, str(report)
        if lora:
            assert report.patched["lora_mlp"] == report.patched["lora_qkv"] == report.patched["lora_o"] == 2
        flags.clear()
        runs[mode, bool(extra)] = run = _step(fast, batch)
        _assert_close(run, ref)
        if lora:  # the forward, then (checkpointed) the recompute, which skips the down projection
            assert flags == [False] * 2 + ([] if mode is None else [True] * 2), flags
    unchecked_loss, unchecked_grads = runs[None, False]
    for key, (loss, grads) in runs.items():  # the recompute draws the forward's masks: bitwise equal
        assert torch.equal(loss, unchecked_loss), key
        assert all(torch.equal(grads[n], g) for n, g in unchecked_grads.items()), key


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_dropout_runs_in_training_only(lora):
    """Another seed gives another loss (the masks are drawn); p = 0 in training, and p = 0.1 in eval, give the
    dropout-free loss; eval after training ignores the dropout."""
    batch = make_batch(1000, seed=6)
    fast = _model(lora, **DROPOUT)
    patch_model(fast, FastConfig())
    a, b = _step(fast, batch, seed=1)[0], _step(fast, batch, seed=2)[0]
    assert not torch.equal(a, b)
    assert torch.equal(_step(fast, batch, seed=1)[0], a)
    off = _model(lora, residual_dropout=0.0, attention_dropout=0.0)
    patch_model(off, FastConfig())
    no_dropout = _step(off, batch)[0]
    assert rel_err(a, no_dropout) > 1e-4
    fast.eval()
    with torch.no_grad():  # the no-grad path may round differently in the last bit: not the dropout's 1e-4
        assert rel_err(fast(**batch).loss, no_dropout) <= 1e-6
    # Only residual_dropout: it alone changes the loss.
    residual_only = _model(lora, residual_dropout=0.1, attention_dropout=0.0)
    patch_model(residual_only, FastConfig())
    assert rel_err(_step(residual_only, batch)[0], no_dropout) > 1e-4


def test_output_dropout_helper_and_missing_attribute():
    """``output_dropout`` is the stock call (same mask for the same RNG state), the tensor itself in eval, with
    p = 0 or without a row attribute; a module without the row's attribute stays stock with the reason."""
    layer = tiny_model("seed_oss", seed=1, **DROPOUT).model.layers[0].train()
    x = torch.randn(3, 5, 96)
    torch.manual_seed(0)
    got = output_dropout(layer.mlp, x, "residual_dropout")
    torch.manual_seed(0)
    assert torch.equal(got, torch.nn.functional.dropout(x, p=0.1, training=True))
    assert output_dropout(layer.mlp, x, None) is x
    layer.eval()
    assert output_dropout(layer.mlp, x, "residual_dropout") is x
    layer.train()
    layer.mlp.residual_dropout = 0.0
    assert output_dropout(layer.mlp, x, "residual_dropout") is x
    for module in (layer.self_attn, layer.mlp):
        del module.residual_dropout
    assert "no `residual_dropout` attribute" in check_attention(layer.self_attn, SPEC)
    assert "no `residual_dropout` attribute" in check_mlp(layer.mlp, SPEC, "silu", use_kernel=True)[0]


def test_forward_graphs_leave_a_layer_with_an_attribute_dropout_eager():
    """A probability held in an attribute (``residual_dropout``), not only ``nn.Dropout`` modules and
    ``attention_dropout``, keeps a layer's forward off CUDA graphs in training."""
    layer = tiny_model("seed_oss", seed=1, residual_dropout=0.1, attention_dropout=0.0).model.layers[0].train()
    assert draws_dropout(layer.mlp) and draws_dropout(layer.self_attn)
    assert "dropout in training" in layer_state(layer)
    assert isinstance(layer_state(layer.eval()), tuple)
    off = tiny_model("seed_oss", seed=1, residual_dropout=0.0, attention_dropout=0.0).model.layers[0].train()
    assert isinstance(layer_state(off), tuple) and not draws_dropout(off.mlp)
    assert not draws_dropout(torch.nn.Dropout(0.0)) and draws_dropout(torch.nn.Dropout(0.1))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_attention_stash_keeps_the_output_dropout_exact(lora):
    """SDPA with the attention stash (offload): the recompute takes each attention core back instead of running it
    (no attention dropout, so the core draws nothing), then o_proj and the residual dropout run again from the
    restored RNG state: stock's loss and gradients, and the stashed run bitwise the unchecked patched one's."""
    from fasttune.model_patches.checkpointing import layer_checkpointing

    stock = _model(lora, residual_dropout=0.1, attention_dropout=0.0)
    stock.set_attn_implementation("sdpa")
    batch = make_batch(1000, seed=7)
    ref = _step(stock, batch)
    unchecked = copy.deepcopy(stock)
    patch_model(unchecked, FastConfig())
    plain = _step(unchecked, batch)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig(checkpointing="offload", attention_stash=True))
    chain = layer_checkpointing(fast).stash
    chain.min_bytes, chain.fixed_budget = 0, None
    got = _step(fast, batch)
    assert chain.stats.cores_stashed == chain.stats.cores_skipped == 2, chain.stats
    _assert_close(got, ref)
    assert torch.equal(got[0], plain[0]) and all(torch.equal(got[1][n], g) for n, g in plain[1].items())
