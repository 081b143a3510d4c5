"""NF4 weights dequantised by a checkpointed layer's recompute, kept for that layer's backward.

A checkpointed QLoRA layer dequantises each NF4 weight three times a step: in the forward, in the
recompute (all but the MLP's down projection, whose output the recompute throws away) and in the
backward (dX = dY W). The recompute runs right before the same layer's backward, so the weights it
dequantises can serve the backward instead of being dequantised again: 6 of a Llama layer's 20
dequantisations a step, for one layer's weights held from its recompute to its backward.

The caller (``model_patches.checkpointing``) gives each checkpointed layer call a ``KeptWeights``
and enters it with ``keeping(kept, recording)``: recording in the recompute, not in the forward.
A fused LoRA Function stores ``current()`` on its ctx in forward; in a recording pass (and only
when its input needs a gradient, so that a backward will take them) it dequantises each NF4
weight into a buffer of its own and ``put``s it; its backward ``take``s it instead of
dequantising. Taking removes it: a kept weight lives until its one use.

Bitwise: the forward product reads the weight rounded straight to the compute dtype, dX reads it
rounded to the QuantState's dtype first (bitsandbytes' two paths, ``nf4.py``). The two are the
same values when the compute dtype is the QuantState's, the usual bf16 QLoRA; only then is a
weight kept (``keeps``), else the backward dequantises as before.
"""

from __future__ import annotations

import contextvars

import torch

_CURRENT = contextvars.ContextVar("fasttune_kept_weights", default=None)


class KeptWeights:
    """One checkpointed layer call's dequantised NF4 weights, from its recompute to its backward."""

    __slots__ = ("_weights", "recording")

    def __init__(self):
        self._weights: dict[tuple, torch.Tensor] = {}
        self.recording = False  # True while the layer is recomputed

    @staticmethod
    def _key(base, dtype: torch.dtype) -> tuple:
        # The module's QuantState and the packed codes' memory name the weight in both passes (a BaseWeight
        # may be made anew per call); the dtype is the one it was dequantised to.
        packed = base.weight
        return id(base.quant_state), packed.device, packed.data_ptr(), tuple(packed.shape), dtype

    def put(self, base, weight: torch.Tensor) -> None:
        """Keep ``weight``, NF4 ``base`` (a ``lora.BaseWeight``) dequantised: [out, in], or the widened
        [out, in + R] buffer whose first ``in`` columns hold it (``lora_wide.BorderedNf4``)."""
        self._weights[self._key(base, weight.dtype)] = weight

    def take(self, base, dtype: torch.dtype, whole: bool = False) -> torch.Tensor | None:
        """``base`` dequantised to ``dtype`` by the recompute, or None; removed. A widened buffer comes
        back whole with ``whole``, else as its [out, in] weight columns."""
        w = self._weights.pop(self._key(base, dtype), None)
        return w if w is None or whole or w.shape[-1] == base.shape[1] else w[:, : base.shape[1]]

    def clear(self) -> None:
        self._weights.clear()

    def __len__(self) -> int:
        return len(self._weights)


def current() -> KeptWeights | None:
    """The ``KeptWeights`` of the checkpointed layer call running now (forward or recompute), or None."""
    return _CURRENT.get()


def keeping(kept: KeptWeights | None, recording: bool) -> contextvars.Token:
    """Enter a pass of a layer call: ``recording`` in its recompute (a new recompute starts empty: what an
    earlier one kept and no backward took is dropped). Undo with ``_CURRENT.reset(token)`` (``stop``)."""
    if kept is not None:
        kept.recording = recording
        if recording:
            kept.clear()
    return _CURRENT.set(kept)


def stop(token: contextvars.Token) -> None:
    kept = _CURRENT.get()
    if kept is not None:
        kept.recording = False
    _CURRENT.reset(token)


def keeps(base, dtype: torch.dtype) -> bool:
    """May ``base`` (a ``lora.BaseWeight``) dequantised to ``dtype`` serve dX as it is? (module docstring)"""
    return base.is_nf4 and base.quant_state.dtype == dtype


def recording_for(ctx) -> KeptWeights | None:
    """The ``KeptWeights`` a fused Function's forward should put its NF4 weights into: the current one
    while recording, when the Function's input needs a gradient (its backward then computes dX)."""
    kept = _CURRENT.get()
    if kept is None or not kept.recording or not ctx.needs_input_grad[0]:
        return None
    return kept


__all__ = ["KeptWeights", "current", "keeping", "keeps", "recording_for", "stop"]
