"""lora_spec reads real PEFT LoRA layers, and the fused Functions then match PEFT's own forward/backward.

A tiny block of Llama-shaped projections (GQA: q 128 wide, k/v 64) wrapped by ``get_peft_model``
with ``LoraConfig(r=8, lora_alpha=16, lora_dropout=0)``, B randomised (PEFT starts it at zero);
bases nn.Linear or bitsandbytes NF4 Linear4bit. fp32 throughout: outputs and gradients of x and
of every lora_A/lora_B within 1e-5 (relative, Frobenius) of PEFT's.

Widths are multiples of 64: bitsandbytes 0.50.2's CPU Linear4bit mis-dequantises rows that are a
multiple of 16 wide but not of blocksize (see test_nf4.py), which would fail PEFT, not us.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fasttune.kernels.lora import BaseWeight, lora_linear, lora_qkv
from fasttune.kernels.lora_glu import lora_mlp
from fasttune.model_patches.lora_specs import lora_spec

peft = pytest.importorskip("peft")

D, Q, KV, I = 128, 128, 64, 192
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {"q_proj": (D, Q), "k_proj": (D, KV), "v_proj": (D, KV), "o_proj": (Q, D),
          "gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}


class Block(nn.Module):
    def __init__(self, bias=False, linear=nn.Linear):
        super().__init__()
        for name, (i, o) in SHAPES.items():
            setattr(self, name, linear(i, o, bias=bias))


def nf4_linear(i, o, bias):
    """A bitsandbytes NF4 Linear4bit (double quantisation, fp32 compute) quantised from a random weight."""
    bnb = pytest.importorskip("bitsandbytes")
    dense = nn.Linear(i, o, bias=bias)
    layer = bnb.nn.Linear4bit(i, o, bias=bias, compute_dtype=torch.float32, quant_type="nf4",
                              compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True)
    if bias:
        layer.bias = nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    return layer


def peft_block(device, targets=PROJS, bias=False, nf4=False, **lora_kw):
    torch.manual_seed(0)
    block = Block(bias=bias, linear=nf4_linear if nf4 else nn.Linear)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(targets), **lora_kw)
    model = peft.get_peft_model(block, cfg).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model, model.base_model.model


def lora_params(block, names):
    out = []
    for name in names:
        spec = lora_spec(getattr(block, name))
        out += [t for t in spec[1:3] if t is not None]
    return out


def assert_same(a, b, name):
    assert (a - b).norm() <= 1e-5 * b.norm(), f"{name}: rel err {((a - b).norm() / b.norm()).item():.2e}"


def compare(block, x, ours_fn, stock_fn, names):
    """Outputs and grads (x and the adapters of ``names``) of ours vs PEFT's forward, same dY."""
    params = [x] + lora_params(block, names)
    ours = ours_fn(x)
    stock = stock_fn(x)
    ours, stock = (ours if isinstance(ours, tuple) else (ours,)), (stock if isinstance(stock, tuple) else (stock,))
    dys = [torch.randn_like(s) for s in stock]
    g_ours = torch.autograd.grad(ours, params, dys)
    g_stock = torch.autograd.grad(stock, params, dys)
    for i, (a, b) in enumerate(zip(ours, stock)):
        assert_same(a, b, f"output {i}")
    for i, (a, b) in enumerate(zip(g_ours, g_stock)):
        assert_same(a, b, f"grad {i}")


