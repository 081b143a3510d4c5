"""A checkpointed layer's no-grad forward replayed from a CUDA graph (``forward_graphs.py``, opt-in).

On CUDA (``gpu`` tests): several training steps with AdamW between them give the loss and every
trainable gradient of the eager run bit for bit, with the same run-time call counts; a switch of
PEFT's adapters and a re-homed parameter are captured anew instead of replaying a stale graph. On
the CPU: what steers a layer's code path is read into the layout key, dropout keeps a layer eager,
and the option is a no-op on CPU tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model
from fasttune.model_patches.checkpointing import layer_checkpointing
from fasttune.model_patches.forward_graphs import MAX_SHAPES, WARM_CALLS, ShapeBudget, layer_state
from fasttune.model_patches.report import FUSED
from helpers.compare import assert_same_steps as _same_steps
from helpers.tiny_models import make_batch, tiny_model

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model(device="cpu", router_logits=False, family="qwen3_moe"):
    """A mixture-of-experts model with LoRA on attention and experts; a dense one (family="llama") with
    LoRA on all seven projections (the fused GLU and widened LoRA paths)."""
    from peft import LoraConfig, get_peft_model

    if family == "qwen3_moe":
        model = tiny_model(family, seed=0, output_router_logits=router_logits)
        targets = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERT_TARGETS)
    else:
        model = tiny_model(family, seed=0)
        targets = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **targets))
    return model.to(device).train()


def _patched(model, graphs: bool):
    return patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=True,
                                         checkpoint_forward_graphs=graphs))


def _steps(model, batches, autocast: bool):
    """Loss and gradients of each step; AdamW between the steps (in place, as a Trainer's)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        opt.step()
    return out


def test_layer_state_reads_training_flags_and_peft_switches():
    model = _model()
    layer = model.base_model.model.model.layers[0]
    base = layer_state(layer)
    assert isinstance(base, tuple) and base == layer_state(layer)
    with model.disable_adapter():
        assert layer_state(layer) != base
    assert layer_state(layer) == base
    model.eval()
    assert layer_state(layer) != base
    model.train()
    layer.self_attn.attention_dropout = 0.1
    assert "dropout" in layer_state(layer)
    layer.self_attn.attention_dropout = 0.0
    layer.mlp.add_module("drop", nn.Dropout(0.2))
    assert "dropout" in layer_state(layer)
    layer.eval()  # dropout off in eval: no random numbers to repeat
    assert isinstance(layer_state(layer), tuple)


def test_cpu_tensors_stay_eager_with_the_option_on():
    """No CUDA graphs on the CPU: the option changes nothing there (bitwise), and nothing is captured."""
    runs, counts = [], []
    for graphs in (True, False):
        model = _model()
        report = _patched(model, graphs)
        runs.append(_steps(model, [make_batch(model.config.vocab_size, seed=s) for s in (3, 4)], autocast=False))
        counts.append({k: n for k, n in report.calls.items() if k[1] == FUSED})
        state = layer_checkpointing(model)
        assert (state.graphs is not None) is graphs
        if graphs:
            assert state.graphs.captures == state.graphs.replays == 0
    _same_steps(*runs)
    assert counts[0] == counts[1]


def test_the_option_defaults_off():
    assert FastConfig().checkpoint_forward_graphs is False
    model = _model()
    patch_model(model, FastConfig(checkpointing="offload"))
    assert layer_checkpointing(model).graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
@pytest.mark.parametrize("autocast", [True, False])
def test_cuda_replays_equal_eager_steps_bitwise(autocast, family):
    """Six steps, AdamW between them: the first WARM_CALLS run eager, the next captures, the rest replay.
    Loss and every gradient equal the eager model's bit for bit, and the run-time counts are the same."""
    base = _model("cuda", family=family)
    batches = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(6)]
    runs, counts, models = [], [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        report = _patched(model, graphs)
        runs.append(_steps(model, batches, autocast))
        counts.append(dict(report.calls))
        models.append(model)
    _same_steps(*runs)
    assert counts[0] == counts[1]
    g = layer_checkpointing(models[0]).graphs
    layers = len(models[0].base_model.model.model.layers)
    assert g.captures == layers and g.replays == layers * (len(batches) - WARM_CALLS)


@pytest.mark.gpu
def test_cuda_experts_backward_scratch_in_the_graphs_pool_under_gradient_accumulation(monkeypatch):
    """The experts' backward and the loss head take their temporaries from the graphs' idle pool
    (kernels/scratch_pool.py): both did so on every call after the first capture, and nothing allocated
    there outlives its call: with two micro-batches per step (the gradients of the first live through the
    second forward's replays; the head's input gradient is made before its workspace) loss and every
    gradient equal the eager model's bit for bit."""
    from fasttune.kernels import _lce_common, grouped_mlp, scratch_pool

    pooled, head_pooled = [], []

    def counting(seen):
        def counting_scratch(device):
            seen.append(scratch_pool._POOL.get() is not None)
            return scratch_pool.scratch(device)
        return counting_scratch

    monkeypatch.setattr(grouped_mlp, "scratch", counting(pooled))
    monkeypatch.setattr(_lce_common, "scratch", counting(head_pooled))
    base = _model("cuda")
    batches = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(8)]
    runs = []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        _patched(model, graphs)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        out = []
        for i in range(0, len(batches), 2):
            opt.zero_grad(set_to_none=True)
            losses = []
            for batch in batches[i:i + 2]:
                loss = model(**batch).loss
                (loss / 2).backward()
                losses.append(loss.detach())
            out.append((torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.requires_grad}))
            opt.step()
        runs.append(out)
        if graphs:
            assert layer_checkpointing(model).graphs.scratch[0] is not None
            assert any(pooled) and pooled[-1], "the experts' backward never used the graphs' pool"
            assert any(head_pooled) and head_pooled[-1], f"the head's workspace left the graphs' pool: {head_pooled}"
            pooled.clear()
            head_pooled.clear()
    _same_steps(*runs)
    assert not any(pooled), "an eager model's backward used a scratch pool"
    assert head_pooled and not any(head_pooled), "an eager model's head used a scratch pool"


