"""One additive attention bias per forward for the stashed attention cores, instead of one per layer.

With a padding mask transformers hands sdpa a boolean [batch, 1, q, k] mask. Torch turns a boolean mask
into an additive one in the query's dtype (0 where attended, -inf elsewhere; padded to a multiple of 16
columns where it is not aligned for the memory-efficient kernel) on every call, and that kernel saves the
result for its backward. In a recomputed layer the saved bias dies with the layer's checkpoint; a stashed
core's stays on the GPU (it requires no grad, so the stash leaves it where it is) until the backward: 32 MiB
a layer at 4x2048, +1.26 GiB on the 8B step of session 48 (an H100). ``SharedMaskBias`` makes that bias
once per forward, already aligned, and hands every stashed core the same tensor: torch then uses it as it
is, and all the layers save one tensor. The values are torch's own conversion: the same attention, bit for
bit.
"""

from __future__ import annotations

import weakref

import torch

ALIGN = 16  # columns: the memory-efficient kernel's alignment for a bias's rows (torch pads to it otherwise)


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` (bool, True where attended) as torch's sdpa makes it additive: 0 and -inf in ``dtype``, its rows
    ``ALIGN``-aligned in memory (a view of the first columns of a wider tensor where the width is not)."""
    k = mask.shape[-1]
    width = -(-k // ALIGN) * ALIGN
    bias = torch.zeros(*mask.shape[:-1], width, dtype=dtype, device=mask.device)[..., :k]
    return bias.masked_fill_(mask.logical_not(), float("-inf"))


class SharedMaskBias:
    """The last boolean mask seen (weakly held) and its additive bias: a new forward's mask (a new tensor, or the
    same one written again) makes a new bias. The bias is held until then (the cores save aliases of it, not
    the tensor itself, so a weak reference would die after the first layer): one bias between steps."""

    def __init__(self):
        self._entry = None  # (mask ref, mask version, dtype, bias)
        self.made = 0  # biases made (tests count them)

    def get(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        entry = self._entry
        if entry is not None:
            mask_ref, version, cached_dtype, bias = entry
            if mask_ref() is mask and version == mask._version and cached_dtype == dtype:
                return bias
        self._entry = None  # the last forward's bias goes before the new one is made
        bias = additive_bias(mask, dtype)
        self._entry = (weakref.ref(mask), mask._version, dtype, bias)
        self.made += 1
        return bias


def sdpa_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype sdpa will see ``query`` in: autocast's where it is on (it casts sdpa's floating inputs, a bias
    too), else the query's own."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def shareable(mask, implementation: str, query: torch.Tensor) -> bool:
    """Is this a mask ``SharedMaskBias`` stands in for: boolean, 4-D, for transformers' sdpa, in training?"""
    return (implementation == "sdpa" and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and mask.dim() == 4 and query.requires_grad)


__all__ = ["ALIGN", "SharedMaskBias", "additive_bias", "sdpa_dtype", "shareable"]
