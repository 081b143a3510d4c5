"""What transformers records *inside* a decoder layer (router logits, attention weights), for a layer
run without autograd (``no_grad_forward.py``).

transformers 5 gathers such outputs through forward hooks that append to a per-forward collector
(``transformers.utils.output_capturing._active_collector``): the router's logits for the auxiliary
loss, for one. A layer whose forward runs without autograd would hand the loss tensors without a
gradient. ``LayerRecords`` notes what the layer call appended, so that those tensors can leave the
call as outputs of its autograd Function (their gradient flows back through the recompute), and
records them again, into a fresh collector, while the layer is recomputed.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

_NOT_RECORDS = "_hidden_states_layers"  # the collector's selection of hidden states, not a record


def _collector_var():
    try:
        module = importlib.import_module("transformers.utils.output_capturing")
    except ImportError:
        return None
    return getattr(module, "_active_collector", None)


class LayerRecords:
    """A snapshot of the active collector's lengths, taken before a layer call."""

    def __init__(self):
        self.var = _collector_var()
        collected = self.var.get() if self.var is not None else None
        self.collected = collected if isinstance(collected, dict) else {}
        self.start = {k: len(v) for k, v in self.collected.items() if k != _NOT_RECORDS and isinstance(v, list)}

    def new_slots(self) -> list[tuple[str, int]]:
        """(key, position since the snapshot) of each tensor the call appended."""
        return [(k, i - n) for k, n in self.start.items() for i in range(n, len(self.collected[k]))
                if isinstance(self.collected[k][i], torch.Tensor)]

    def get(self, slots) -> list[torch.Tensor]:
        return [self.collected[k][self.start[k] + i] for k, i in slots]

    def replace(self, slots, tensors) -> None:
        for (k, i), t in zip(slots, tensors):
            self.collected[k][self.start[k] + i] = t

    @contextlib.contextmanager
    def recording(self, keys):
        """A fresh collector for ``keys`` while a layer is recomputed (yields it; nothing when empty)."""
        if not keys or self.var is None:
            yield {}
            return
        fresh = {k: [] for k in keys}
        token = self.var.set(fresh)
        try:
            yield fresh
        finally:
            self.var.reset(token)


__all__ = ["LayerRecords"]