@pytest.mark.parametrize("nf4", [False, True])
def test_fused_functions_match_peft(device, nf4):
    _, block = peft_block(device, nf4=nf4)
    spec = {name: lora_spec(getattr(block, name)) for name in PROJS}
    for name, sp in spec.items():
        assert not isinstance(sp, str), f"{name}: {sp}"
        assert isinstance(sp[0], BaseWeight) and sp[0].is_nf4 == nf4 and sp[3] == 2.0
        assert sp[1] is getattr(block, name).lora_A["default"].weight
    x = torch.randn(2, 13, D, device=device, requires_grad=True)
    compare(block, x, lambda t: lora_qkv(t, spec["q_proj"], spec["k_proj"], spec["v_proj"]),
            lambda t: (block.q_proj(t), block.k_proj(t), block.v_proj(t)), ("q_proj", "k_proj", "v_proj"))
    xo = torch.randn(2, 13, Q, device=device, requires_grad=True)
    compare(block, xo, lambda t: lora_linear(t, *spec["o_proj"]), block.o_proj, ("o_proj",))
    compare(block, x, lambda t: lora_mlp(t, spec["gate_proj"], spec["up_proj"], spec["down_proj"]),
            lambda t: block.down_proj(nn.functional.silu(block.gate_proj(t)) * block.up_proj(t)),
            ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("nf4", [False, True])
def test_partial_targets_and_bias(device, nf4):
    """Only q, v, gate and down targeted (k, up plain layers: no adapter); base biases (Qwen2-like)."""
    targets = ("q_proj", "v_proj", "gate_proj", "down_proj")
    _, block = peft_block(device, targets=targets, bias=True, nf4=nf4)
    spec = {name: lora_spec(getattr(block, name)) for name in PROJS}
    assert spec["k_proj"][1] is None and spec["up_proj"][1] is None
    assert spec["k_proj"][0].bias is not None
    x = torch.randn(19, D, device=device, requires_grad=True)
    compare(block, x, lambda t: lora_qkv(t, spec["q_proj"], spec["k_proj"], spec["v_proj"]),
            lambda t: (block.q_proj(t), block.k_proj(t), block.v_proj(t)), ("q_proj", "v_proj"))
    compare(block, x, lambda t: lora_mlp(t, spec["gate_proj"], spec["up_proj"], spec["down_proj"]),
            lambda t: block.down_proj(nn.functional.silu(block.gate_proj(t)) * block.up_proj(t)),
            ("gate_proj", "down_proj"))


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
def test_ineligible_layers_give_reasons(device):
    model, block = peft_block(device, targets=("q_proj",))
    q = block.q_proj
    assert not isinstance(lora_spec(q), str)
    with model.disable_adapter():
        assert "disabled" in lora_spec(q)
    q.merge()
    assert "merged" in lora_spec(q)
    q.unmerge()
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "second"])
    assert "several" in lora_spec(q)
    block.o_proj.weight.requires_grad_(True)
    assert "trainable" in lora_spec(block.o_proj)
    for kw, reason in ((dict(lora_dropout=0.1), "dropout"), (dict(use_dora=True), "variant"),
                       (dict(lora_bias=True), "bias")):
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], **{"lora_dropout": 0.0, **kw})
        other = peft.get_peft_model(Block(), cfg).base_model.model
        assert reason in lora_spec(other.q_proj), kw


def test_zero3_weights_fused_only_when_gathered_for_the_caller(device):
    """DeepSpeed ZeRO-3 parameters (they carry ``ds_id``; attributes stood in for here): at patch time
    a partitioned base weight is judged by its recorded shape (a meta stand-in); in a call the base
    weight and the adapters must be gathered and external parameters of the calling module (kept
    gathered until its backward), else PEFT's path with the reason."""
    from types import SimpleNamespace

    _, block = peft_block(device, targets=("q_proj",))
    q = block.q_proj
    params = (q.base_layer.weight, q.lora_A["default"].weight, q.lora_B["default"].weight)
    for i, p in enumerate(params):
        p.ds_id, p.ds_shape, p.ds_status = i, tuple(p.shape), SimpleNamespace(name="NOT_AVAILABLE")
    base, a, b, _ = lora_spec(q)  # patch time
    assert base.weight.device.type == "meta" and base.shape == tuple(params[0].shape) and a is params[1]
    registered = []
    block.ds_external_parameters = lambda: [(str(i), p) for i, p in enumerate(registered)]
    assert "ZeRO-3 base weight not gathered" in lora_spec(q, zero3_owner=block)
    for p in params:
        p.ds_status = SimpleNamespace(name="AVAILABLE")
    assert "ZeRO-3 base weight not gathered" in lora_spec(q, zero3_owner=block)  # gathered, but not kept for us
    registered.append(params[0])
    assert "ZeRO-3 adapter weights not gathered" in lora_spec(q, zero3_owner=block)
    registered.extend(params[1:])
    base, a, b, _ = lora_spec(q, zero3_owner=block)
    assert base.weight is params[0] and (a, b) == params[1:]


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_nf4_codes_cast_out_of_their_storage_dtype_are_refused(device, storage):
    """NF4 codes stored in a float dtype (``bnb_4bit_quant_storage``, FSDP2 QLoRA) read as bytes: the
    spec takes them as stored, and refuses them by name once a cast (an FSDP2 MixedPrecisionPolicy
    param_dtype other than the storage, as a plain tensor the way FSDP2 hands it) changed the bytes."""
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(D, Q, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                              quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(torch.randn(Q, D), requires_grad=False, quant_type="nf4",
                                     quant_storage=storage, module=layer)  # the layer keeps a quant_state copy
    layer = layer.to(device)
    base = lora_spec(layer)[0]
    assert base.is_nf4 and base.weight.dtype == storage
    other = torch.bfloat16 if storage == torch.float32 else torch.float32
    packed = layer.weight.data
    layer.weight = nn.Parameter(packed.to(other), requires_grad=False)  # FSDP2's unsharded plain tensor, cast
    with pytest.raises(TypeError, match="bnb_4bit_quant_storage"):
        lora_spec(layer)
    layer.weight = nn.Parameter(packed.clone(), requires_grad=False)  # the same bytes, quant_state on the layer
    assert lora_spec(layer)[0].is_nf4
