"""Attention with sinks (gpt-oss) through compiled flex attention, renormalised in float32.

gpt-oss adds one learned logit σ_h per head to every softmax's denominator (an attention sink).
transformers has no SDPA path for it, so a model loaded with its default attention runs eager
attention: the [B, H, S, S] scores, their concatenation with the sinks, a float32 softmax and
its backward, as separate passes over B·H·S² elements in the forward, the checkpoint recompute
and the backward. On 8 gpt-oss-20b layers at 4×2048 tokens that is most of a LoRA step.

A softmax with a sink is the softmax without it, scaled per row:

    Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{σ}) = o · e^{lse} / (e^{lse} + e^{σ}) = o · sigmoid(lse − σ)

where o and lse = log Σ_j e^{s_j} are what flex attention returns. The scale is computed in float32
from flex's float32 lse (transformers' own flex path rounds lse to the model's dtype first, which
at lse ≈ 8 in bf16 is a 3% error in e^{lse}). Gradients reach q, k, v through o and lse (flex
attention differentiates its lse since torch 2.9) and σ through the scale.

``use_flex_for_sinks`` switches a model instance running eager attention to "flex_attention"
(``PreTrainedModel.set_attn_implementation``: transformers then builds block masks, so the
sliding-window layers skip the blocks outside their window); ``FastAttentionForward`` calls
``sink_flex_attention`` for those layers. CUDA only: flex attention has no CPU backward.
"""

from __future__ import annotations

import torch

__all__ = ["renormalize_by_sinks", "sink_flex_attention", "flex_sinks_unavailable", "FLEX"]

FLEX = "flex_attention"


def renormalize_by_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """o · sigmoid(lse − σ) in float32, returned in ``out``'s dtype.

    Args:
        out: attention output without the sinks, [B, H, S, D].
        lse: its log-sum-exp per row, [B, H, S] (float32 from flex attention).
        sinks: one logit per head, [H].
    """
    scale = torch.sigmoid(lse.float() - sinks.float()[None, :, None])
    return (out.float() * scale[..., None]).to(out.dtype)


def flex_sinks_unavailable() -> str | None:
    """Why flex attention cannot be imported here, or None."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
        from transformers.integrations import flex_attention as hf_flex  # noqa: F401
    except ImportError as err:
        return f"flex attention does not import ({err})"
    return None


def sink_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None,
                        **kwargs):
    """An attention interface (transformers' signature): flex attention over ``attention_mask`` (a
    BlockMask), then the sinks ``s_aux`` [H] folded in by ``renormalize_by_sinks``.

    Returns (output [B, S, H, D], None), as transformers' attention functions do."""
    from transformers.integrations.flex_attention import (compile_friendly_flex_attention,
                                                          get_flex_attention_lse_kwargs)

    if dropout:
        raise ValueError(f"sink_flex_attention: flex attention has no attention dropout (dropout={dropout})")
    heads, kv_heads = query.shape[1], key.shape[1]
    # return_aux=AuxRequest(lse=True) since torch 2.9 (an object holding lse), return_lse=True before (lse itself)
    out, aux = compile_friendly_flex_attention(query, key, value, block_mask=attention_mask,
                                               enable_gqa=heads != kv_heads, scale=scaling,
                                               training=module.training, **get_flex_attention_lse_kwargs(True))
    lse = getattr(aux, "lse", aux)
    if s_aux is not None:
        out = renormalize_by_sinks(out, lse, s_aux)
    return out.transpose(1, 2).contiguous(), None
