"""No fused path reads memory it never wrote: NaN-poisoned allocators change no bit of a step.

tests/conftest.py runs every kernel and patched-model test with poisoned memory
(``helpers/poison.py``); this file checks the poison itself (an unwritten read does show) and
runs the paths that once read unwritten columns on their own: the widened LoRA MLP, whose down
projection reads H from a buffer with a tail written later, and a norm output whose spare columns
feed widened q/k/v and gate/up groups (CPU bf16 GEMMs read past the end of a padded row). Odd
widths, bf16, a whole PEFT model step. Each run must be bitwise the run without poison: any read
of unwritten memory that reaches a result shows as a difference, not only as a NaN.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune import FastConfig, patch_model
from fasttune.kernels.lora_glu import lora_mlp
from helpers.poison import PoisonAllocations, poison_free_memory, poisoned
from helpers.tiny_models import make_batch, tiny_model
from helpers.wide_lora import spec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.unpoisoned  # this test sets the poison itself
def test_poison_shows_an_unwritten_read(device):
    with poisoned(device) as mode:
        fresh = torch.empty(37, 5, device=device, dtype=torch.bfloat16)
        like = torch.empty_like(torch.ones(3, device=device))
        wide = torch.ones(4, 6, device=device).new_empty((4, 9))[:, 6:]
        ints = torch.empty(5, dtype=torch.int32, device=device)
    assert fresh.isnan().all() and like.isnan().all() and wide.isnan().all()
    assert (ints == -1).all()
    assert mode.count == 4


@pytest.mark.unpoisoned
def test_freed_memory_comes_back_poisoned(device):
    """The allocator's own poison, without the dispatch mode: a freed block is handed back NaN."""
    if device == "cpu":
        pytest.skip("glibc's reuse of a freed block is not deterministic; the dispatch mode covers the CPU")
    block = torch.zeros(1 << 20, device=device)
    del block
    poison_free_memory(device)
    again = torch.empty(1 << 20, device=device)
    assert again.isnan().all()


def _mlp_step(device, dtype, activation):
    torch.manual_seed(2)
    x = torch.randn(2, 31, 72, device=device, dtype=dtype, requires_grad=True)
    parts = [spec(203, 72, 8, dtype, device, 5, extra=16), spec(203, 72, 8, dtype, device, 6, extra=16),
             spec(72, 203, 8, dtype, device, 7, extra=8)]
    y = lora_mlp(x, *(p[0] for p in parts), activation=activation)
    params = [x] + [t for (_, a, b, _), _, _ in parts for t in (a, b)]
    return (y, *torch.autograd.grad(y, params, torch.randn_like(y)))


@pytest.mark.unpoisoned
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_lora_mlp_reads_no_unwritten_memory(device, dtype, activation):
    clean = _mlp_step(device, dtype, activation)
    with poisoned(device):
        dirty = _mlp_step(device, dtype, activation)
    for i, (a, b) in enumerate(zip(clean, dirty)):
        assert torch.equal(a, b), f"output/gradient {i} changed under poisoned memory"


def _model_step(device, dtype, widen):
    base = tiny_model("llama", dtype=dtype, vocab_size=1000, hidden_size=100, intermediate_size=202)
    torch.manual_seed(1)
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, cfg).to(device)  # PEFT keeps the adapters in fp32
    patch_model(model, FastConfig(lora_widen=widen))
    batch = {k: v.to(device) for k, v in make_batch(1000, batch=2, seq=23, seed=3).items()}
    model.train()
    out = []
    for _ in range(2):  # the second step reads the norms' spare columns (requested on the first)
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        out.append(loss.detach())
    out += [p.grad for _, p in sorted(model.named_parameters()) if p.requires_grad]
    return out


@pytest.mark.unpoisoned
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_peft_model_step_reads_no_unwritten_memory(device, dtype):
    """Widened q/k/v, gate/up and down over the norms' spare columns; hidden 100, intermediate 202."""
    clean = _model_step(device, dtype, widen=True)
    assert all(t.isfinite().all() for t in clean)
    with poisoned(device) as mode:
        dirty = _model_step(device, dtype, widen=True)
    assert mode.count > 0
    for i, (a, b) in enumerate(zip(clean, dirty)):
        assert torch.equal(a, b), f"loss/gradient {i} changed under poisoned memory"


@pytest.mark.gpu
@pytest.mark.unpoisoned
def test_poisoned_cuda_caching_allocator_8b_layer_shapes():
    """At an 8B layer's widths (odd N), with the caching allocator's free blocks NaN."""
    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(3, 1361, 4096, device=device, dtype=dtype, requires_grad=True)
    parts = [spec(14336, 4096, 16, dtype, device, 5, extra=64), spec(14336, 4096, 16, dtype, device, 6, extra=64),
             spec(4096, 14336, 16, dtype, device, 7, extra=64)]

    def run():
        y = lora_mlp(x, *(p[0] for p in parts))
        params = [x] + [t for (_, a, b, _), _, _ in parts for t in (a, b)]
        return (y, *torch.autograd.grad(y, params, torch.ones_like(y)))

    clean = run()
    poison_free_memory(device)
    with PoisonAllocations():
        dirty = run()
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
