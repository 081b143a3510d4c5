"""A checkpointed layer's backward replayed from a CUDA graph (``backward_graphs.py``, opt-in).

On CUDA (``gpu`` tests): several steps with AdamW between them, one and two micro-batches per step,
give the loss and every trainable gradient of the eager run bit for bit, with the same run-time call
counts, on a dense family (fused GLU, widened LoRA) and a mixture-of-experts one (its MoE layer
captured when it records no router logits, eager when it does); a parameter with a gradient hook
keeps its layer eager. On the CPU: the option's validation, the accumulation that
stands in for autograd's, and a no-op on CPU tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model
from fasttune.model_patches.backward_graphs import accumulate
from fasttune.model_patches.checkpointing import layer_checkpointing
from fasttune.model_patches.forward_graphs import WARM_CALLS
from fasttune.model_patches.no_grad_forward import OP
from fasttune.model_patches.report import FUSED
from helpers.compare import assert_same_steps as _same_steps
from helpers.tiny_models import make_batch, tiny_model

ALL_7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(family: str, device="cpu", **overrides):
    from peft import LoraConfig, get_peft_model

    model = tiny_model(family, seed=0, **overrides)
    targets = (dict(target_modules=ALL_7[:4], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
               if family == "qwen3_moe" else dict(target_modules=ALL_7))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **targets))
    return model.to(device).train()


def _patched(model, backward_graphs: bool, forward_graphs: bool = True):
    return patch_model(model, FastConfig(checkpointing="offload", checkpoint_forward_graphs=forward_graphs,
                                         checkpoint_backward_graphs=backward_graphs))


def _steps(model, batches, autocast: bool, micro: int = 1):
    """Per step (``micro`` batches each, their losses averaged): the losses and every trainable gradient;
    AdamW between the steps."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for i in range(0, len(batches), micro):
        opt.zero_grad(set_to_none=True)
        losses = []
        for batch in batches[i:i + micro]:
            with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss
            (loss / micro).backward()
            losses.append(loss.detach())
        out.append((torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        opt.step()
    return out


def test_backward_graphs_need_forward_graphs_and_the_no_grad_forward():
    with pytest.raises(ValueError, match="checkpoint_backward_graphs needs checkpoint_forward_graphs"):
        FastConfig(checkpoint_backward_graphs=True)
    with pytest.raises(ValueError, match="checkpoint_no_grad_forward=False"):
        FastConfig(checkpoint_forward_graphs=True, checkpoint_no_grad_forward=False)
    assert FastConfig().checkpoint_backward_graphs is False


def test_forward_graphs_turn_on_the_no_grad_forward_of_a_dense_family():
    """Dense families record their forward by default; the graphs replay the no-grad forward, so asking
    for them runs it (counted), instead of a silent no-op."""
    for graphs, expect in ((False, False), (True, True)):
        model = _model("llama")
        report = patch_model(model, FastConfig(checkpointing="offload", checkpoint_forward_graphs=graphs))
        model(**make_batch(model.config.vocab_size, seed=1)).loss.backward()
        assert layer_checkpointing(model).no_grad_forward is expect
        assert (report.calls[OP, FUSED] > 0) is expect


def test_accumulate_adds_like_autograd_and_copies_into_missing_grads():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3).t())  # non-contiguous: .grad takes its strides
    q = torch.nn.Parameter(torch.randn(4))
    r = torch.nn.Parameter(torch.randn(2))
    q.grad = torch.randn(4)
    q_before = q.grad.clone()
    g_p = torch.empty_strided(p.shape, p.stride()).copy_(torch.randn(3, 5))
    g_q = torch.randn(4)
    accumulate([p, q, r], [g_p, g_q, None])
    assert torch.equal(p.grad, g_p) and p.grad.stride() == p.stride() and p.grad.data_ptr() != g_p.data_ptr()
    assert torch.equal(q.grad, q_before + g_q)
    assert r.grad is None
    g_p2 = torch.randn(3, 5)
    accumulate([p], [g_p2])
    assert torch.equal(p.grad, g_p + g_p2)


def test_cpu_tensors_stay_eager_with_the_option_on():
    runs = []
    for backward_graphs in (True, False):
        model = _model("llama")
        _patched(model, backward_graphs)
        runs.append(_steps(model, [make_batch(model.config.vocab_size, seed=s) for s in (3, 4, 5, 6)], False))
        g = layer_checkpointing(model).graphs
        assert (g.backward is not None) is backward_graphs
        if backward_graphs:
            assert g.backward.captures == g.backward.replays == 0
    _same_steps(*runs)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("autocast", [True, False])
