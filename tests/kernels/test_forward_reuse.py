"""forward_reuse.py: what a checkpointed layer's forward made for its LoRA adapters, taken back by its recompute.

The records themselves (call order, version counters, the byte budget, a peek that misses), then a
tiny Llama with LoRA (fp32 adapters over fp32 or bf16 weights, the widened groups of a CPU run) trained
two steps with "offload" and "recompute" and ``FastConfig.reuse_forward_lora``: the loss and every
adapter gradient bit for bit those of the same model without checkpointing and with reuse off (the
default), the recompute taking every product from its forward (no miss), running no GLU pass, and
copying no B into a widened buffer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model
from fasttune.kernels import forward_reuse, lora_glu
from fasttune.kernels.forward_reuse import ForwardReuse, entering, held_bytes, leaving, replayed, reused
from fasttune.kernels.lora_wide import WideWeight
from fasttune.model_patches.lora_widen import wide_of
from helpers.sgd_steps import sgd_steps
from helpers.tiny_models import make_batch, tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
             vocab_size=503, num_hidden_layers=2)
N_LAYERS = SHAPE["num_hidden_layers"]


def _pass(reuse, replay, calls):
    """One pass of a layer call over ``calls`` = [(kind, tensors, shape, value)]: what ``reused`` returned."""
    token = entering(reuse, replay)
    try:
        return [reused(kind, tensors, shape, lambda v=value: v) for kind, tensors, shape, value in calls]
    finally:
        leaving(token)


def test_the_recompute_takes_the_forwards_results_in_call_order_until_an_adapter_changes():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    first, second, cast = torch.randn(5, 4), torch.randn(5, 4), torch.randn(8, 4)
    reuse = ForwardReuse()
    held = held_bytes()
    out = _pass(reuse, False, [("xa", [a], (5, 8), first), ("xa", [a], (5, 8), second), ("b", [b], "bf16", cast)])
    assert out[0] is first and out[1] is second and out[2] is cast
    assert len(reuse) == 3 and held_bytes() == held + 2 * first.numel() * 4 + cast.numel() * 4
    # The recompute computes other tensors (same values in real use): it gets the forward's, in order.
    again = _pass(reuse, True, [("xa", [a], (5, 8), torch.zeros(5, 4)), ("xa", [a], (5, 8), torch.ones(5, 4)),
                                ("b", [b], "bf16", torch.zeros(8, 4))])
    assert again[0] is first and again[1] is second and again[2] is cast and (reuse.hits, reuse.misses) == (3, 0)
    assert len(reuse) == 0 and held_bytes() == held  # dropped once the recompute is over

    reuse = ForwardReuse()
    _pass(reuse, False, [("xa", [a], (5, 8), first), ("xa", [a], (6, 8), second)])
    with torch.no_grad():
        a.add_(1)  # an in-place change of A moves its version: the forward's XA no longer holds
    fresh = torch.randn(5, 4)
    other = _pass(reuse, True, [("xa", [a], (5, 8), fresh), ("xa", [a], (7, 8), torch.ones(7, 4))])
    assert other[0] is fresh and other[1] is not second and (reuse.hits, reuse.misses) == (0, 2)


def test_nothing_is_recorded_or_taken_outside_a_layer_call_or_with_reuse_off(monkeypatch):
    x = torch.randn(3, 2)
    assert reused("xa", [x], (3, 2), lambda: x) is x and replayed("xa", [x], (3, 2)) is None
    monkeypatch.setattr(forward_reuse, "BUDGET_BYTES", 0)
    reuse = ForwardReuse()
    _pass(reuse, False, [("xa", [x], (3, 2), x)])
    assert len(reuse) == 0 and forward_reuse.active() is None


def test_records_stay_under_the_budget_and_a_dropped_call_gives_its_bytes_back(monkeypatch):
    a = torch.randn(4, 8)
    monkeypatch.setattr(forward_reuse, "BUDGET_BYTES", held_bytes() + 2 * 5 * 4 * 4)  # two [5, 4] fp32 records
    reuse = ForwardReuse()
    held = held_bytes()
    _pass(reuse, False, [("xa", [a], (5, 8), torch.randn(5, 4)) for _ in range(3)])
    assert len(reuse) == 2 and held_bytes() == held + 2 * 80
    del reuse  # a forward whose recompute never came (no backward)
    assert held_bytes() == held


def test_a_peek_that_misses_leaves_the_call_to_reused():
    a = torch.randn(4, 8)
    ha = torch.randn(5, 4)
    reuse = ForwardReuse()
    _pass(reuse, False, [("xa", [a], (5, 8), ha)])
    token = entering(reuse, True)
    try:
        assert replayed("xa", [a], (6, 8)) is None  # another shape: a miss that consumes nothing
        assert replayed("xa", [a], (5, 8)) is ha  # a hit consumes the call
        fresh = torch.randn(5, 4)
        assert reused("xa", [a], (5, 8), lambda: fresh) is fresh  # a second call: nothing recorded for it
    finally:
        leaving(token)
    assert (reuse.hits, reuse.misses) == (1, 1)


def _lora(base: torch.nn.Module):
    torch.manual_seed(3)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(copy.deepcopy(base), config)  # PEFT keeps the adapters in fp32


@pytest.fixture
def spies(monkeypatch):
    """Counts: GLU forward passes, records taken and missed, and B loads a widened buffer skipped."""
    counts = {"glu": 0, "hit": 0, "miss": 0, "skipped": 0, "copied": 0}
    glu, take, load = lora_glu.glu_forward, ForwardReuse.take, WideWeight.load

    def counting_glu(*a, **k):
        counts["glu"] += 1
        return glu(*a, **k)

    def counting_take(self, key, versions, peek=False):
        value = take(self, key, versions, peek)
        if value is not None or not peek:
            counts["hit" if value is not None else "miss"] += 1
        return value

    def counting_load(self, col, b, token=None):
        before = self._loaded
        load(self, col, b, token)
        if b is not None:
            counts["skipped" if before is not None and self._loaded is before else "copied"] += 1

    monkeypatch.setattr(lora_glu, "glu_forward", counting_glu)
    monkeypatch.setattr(ForwardReuse, "take", counting_take)
    monkeypatch.setattr(WideWeight, "load", counting_load)
    return counts


def _check_steps(spies, dtype, mode, device, shape, seq):
    base = tiny_model("llama", dtype=dtype, seed=4, **shape).to(device)
    batches = [make_batch(shape["vocab_size"], seq=seq, seed=s) for s in (5, 6)]
    runs, counts, held = {}, {}, held_bytes()
    for name, config in (("unchecked", FastConfig(reuse_forward_lora=True)),
                         ("reused", FastConfig(checkpointing=mode, reuse_forward_lora=True)),
                         ("off", FastConfig(checkpointing=mode))):  # the default
        model = _lora(base)
        report = patch_model(model, config)
        assert not [f for f in report.fallbacks if f.op.startswith("lora")], str(report)
        before = dict(spies)
        runs[name] = sgd_steps(model, batches, autocast=None if dtype == torch.float32 else dtype)
        counts[name] = {k: spies[k] - before[k] for k in spies}
        q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        assert wide_of(q, q.weight) is not None  # q/k/v and gate/up run widened
    forwards = len(batches) * shape["num_hidden_layers"]
    assert counts["unchecked"]["glu"] == forwards and counts["unchecked"]["hit"] == 0
    assert counts["off"]["glu"] == 2 * forwards and counts["off"]["hit"] == counts["off"]["skipped"] == 0
    # Reused: the recompute's GLU pass is gone, every product comes from the forward, and the widened
    # buffers' B is copied once per layer call instead of in the forward, the recompute and the backward.
    assert counts["reused"]["glu"] == forwards, counts
    assert counts["reused"]["miss"] == 0 and counts["reused"]["hit"] >= 4 * forwards, counts
    assert counts["reused"]["skipped"] > 0 and counts["reused"]["copied"] < counts["off"]["copied"], counts
    assert held_bytes() <= held  # every record dropped after its recompute (earlier tests' may go meanwhile)
    ref_losses, ref_grads = runs["unchecked"]
    assert len(ref_grads) == 2 * 7 * shape["num_hidden_layers"]
    for name in ("reused", "off"):
        losses, grads = runs[name]
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (name, losses, ref_losses)
        unequal = [n for n, g in grads.items() if not torch.equal(g, ref_grads[n])]
        assert not unequal, (name, unequal)


@pytest.mark.parametrize("mode", ["offload", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpointed_steps_bitwise_with_the_recompute_taking_the_forwards_products(spies, dtype, mode):
    _check_steps(spies, dtype, mode, "cpu", SHAPE, seq=24)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_checkpointed_steps_bitwise_with_the_recompute_taking_the_forwards_products(spies, deterministic, dtype):
    shape = dict(SHAPE, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, num_hidden_layers=4)
    _check_steps(spies, dtype, "offload", "cuda", shape, seq=512)
