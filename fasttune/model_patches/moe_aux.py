"""The router's auxiliary load-balancing loss of a mixture-of-experts model under the fused loss head.

Stock MoE causal LMs (Qwen3-MoE, Mixtral, OLMoE, Granite-MoE, gpt-oss) resolve
``output_router_logits`` (the call's argument, else the config's), pass it to the backbone (whose
hooks record each router's logits), and with labels add ``router_aux_loss_coef · aux`` to the
loss, ``aux`` from their modeling module's own ``load_balancing_loss_func``. The fused head
(``head.py``) does the same with the same function, so the auxiliary loss and its gradient into
the routers are the stock ones; none of these families has a router z-loss in transformers.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

AUX_FUNCTION = "load_balancing_loss_func"
_MODEL_ATTRS = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")

__all__ = ["MoeCausalLMOutputWithPast", "add_router_aux", "aux_loss_function", "router_logits_wanted"]


def aux_loss_function(module: nn.Module):
    """The family's ``load_balancing_loss_func`` when ``module`` is a causal LM that adds it, else None."""
    if not all(hasattr(module, attr) for attr in _MODEL_ATTRS):
        return None
    fn = getattr(sys.modules.get(type(module).__module__), AUX_FUNCTION, None)
    return fn if callable(fn) else None


def router_logits_wanted(module: nn.Module, kwargs: dict) -> bool | None:
    """None for a model without the auxiliary loss; else ``output_router_logits`` as stock resolves it."""
    if aux_loss_function(module) is None:
        return None
    value = kwargs.get("output_router_logits")
    if value is None:
        value = getattr(getattr(module, "config", None), "output_router_logits", False)
    return bool(value)


def add_router_aux(module: nn.Module, loss: torch.Tensor, outputs, attention_mask):
    """(loss + coef · aux, aux) from the backbone ``outputs``' router logits, as the stock forward adds it.

    Raises:
        ValueError: the backbone recorded no router logits (transformers 5.17's Granite-MoE records
            none, and its stock forward then fails on an int): the loss asked for cannot be computed.
    """
    logits = getattr(outputs, "router_logits", None)
    if not isinstance(logits, tuple) or not logits:
        import transformers

        raise ValueError(f"output_router_logits=True, but this transformers ({transformers.__version__}) records no "
                         f"router logits for {type(module).__name__}, so its auxiliary loss cannot be added; pass "
                         "output_router_logits=False or use a transformers version that records them")
    aux = aux_loss_function(module)(logits, module.num_experts, module.num_experts_per_tok, attention_mask)
    return loss + module.router_aux_loss_coef * aux.to(loss.device), aux
