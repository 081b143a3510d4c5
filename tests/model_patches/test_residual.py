"""residual.py: pre-norm decoder layers with the residual adds inside the norm kernels.

What must hold: the forward is bit for bit the layer with separate adds (fasttune's own norms,
``residual_norms=False``) and the stock layer's function (fp32 and bf16, with and without LoRA),
the gradients agree (fp32 tightly; bf16 to the rounding of one fp32 sum), three of the four add
kernels per layer are gone from a training step (counted at the dispatcher), and mixed dtypes,
positional arguments, decode steps and norms replaced after patching take the stock route.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from fasttune import FastConfig, patch_model
from fasttune.model_patches.residual import FusedResidualLayerForward
from helpers.compare import assert_grads_close, rel_err
from helpers.tiny_models import make_batch, tiny_model

ADDS = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor}


class AddCounter(TorchDispatchMode):
    """Counts elementwise adds of activation-sized tensors (rows × hidden) at the dispatcher."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.forward, self.backward = hidden, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ADDS and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 and args[0].shape[-1] == self.hidden:
            if torch.is_grad_enabled():  # the autograd engine runs backward with grad mode off
                self.forward += 1
            else:
                self.backward += 1
        return func(*args, **(kwargs or {}))


def _pair(model_type="llama", dtype=torch.float32, lora=False, seed=0):
    stock = tiny_model(model_type, dtype=dtype, seed=seed)
    if lora:
        stock = get_peft_model(stock, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
    fused, split = copy.deepcopy(stock), copy.deepcopy(stock)
    assert patch_model(fused, FastConfig(cross_entropy=False)).patched["residual_norms"] == 2
    assert "residual_norms" not in patch_model(split, FastConfig(cross_entropy=False, residual_norms=False)).patched
    return stock, fused, split


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma"])
def test_fp32_same_forward_bits_and_gradients(device, model_type, lora):
    stock, fused, split = (m.to(device).train() for m in _pair(model_type, lora=lora, seed=1))
    batch = make_batch(stock.config.vocab_size, seed=2, device=device)
    a, b, c = (_step(m, batch) for m in (fused, split, stock))
    assert torch.equal(a.logits, b.logits)  # the same sums and norms, only fewer kernels
    assert rel_err(a.loss, c.loss) <= 1e-6
    assert_grads_close(fused, split, 1e-6)
    assert_grads_close(fused, stock, 1e-5)


def test_bf16_same_forward_bits_gradients_within_rounding(device):
    _, fused, split = (m.to(device).train() for m in _pair(dtype=torch.bfloat16, seed=3))
    batch = make_batch(fused.config.vocab_size, seed=4, device=device)
    a, b = _step(fused, batch), _step(split, batch)
    if device == "cuda":
        assert torch.equal(a.logits, b.logits)
    else:  # the interpreter truncates the kernel's fp32 → bf16 sum where torch's add rounds it
        assert rel_err(a.logits, b.logits) <= 2e-2
    # The norm's gradient and the residual's are summed in fp32 and rounded once (twice with
    # separate adds): bf16 gradients differ by about an ulp of the larger term.
    assert_grads_close(fused, split, 2e-2)


def test_three_of_four_adds_per_layer_are_gone(device):
    _, fused, split = (m.to(device).train() for m in _pair(seed=5))
    batch = make_batch(fused.config.vocab_size, seed=6, device=device)
    counts = []
    for model in (fused, split):
        with AddCounter(model.config.hidden_size) as counter:
            _step(model, batch)
        counts.append((counter.forward, counter.backward))
    layers = fused.config.num_hidden_layers
    # Forward: the attention's residual add now runs in the norm; the MLP's stays (the layer's output).
    assert counts[0][0] == layers and counts[1][0] == 2 * layers, counts
    # Backward: both residual-gradient sums are in the norms. (What remains are the sums over the
    # stock q/k/v and gate/up Linears reading one input, the same in both.)
    assert counts[1][1] - counts[0][1] == 2 * layers, counts


def test_mixed_dtypes_take_torch_adds(device):
    """An fp32 residual stream with bf16 branch outputs (fp32 weights under autocast) is added by
    torch with type promotion, as the stock layer adds it."""
    if device != "cpu":
        pytest.skip("CPU autocast case")
    _, fused, split = (m.to(device).train() for m in _pair(seed=7))
    batch = make_batch(fused.config.vocab_size, seed=8, device=device)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = _step(fused, batch), _step(split, batch)
    assert torch.equal(a.logits, b.logits)
    assert_grads_close(fused, split, 1e-6)


def test_positional_arguments_decode_steps_and_replaced_norms_run_stock(device):
    stock, fused, _ = (m.to(device).eval() for m in _pair(seed=9))
    layer, ref_layer = fused.model.layers[0], stock.model.layers[0]
    assert isinstance(layer.forward, FusedResidualLayerForward)
    x = torch.randn(2, 5, fused.config.hidden_size, device=device)
    pos = torch.arange(5, device=device).expand(2, 5)
    emb = fused.model.rotary_emb(x, position_ids=pos)
    with torch.no_grad():
        want = ref_layer(x, None, position_embeddings=emb)  # attention_mask positional
        assert torch.equal(layer(x, None, position_embeddings=emb), want)
        assert torch.equal(layer(hidden_states=x, attention_mask=None, position_embeddings=emb), want)
    # A norm whose forward someone replaced after patching: the layer no longer fuses it.
    layer.input_layernorm.forward = lambda h: ref_layer.input_layernorm(h)
    assert layer.forward._norms() is None
    with torch.no_grad():
        assert torch.equal(layer(x, position_embeddings=emb), want)


def test_hooked_norms_run_as_modules(device):
    """A hook on a norm (a user's, or FSDP2's / DeepSpeed's parameter gathering) only runs through
    ``Module.__call__``: the layer then calls its norms as modules, and the hook fires."""
    _, fused, split = (m.to(device).train() for m in _pair(seed=10))
    batch = make_batch(fused.config.vocab_size, seed=11, device=device)
    seen = []
    handles = [m.model.layers[1].post_attention_layernorm.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
               for m in (fused, split)]
    assert fused.model.layers[1].forward._norms() is None and fused.model.layers[0].forward._norms() is not None
    a, b = _step(fused, batch), _step(split, batch)
    assert len(seen) == 2 and torch.equal(a.logits, b.logits)
    for h in handles:
        h.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
    try:
        assert fused.model.layers[0].forward._norms() is None
    finally:
        handle.remove()
    assert fused.model.layers[1].forward._norms() is not None