@pytest.mark.gpu
def test_cuda_adapter_switch_and_rehomed_parameter_are_captured_anew():
    """A forward with PEFT's adapters disabled is another layout (its own graph, not the adapters-on
    replay); a LoRA parameter given new storage makes the layer capture again. Numbers = eager."""
    base = _model("cuda")
    batches = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(9)]
    runs, models = [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        _patched(model, graphs)
        out = _steps(model, batches[:4], autocast=True)
        with model.disable_adapter(), torch.autocast("cuda", dtype=torch.bfloat16):  # the layers' other path
            for b in batches[4:8]:  # grad on, training mode: the checkpointed path, forward only
                out.append((model(**b).loss.detach(), {}))
        lora = next(p for n, p in model.named_parameters() if "lora_A" in n)
        lora.data = lora.data.clone()  # new storage: a graph captured on the old one would read stale memory
        out += _steps(model, batches[8:], autocast=True)
        runs.append(out)
        models.append(model)
    for i, ((la, ga), (lb, gb)) in enumerate(zip(*runs)):
        assert torch.equal(la, lb), (i, la, lb)
        assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga), i
    g = layer_checkpointing(models[0]).graphs
    assert g.captures > len(models[0].base_model.model.model.layers)  # captured again after the switches


@pytest.mark.gpu
def test_cuda_layers_recording_router_logits_stay_eager():
    """output_router_logits=True: transformers records the router logits inside the layer, which a replay
    would not: the layers stay eager (nothing captured after the try), the auxiliary loss and every
    gradient equal the eager model's bit for bit."""
    base = _model("cuda", router_logits=True)
    batches = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(5)]
    runs, models = [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        _patched(model, graphs)
        runs.append(_steps(model, batches, autocast=True))
        models.append(model)
    _same_steps(*runs)
    g = layer_checkpointing(models[0]).graphs
    assert g.captures == g.replays == 0 and any("router logits" in why for why in g.logged)
    models[0].config.output_router_logits = False  # the same layouts without a collector: captured, replayed
    for m in models:
        m.base_model.model.config.output_router_logits = False
    more = [make_batch(base.config.vocab_size, seed=s, device="cuda") for s in range(10, 13)]
    _same_steps(*[_steps(m, more, autocast=True) for m in models])
    assert g.captures == len(models[0].base_model.model.model.layers) and g.replays > 0


def test_shape_budget_admits_a_few_layouts_then_refuses():
    """Each captured hidden-state layout keeps its buffers and captures: the first ``limit`` are admitted (and
    again later), a new one past them is refused, with a reason that names the way out."""
    budget = ShapeBudget(limit=2)
    a, b, c = torch.empty(2, 17, 8), torch.empty(2, 33, 8), torch.empty(2, 49, 8)
    assert budget.admit(a) and budget.admit(b) and budget.admit(a)
    assert not budget.admit(c) and not budget.admit(c.double())
    assert budget.admit(torch.empty(2, 33, 8))  # the same layout, another tensor
    assert "pad_to_multiple_of" in budget.refusal()
    assert ShapeBudget().limit == MAX_SHAPES >= 4


@pytest.mark.gpu
def test_cuda_shapes_past_the_budget_stay_eager_forward_and_backward():
    """With room for one shape, batches of a second length run eagerly in forward and backward (logged once
    each), the first length keeps replaying, and every step equals the eager model's bit for bit."""
    base = _model("cuda", family="llama")
    batches = [make_batch(base.config.vocab_size, seq=17 if s % 2 else 29, seed=s, device="cuda") for s in range(10)]
    runs, models = [], []
    for graphs in (True, False):
        model = copy.deepcopy(base)
        patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=True,
                                      checkpoint_forward_graphs=graphs, checkpoint_backward_graphs=graphs))
        if graphs:
            layer_checkpointing(model).graphs.shapes.limit = 1
        runs.append(_steps(model, batches, autocast=True))
        models.append(model)
    _same_steps(*runs)
    g = layer_checkpointing(models[0]).graphs
    layers = len(models[0].base_model.model.model.layers)
    for graphs in (g, g.backward):
        assert graphs.captures == layers and graphs.replays == layers * (5 - WARM_CALLS), (graphs.captures,
                                                                                         graphs.replays)
        assert any("hidden-state shapes" in why for why in graphs.logged), graphs.logged
