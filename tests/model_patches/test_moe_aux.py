"""The router's auxiliary loss under the fused head: resolved like stock (the call's
``output_router_logits``, else the config's), computed by the family's own function, added with
``router_aux_loss_coef`` only when asked, and absent for dense families."""

from __future__ import annotations

import copy

import pytest

from fasttune import FastConfig, patch_model
from fasttune.model_patches.moe_aux import add_router_aux, aux_loss_function, router_logits_wanted
from helpers.compare import rel_err
from helpers.tiny_models import make_batch, tiny_model


def test_dense_families_have_no_auxiliary_loss():
    model = tiny_model("llama", vocab_size=1000)
    assert aux_loss_function(model) is None and router_logits_wanted(model, {}) is None


def test_resolution_follows_the_call_then_the_config():
    model = tiny_model("mixtral", output_router_logits=False)
    assert aux_loss_function(model).__module__ == type(model).__module__
    assert router_logits_wanted(model, {}) is False
    assert router_logits_wanted(model, {"output_router_logits": True}) is True
    model.config.output_router_logits = True
    assert router_logits_wanted(model, {"output_router_logits": None}) is True
    assert router_logits_wanted(model, {"output_router_logits": False}) is False


@pytest.mark.parametrize("asked", [False, True])
def test_fused_head_adds_the_auxiliary_loss_only_when_asked(asked, device):
    stock = tiny_model("mixtral", seed=8, output_router_logits=False, num_hidden_layers=1).to(device)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig())
    batch = make_batch(1000, seq=13, seed=9, device=device)
    batch["attention_mask"][0, :3] = 0  # padding is excluded from the balance statistics, as stock does
    stock.train(), fast.train()
    a, b = fast(**batch, output_router_logits=asked), stock(**batch, output_router_logits=asked)
    assert rel_err(a.loss, b.loss) <= 1e-6
    assert (a.aux_loss is None) == (b.aux_loss is None) == (not asked)
    if asked:
        assert rel_err(a.aux_loss, b.aux_loss) <= 1e-6
        assert len(a.router_logits) == 1 and rel_err(a.router_logits[0], b.router_logits[0]) <= 1e-6


def test_no_recorded_router_logits_raise_naming_the_option():
    """transformers 5.17's Granite-MoE records no router logits: a clear error, not a crash on an int."""
    import torch
    from transformers.modeling_outputs import MoeModelOutputWithPast

    model = tiny_model("mixtral", output_router_logits=True)
    for logits in (None, ()):
        with pytest.raises(ValueError, match="output_router_logits"):
            add_router_aux(model, torch.tensor(1.0), MoeModelOutputWithPast(router_logits=logits), None)
