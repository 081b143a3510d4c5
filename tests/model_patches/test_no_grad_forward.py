"""Checkpointed layers whose forward runs without autograd (``no_grad_forward.py``).

The gradients must be those of the graph-recording checkpoint (``checkpoint_no_grad_forward=False``)
and of a run without checkpointing, bit for bit; where the layer must record its forward (router
logits for the auxiliary loss, hooks inside the layer, other inputs that need a gradient) it does,
and says why in the report's counts.
"""

from __future__ import annotations

import pytest
import torch

from fasttune.config import FastConfig
from fasttune.model_patches import patch_model
from fasttune.model_patches.no_grad_forward import OP, run_without_graph, why_not
from fasttune.model_patches.report import FUSED
from helpers.tiny_models import make_batch, tiny_model

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model(model_type, dtype=torch.float32, lora=True, router_logits=False):
    moe = model_type in ("qwen3_moe", "mixtral", "qwen2_moe")
    model = tiny_model(model_type, dtype=dtype, seed=0, **(dict(output_router_logits=router_logits) if moe else {}))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else
                                                                                         ["gate_proj", "up_proj",
                                                                                          "down_proj"]),
            target_parameters=EXPERT_TARGETS if moe else None, lora_dropout=0.0, init_lora_weights=False))
    model.train()
    return model


def _step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = model(**batch, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _run(model_type, mode, dtype=torch.float32, step_kw=None, router_logits=False, **config):
    model = _model(model_type, dtype, router_logits=router_logits)
    report = None
    if mode is not None:
        config.setdefault("checkpoint_no_grad_forward", True)  # on for the dense family too
        report = patch_model(model, FastConfig(checkpointing=mode, **config))
    batch = make_batch(model.config.vocab_size, seed=3)
    return report, _step(model, batch, **(step_kw or {}))


def _same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb), (la, lb)
    assert ga.keys() == gb.keys() and ga
    bad = [n for n in ga if not torch.equal(ga[n], gb[n])]
    assert not bad, f"gradients differ bitwise: {bad[:4]}"
    assert all(g.abs().sum() > 0 for g in ga.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["recompute", "offload"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen2_moe"])
def test_gradients_equal_the_recorded_checkpoint_bitwise(model_type, mode, dtype):
    """Every layer's forward ran without autograd (counted), and loss and every LoRA gradient equal
    those of the graph-recording checkpoint with every kernel on, bit for bit."""
    report, fast = _run(model_type, mode, dtype)
    recorded_report, recorded = _run(model_type, mode, dtype, checkpoint_no_grad_forward=False)
    layers = report.patched["checkpointing"]
    assert report.calls[OP, FUSED] == layers, dict(report.calls)
    _same(fast, recorded)
    fused = {k: n for k, n in report.calls.items() if k[1] == FUSED and k[0] != OP}
    assert fused == {k: n for k, n in recorded_report.calls.items() if k[1] == FUSED}  # the same kernels ran
    if model_type in ("qwen3_moe", "qwen2_moe"):
        assert report.calls["lora_moe", FUSED] > 0


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen2_moe"])
def test_gradients_equal_an_unchecked_run_bitwise(model_type):
    """Against the same patched model without checkpointing (the same kernels, run once)."""
    _, fast = _run(model_type, "offload")
    model = _model(model_type)
    patch_model(model, FastConfig(checkpointing=None))
    _same(fast, _step(model, make_batch(model.config.vocab_size, seed=3)))


def test_the_experts_see_the_recompute_marker_only_in_the_recompute(monkeypatch):
    """The recompute in backward runs under ``backward_follows`` (the experts free their gate/up activations
    in their backward there); the forward without autograd and a model without checkpointing do not."""
    from fasttune.kernels import grouped_mlp

    seen = []
    real = grouped_mlp.backward_follows_now
    monkeypatch.setattr(grouped_mlp, "backward_follows_now", lambda: seen.append(real()) or seen[-1])
    _, fast = _run("qwen3_moe", "offload")
    assert seen and all(seen), seen  # the Function runs in the recompute only, marked
    calls = len(seen)
    seen.clear()
    model = _model("qwen3_moe")
    patch_model(model, FastConfig(checkpointing=None))
    _same(fast, _step(model, make_batch(model.config.vocab_size, seed=3)))
    assert seen == [False] * calls, seen


def test_the_layer_output_comes_from_the_recomputing_function():
    model = _model("llama")
    patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=True))
    seen = []
    model.base_model.model.model.layers[-1].register_forward_hook(lambda m, a, out: seen.append(out))
    # a hook on the layer module itself runs outside the checkpointed forward: the layer keeps the fast path
    batch = make_batch(model.config.vocab_size, seed=3)
    model(**batch).loss.backward()
    out = seen[0] if isinstance(seen[0], torch.Tensor) else seen[0][0]
    assert type(out.grad_fn).__name__ == "RecomputedLayerBackward"


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_router_logits_of_the_auxiliary_loss_carry_their_gradient(mode):
    """output_router_logits=True: transformers records the router logits inside the layer; they leave
    the layer as outputs of the recomputing Function, so the auxiliary loss back-propagates as under
    the recorded checkpoint, bit for bit (loss and every gradient, the aux loss's included)."""
    report, fast = _run("qwen3_moe", mode, router_logits=True)
    _, recorded = _run("qwen3_moe", mode, router_logits=True, checkpoint_no_grad_forward=False)
    assert report.calls[OP, FUSED] == report.patched["checkpointing"], dict(report.calls)
    _same(fast, recorded)
    _, no_aux = _run("qwen3_moe", mode, router_logits=False)
    assert not torch.equal(fast[0], no_aux[0])  # the auxiliary loss was there


