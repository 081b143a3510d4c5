"""lora_widen.py: re-homing frozen projection weights with their rank-r columns, on real PEFT models.

What widening must keep: the same Parameter objects and values (state dict, optimizer), training
equal to stock PEFT, undo to contiguous storage, deep copies without buffers; what it must leave
alone: weights it does not own (views of other storage), trainable or other-dtype weights, groups
where the input copy costs what it saves (O); and a stale buffer (after ``.to()``) is dropped.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.kernels.lora_wide import TAIL_MULTIPLE
from fasttune.model_patches.lora_specs import lora_spec
from fasttune.model_patches.lora_widen import WIDE_ATTR, unwiden, wide_of, widen_group
from helpers.compare import assert_grads_close, rel_err
from helpers.tiny_models import make_batch, tiny_model

VOCAB = 1000
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(device, seed=0, r=8):
    base = tiny_model("llama", seed=seed, vocab_size=VOCAB)
    torch.manual_seed(seed + 1)
    cfg = LoraConfig(r=r, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(base, cfg).to(device)


def attn(model, i=0):
    return model.base_model.model.model.layers[i].self_attn


def qkv(model, i=0):
    a = attn(model, i)
    return [a.q_proj, a.k_proj, a.v_proj]


def step_like_peft(fast, stock, batch, what) -> None:
    """One forward and backward of both models: same loss, same gradient of every adapter."""
    for m in (fast, stock):
        m.train()
        m.zero_grad(set_to_none=True)
    loss_fast, loss_stock = fast(**batch).loss, stock(**batch).loss
    loss_fast.backward(), loss_stock.backward()
    assert rel_err(loss_fast.detach(), loss_stock.detach()) <= 1e-6, what
    assert_grads_close(fast, stock, 1e-5)


def test_widen_group_keeps_parameters_and_values(device):
    model = lora_model(device)
    projections = qkv(model)
    params = [p.base_layer.weight for p in projections]
    before = [w.detach().clone() for w in params]
    specs = [lora_spec(p) for p in projections]
    out = widen_group(projections, specs, torch.float32)
    for p, w, old, sp in zip(projections, params, before, out):
        assert p.base_layer.weight is w and torch.equal(w, old)  # same Parameter, same values
        wide = sp[0].wide
        assert wide is p.base_layer.__dict__[WIDE_ATTR] and wide.holds(w) and wide.extra == TAIL_MULTIPLE  # ≥ 3 × 8
        assert not wide.buf[:, w.shape[1]:].any()
        assert lora_spec(p)[0].wide is wide  # the kernels get it on every call
    assert torch.equal(model.state_dict()["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
                       before[0])
    unwiden(model)
    for p, old in zip(projections, before):
        assert p.base_layer.weight.is_contiguous() and torch.equal(p.base_layer.weight, old)
        assert WIDE_ATTR not in p.base_layer.__dict__


def test_groups_left_alone(device):
    model = lora_model(device)
    a = attn(model)
    o_spec = [lora_spec(a.o_proj)]
    assert widen_group([a.o_proj], o_spec, torch.float32) is o_spec  # out = in: the copy would eat the gain
    specs = [lora_spec(p) for p in qkv(model)]
    assert widen_group(qkv(model), specs, torch.bfloat16) is specs  # weights are not in the compute dtype
    shared = torch.randn(2, *a.k_proj.base_layer.weight.shape, device=device)
    a.k_proj.base_layer.weight.data = shared[1]  # a view into storage it does not own
    specs = [lora_spec(p) for p in qkv(model)]
    assert widen_group(qkv(model), specs, torch.float32) is specs
    assert all(WIDE_ATTR not in p.base_layer.__dict__ for p in qkv(model))  # all or nothing
    a.k_proj.base_layer.weight.data = shared[1].clone()
    a.k_proj.base_layer.weight.requires_grad_(True)  # trainable base: lora_spec refuses it first
    assert isinstance(lora_spec(a.k_proj), str)


def test_patched_model_trains_like_peft_and_unpatches(device):
    stock = lora_model(device, seed=3)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    assert not any(WIDE_ATTR in m.__dict__ for m in fast.modules())  # nothing moves before a call
    batch = make_batch(VOCAB, seed=4, device=device)
    step_like_peft(fast, stock, batch, "step 1")
    widened = [n for n, m in fast.named_modules() if WIDE_ATTR in m.__dict__]
    assert len(widened) == 2 * 6 and not any("o_proj" in n for n in widened), widened  # q k v gate up down
    unpatch_model(fast)
    assert not any(WIDE_ATTR in m.__dict__ for m in fast.modules())
    assert all(p.is_contiguous() for p in fast.parameters())
    fast.eval(), stock.eval()
    with torch.no_grad():
        assert torch.equal(fast(**batch).logits, stock(**batch).logits)


def test_deep_copy_and_moved_weights(device):
    """TRL's reference copy gets plain weights (no buffer) and widens on its own first call; a
    parameter moved since (``.to()``) leaves a stale buffer, which is dropped and redone."""
    model = lora_model(device, seed=5)
    patch_model(model, FastConfig())
    batch = make_batch(VOCAB, seed=6, device=device)
    model.train()
    model(**batch).loss.backward()
    twin = copy.deepcopy(model)
    q_twin = qkv(twin)[0].base_layer
    assert q_twin.__dict__.get(WIDE_ATTR) is None and q_twin.weight.is_contiguous()
    twin.train()
    twin(**batch).loss.backward()
    assert wide_of(q_twin, q_twin.weight) is not None  # widened at its first fused call

    q = qkv(model)[0].base_layer
    q.weight.data = q.weight.data.clone()  # what .to(other device/dtype) does to a parameter
    assert wide_of(q, q.weight) is None and WIDE_ATTR not in q.__dict__
    model.train()
    model(**batch).loss.backward()
    assert wide_of(q, q.weight) is not None


@pytest.mark.parametrize("widen", [True, False])
def test_config_switch(device, widen):
    model = lora_model(device, seed=7)
    patch_model(model, FastConfig(lora_widen=widen))
    model.train()
    model(**make_batch(VOCAB, seed=8, device=device)).loss.backward()
    assert any(WIDE_ATTR in m.__dict__ for m in model.modules()) == widen


def test_switching_to_a_larger_adapter_rewidens_once(device):
    """set_adapter to ranks that do not fit the tail: the group is re-homed with a wider tail (and
    stays so when switching back); outputs follow PEFT's throughout."""
    stock = lora_model(device, seed=9)
    stock.add_adapter("big", LoraConfig(r=48, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    batch = make_batch(VOCAB, seed=10, device=device)
    q = qkv(fast)[0].base_layer
    for name, tail in (("default", TAIL_MULTIPLE), ("big", 3 * TAIL_MULTIPLE), ("default", 3 * TAIL_MULTIPLE)):
        fast.set_adapter(name), stock.set_adapter(name)
        step_like_peft(fast, stock, batch, name)
        assert wide_of(q, q.weight).extra == tail, name  # 3 × 48 = 144 rank columns → 192


def test_reference_pass_probes_widening_once_per_hook(device, monkeypatch):
    """A disabled-adapter call (DPO's reference) before any training call widens the groups; where
    they cannot widen (here: weights that are views of a shared buffer) the probe is not repeated
    on every later reference call."""
    from fasttune.model_patches import lora as lora_mod

    model = lora_model(device, seed=11)
    shared = {}
    for p in qkv(model):  # q/k/v weights become views of one buffer: not theirs to re-home
        w = p.base_layer.weight
        shared[p] = torch.cat([w.detach(), torch.zeros_like(w[:1])])
        w.data = shared[p][:-1]
    patch_model(model, FastConfig())
    probes = []
    original = lora_mod.projection_specs
    monkeypatch.setattr(lora_mod, "projection_specs",
                        lambda *a, **k: probes.append(k.get("ignore_disabled")) or original(*a, **k))
    batch = make_batch(VOCAB, batch=4, seq=20, seed=12, device=device)  # > 64 rows: no-grad calls stay fused
    model.eval()
    with model.disable_adapter(), torch.no_grad():
        for _ in range(3):
            model(**batch)
    assert probes.count(True) == 2 * 2  # attention and MLP hooks of 2 layers, once each
    mlp0 = model.base_model.model.model.layers[0].mlp
    assert wide_of(mlp0.gate_proj.base_layer, mlp0.gate_proj.base_layer.weight) is not None  # MLP widened
    assert all(WIDE_ATTR not in p.base_layer.__dict__ for p in qkv(model))


def test_norms_leave_spare_columns_for_the_widened_groups(device, monkeypatch):
    """After the first step the decoder norms write their rows TAIL_MULTIPLE columns apart and the
    q/k/v and gate/up groups take X from there instead of copying it (the final norm, read by the
    loss head, is never asked); every step still trains like PEFT."""
    from fasttune.kernels import lora_wide

    stock = lora_model(device, seed=13)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    taken = []
    original = lora_wide.spare_input
    monkeypatch.setattr(lora_wide, "spare_input", lambda x2, extra: taken.append(original(x2, extra) is not None)
                        or original(x2, extra))
    layers = fast.base_model.model.model.layers
    opt_fast = torch.optim.SGD([p for p in fast.parameters() if p.requires_grad], lr=0.1)
    opt_stock = torch.optim.SGD([p for p in stock.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        step_like_peft(fast, stock, make_batch(VOCAB, seed=14 + step, device=device), step)
        opt_fast.step(), opt_stock.step()
    assert taken == [False] * 4 + [True] * 8  # 2 layers × (q/k/v, gate/up): copied once, then in place
    for layer in layers:
        assert layer.input_layernorm.forward.spare.width == TAIL_MULTIPLE
        assert layer.post_attention_layernorm.forward.spare.width == TAIL_MULTIPLE
    assert fast.base_model.model.model.norm.forward.spare.width == 0