def test_cuda_backward_replays_equal_eager_steps_bitwise(autocast, family):
    """Six single-batch steps, then three of two micro-batches (the replays add to existing .grad): loss
    and every gradient equal those of the eager model (no graphs at all), bit for bit, with the same
    run-time counts; every dense layer captured its backward once and replayed it after WARM_CALLS.
    The tiny Qwen3-MoE records router logits (``output_router_logits=True``): its MoE layer stays eager
    (logged), its dense layer is captured, the same numbers."""
    base = _model(family, "cuda")
    batches = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(12)]
    runs, counts, models = [], [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        report = patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=True,
                                               checkpoint_forward_graphs=graphs, checkpoint_backward_graphs=graphs))
        runs.append(_steps(model, batches[:6], autocast) + _steps(model, batches[6:], autocast, micro=2))
        counts.append(dict(report.calls))
        models.append(model)
    _same_steps(*runs)
    assert counts[0] == counts[1]
    b = layer_checkpointing(models[0]).graphs.backward
    layers = len(models[0].base_model.model.model.layers)
    if family == "qwen3_moe":
        assert any("router logits" in why for why in b.logged), b.logged
        layers -= 1  # the MoE layer, eager
    assert b.captures == layers and b.replays == layers * (len(batches) - WARM_CALLS), (b.captures, b.replays,
                                                                                        b.logged)


@pytest.mark.gpu
def test_cuda_moe_backward_replays_bitwise():
    """A Qwen3-MoE whose layers record no router logits (``output_router_logits=False``; the tiny configs ask
    for them, and a recording layer stays eager) captures every layer's backward, the experts' included
    (their routing changes from batch to batch), and matches eager bit for bit."""
    base = _model("qwen3_moe", "cuda", output_router_logits=False)
    batches = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(12)]
    runs, models = [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=True,
                                      checkpoint_forward_graphs=graphs, checkpoint_backward_graphs=graphs))
        runs.append(_steps(model, batches[:6], True) + _steps(model, batches[6:], True, micro=2))
        models.append(model)
    _same_steps(*runs)
    b = layer_checkpointing(models[0]).graphs.backward
    layers = len(models[0].base_model.model.model.layers)
    assert b.captures == layers and b.replays == layers * (len(batches) - WARM_CALLS), (b.captures, b.replays,
                                                                                        b.logged)


@pytest.mark.gpu
def test_cuda_a_gradient_hook_keeps_the_layer_eager():
    """A hook on a LoRA parameter's gradient runs (a replay would skip it): that layer's backward stays
    eager, logged, and the hook sees every step's gradient."""
    model = _model("llama", "cuda")
    _patched(model, backward_graphs=True)
    seen = []
    lora = next(p for n, p in model.named_parameters() if "lora_A" in n)
    lora.register_hook(lambda g: seen.append(g.norm().item()))
    _steps(model, [make_batch(model.config.vocab_size, seed=s, device="cuda") for s in range(5)], autocast=True)
    b = layer_checkpointing(model).graphs.backward
    assert len(seen) == 5 and all(s > 0 for s in seen)
    assert any("gradient hooks" in why for why in b.logged)
    assert b.captures == len(model.base_model.model.model.layers) - 1


@pytest.mark.gpu
def test_cuda_gpt_oss_flex_block_masks_replay_from_static_copies():
    """gpt-oss on flex attention: each forward builds new BlockMasks (a padding mask in their mask function's
    closure), which the graphs must copy in like any input (``graph_inputs.py``). Free memory poisoned before
    every step (a replay reading the capture step's freed mask sees garbage, not a lucky reuse), left padding
    of a new length each step: forward and backward graphs on equal the same model without graphs bit for
    bit, every layer captured both ways and replayed after WARM_CALLS."""
    from peft import LoraConfig, get_peft_model

    from helpers.poison import poison_free_memory

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=ALL_7[:4], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    base = get_peft_model(tiny_model("gpt_oss", seed=0, output_router_logits=False), config).to("cuda").train()
    batches = []
    for s in range(10):
        batch = make_batch(base.config.vocab_size, seq=150, seed=s, device="cuda")
        batch["attention_mask"][1, :3 + 7 * s] = 0  # left padding, a new length each step
        batch["labels"][1, :3 + 7 * s] = -100
        batches.append(batch)
    runs, models = [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=True,
                                      checkpoint_forward_graphs=graphs, checkpoint_backward_graphs=graphs))
        assert model.config._attn_implementation == "flex_attention"
        out = []
        for batch in batches:  # (a fresh AdamW each step, alike in both runs)
            poison_free_memory("cuda")
            out += _steps(model, [batch], autocast=True)
        runs.append(out)
        models.append(model)
    _same_steps(*runs)
    g = layer_checkpointing(models[0]).graphs
    layers = len(models[0].base_model.model.model.layers)
    for graphs in (g, g.backward):
        assert graphs.captures == layers and graphs.replays == layers * (len(batches) - WARM_CALLS), (
            graphs.captures, graphs.replays, graphs.logged)