def test_full_finetune_router_gradient_with_the_auxiliary_loss():
    """Full fine-tuning (the router trains): its gradient, from the LM loss and the auxiliary loss,
    equals the recorded checkpoint's."""
    runs = []
    for flag in (True, False):
        model = tiny_model("qwen3_moe", seed=0, output_router_logits=True)
        model.train()
        report = patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=flag))
        runs.append(_step(model, make_batch(model.config.vocab_size, seed=3)))
        assert report.calls.get((OP, FUSED), 0) == (report.patched["checkpointing"] if flag else 0)
    _same(*runs)
    assert any(".gate." in n for n in runs[0][1])


def test_forward_hooks_inside_the_layer_keep_the_recorded_forward():
    model = _model("llama")
    report = patch_model(model, FastConfig(checkpointing="recompute", checkpoint_no_grad_forward=True))
    captured = []
    model.base_model.model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: captured.append(out))
    batch = make_batch(model.config.vocab_size, seed=3)
    model(**batch).loss.backward()
    assert captured[0].requires_grad  # what the hook captured can still be trained through
    reasons = {why for (op, why), n in report.calls.items() if op == OP}
    assert FUSED in reasons and any("hooks" in r for r in reasons), reasons


def test_a_hook_deep_inside_the_layer_is_found():
    """why_not walks every module below the layer: a pre-hook on a LoRA matrix of one projection
    (three levels down, under PEFT's wrappers) makes that layer record its forward; transformers' own
    recorder does not, and neither does a hook on the layer module itself."""
    model = _model("qwen3_moe")
    layers = model.base_model.model.model.layers
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    assert why_not(layers[0], (), {}) is None
    layers[0].register_forward_hook(lambda m, a, out: None)
    assert why_not(layers[0], (), {}) is None

    def output_capturing_hook(m, a, out):  # named as transformers names its recorder
        return None

    layers[0].mlp.gate.register_forward_hook(output_capturing_hook)
    assert why_not(layers[0], (), {}) is None
    handle = layers[0].self_attn.q_proj.lora_A["default"].register_forward_pre_hook(lambda m, a: None)
    assert "hooks" in why_not(layers[0], (hidden,), {})
    assert why_not(layers[1], (), {}) is None
    handle.remove()
    assert why_not(layers[0], (), {}) is None


