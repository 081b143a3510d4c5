"""The o_proj stash: an offloaded layer's attention output projection keeps its output on the host.

In an offloaded decoder layer (checkpointing "offload", and the offloaded layers of "auto") the
recompute in backward runs the layer again up to its last saved tensor. The down projection's
output only enters the residual sum, so the recompute skips it (``lora.py``); o_proj's output feeds
the norm before the MLP, so it has to be there, and recomputing it costs a [tokens, hidden] x
[hidden, hidden] product per layer (~0.4 ms of an 8B layer's ~20 ms at 8,192 tokens on an H100).
With ``FastConfig.o_proj_stash`` the fused LoRA o_proj (``lora.LoRAOHook``):

- forward: computes its output as usual and copies it to pinned host memory (64 MiB per layer at
  8,192 tokens of an 8B model) on the stashes' stream (``attention_stash.LayerStash.keep``), as far
  as the host link's budget in GPU time allows (``stash_link.py``; the first two training steps
  send nothing);
- recompute: runs ``lora_linear`` with that output (``known_output``): X Aᵀ and the casts are made
  and saved as in the forward, the product is not run, the forward's output comes back bit for
  bit. The copy back starts one layer ahead, when the layer above begins its recompute.

By default (``o_proj_stash=None``) only over dense bases: over NF4 ones the 8B QLoRA step on an H100 ran
slower with it (686 against 672 ms a step, its forward GPU time +25 ms: the forward is close to host-bound
there), so NF4 and FP8 bases take it only with ``o_proj_stash=True``. Outputs under the stashes' 1 MiB floor (``StashChain.min_bytes``) are recomputed: a copy would cost more
than the product. What o_proj saves still goes through the checkpoint (its input is the attention output, which the
recompute makes anyway), so gradients equal those of a run without checkpointing. Needs a recorded
forward: off where a layer's forward runs without autograd (``checkpoint_no_grad_forward``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .attention_stash import OUTPUT, current


def projection_output(compute: Callable[[], torch.Tensor], recompute: Callable[[torch.Tensor], torch.Tensor],
                      nbytes: int, device: torch.device, quantized: bool = False) -> torch.Tensor:
    """The output projection's output in an offloaded layer call with the o_proj stash on: ``compute()``
    (the forward, whose output then goes to the host when the budgets allow, or a call with nothing
    kept), or ``recompute(kept output)`` in the recompute of a forward that kept it. ``nbytes``: the
    output's size, for the budgets; ``device``: where it is computed; ``quantized``: an NF4 or FP8 base,
    kept only when the stash was asked for (``StashChain.quantized_outputs``)."""
    stash = current(OUTPUT)
    if stash is None or (quantized and not stash.chain.quantized_outputs):
        return compute()
    index = stash.calls.get(OUTPUT, 0)
    stash.calls[OUTPUT] = index + 1
    key = (OUTPUT, index)
    chain = stash.chain
    if stash.recompute:
        ref = stash.plan.get(key)
        if ref is None:
            return compute()
        chain.stats.outputs_reused += 1
        return recompute(ref.get())
    if (index > 0 or nbytes < chain.min_bytes or not chain.admit(nbytes)
            or (device.type == "cuda" and not (chain.link.measured and chain.link.admits(nbytes)))):
        stash.plan[key] = None  # a second call in one layer (the first is kept), small, or over a budget
        return compute()
    out = compute()
    ref = stash.keep(out, OUTPUT)
    stash.plan[key] = ref
    if ref is not None:
        chain.stats.outputs_kept += 1
    else:  # its memory could not be copied flat: nothing went, the link budget gets its charge back
        chain.settle(nbytes, 0, device)
    return out


__all__ = ["projection_output"]