def test_autograd_grad_through_a_layer_raises_naming_the_option():
    """torch.autograd.grad cannot follow a recompute that back-propagates: asked for the input
    embeddings' gradient, the layer raises naming the option (never a wrong gradient); asked for a
    layer's parameters, torch itself finds them outside the recorded graph."""
    model = _model("llama")
    patch_model(model, FastConfig(checkpointing="recompute", checkpoint_no_grad_forward=True))
    batch = make_batch(model.config.vocab_size, seed=3)
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    loss = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    with pytest.raises(RuntimeError, match="checkpoint_no_grad_forward"):
        torch.autograd.grad(loss, [embeds], retain_graph=True)
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(loss, params)


def test_retain_graph_backward_twice_accumulates_as_recorded():
    """backward(retain_graph=True) then backward again: each recomputes, gradients accumulate twice,
    as under the recorded checkpoint."""
    runs = []
    for flag in (True, False):
        model = _model("qwen3_moe")
        # the fused loss head hands its gradient over once (it refuses a second backward): stock head here
        patch_model(model, FastConfig(checkpointing="recompute", checkpoint_no_grad_forward=flag, cross_entropy=False))
        loss = model(**make_batch(model.config.vocab_size, seed=3)).loss
        loss.backward(retain_graph=True)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    _same(*runs)


def test_off_records_every_forward():
    report, _ = _run("llama", "recompute", checkpoint_no_grad_forward=False)
    assert not any(op == OP for op, _ in report.calls)


@pytest.mark.parametrize("model_type, on", [("llama", False), ("qwen3_moe", True)])
def test_default_is_on_for_mixture_of_experts_families_only(model_type, on):
    """None: the MoE families' host-bound layers take it, the dense families' GPU-bound ones do not."""
    model = _model(model_type)
    report = patch_model(model, FastConfig(checkpointing="offload"))
    _step(model, make_batch(model.config.vocab_size, seed=3))
    assert (report.calls.get((OP, FUSED), 0) == report.patched["checkpointing"]) is on, dict(report.calls)
    assert on or not any(op == OP for op, _ in report.calls)


def test_why_not_names_other_inputs_that_need_a_gradient():
    layer = torch.nn.Linear(4, 4)
    assert why_not(layer, (torch.zeros(2, requires_grad=True),), {}) is not None
    assert why_not(layer, (), {"position_embeddings": (torch.zeros(2), torch.zeros(2))}) is None


def test_function_restores_the_rng_state_for_the_recompute():
    """A layer with dropout: the recompute's mask is the forward's (the output gradient flows through
    the same mask), whatever ran in between."""
    drop = torch.nn.Dropout(0.5)
    x = torch.randn(64, requires_grad=True)

    class Call:
        def __init__(self):
            self.outs = []

        def __call__(self, h):
            out = drop(h * 2.0)
            self.outs.append(out.detach())
            return out

    call = Call()
    torch.manual_seed(0)
    y = run_without_graph(call, x, (), {})
    torch.rand(100)  # the generator moves on before backward
    y.sum().backward()
    assert torch.equal(call.outs[0], call.outs[1])
    assert torch.equal(x.grad, (call.outs[0] != 0).float() * 4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_cuda_autocast_offload_matches_the_recorded_checkpoint_bitwise(model_type):
    """On CUDA under bf16 autocast, offloaded: the recompute re-enters autocast and the CUDA RNG
    state (attention dropout on), and the input comes back from the host."""
    runs = []
    for no_grad_forward in (True, False):
        model = _model(model_type).cuda()
        model.config.attention_dropout = 0.1
        for m in model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.1
        report = patch_model(model, FastConfig(checkpointing="offload", checkpoint_no_grad_forward=no_grad_forward))
        batch = make_batch(model.config.vocab_size, seed=3, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            runs.append(_step(model, batch))
        assert report.calls.get((OP, FUSED), 0) == (report.patched["checkpointing"] if no_grad_forward else 0)
    _same(*runs)
