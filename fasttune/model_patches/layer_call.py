"""One checkpointed decoder-layer call: its forward, then its recompute in backward.

``checkpointing.py`` hands ``checkpoint`` a ``ForwardThenRecompute`` per layer call. Its first call is
the forward, every later one a recompute, during which ``recomputing()`` is True (the recompute's
output is thrown away: the fused MLP skips its down projection, ``lora.py``). Both passes share the
call's ``layer_memo()`` (what the forward decided, reused by the recompute), its attention stash
(``attention_stash.py``), its ``KeptWeights``: NF4 weights the recompute dequantises, kept for
the same layer's backward (``kernels/kept_weights.py``), and (opt-in) its ``ForwardReuse``: the LoRA
products and casts the forward made, which the recompute takes back (``kernels/forward_reuse.py``).
"""

from __future__ import annotations

import contextvars

from ..kernels import forward_reuse, kept_weights
from ..kernels.forward_reuse import ForwardReuse
from ..kernels.kept_weights import KeptWeights
from .attention_stash import LayerStash

_RECOMPUTING = contextvars.ContextVar("fasttune_recomputing", default=False)
_LAYER_MEMO = contextvars.ContextVar("fasttune_layer_memo", default=None)


def recomputing() -> bool:
    """True while a checkpointed decoder layer is recomputed in backward (its output is discarded)."""
    return _RECOMPUTING.get()


def layer_memo() -> dict | None:
    """The memo of the checkpointed layer call running now, shared by its forward and its recompute
    (None outside one). What the forward decided from the module state (which projections take the
    fused path) is stored there and reused by the recompute: the recompute must compute what the
    forward computed, and deciding again would cost the host the same checks a second time."""
    return _LAYER_MEMO.get()


class ForwardThenRecompute:
    """The function handed to ``checkpoint``: its first call is the forward, every later call a
    recompute (run with ``recomputing()`` True). Both run with ``layer_memo()`` = this call's memo, and
    with ``kept``: the NF4 weights its recompute dequantises, for its backward (``kernels/kept_weights.py``),
    and ``reuse`` (``FastConfig.reuse_forward_lora``): what the forward's LoRA Functions made, for the
    recompute (``kernels/forward_reuse.py``)."""

    def __init__(self, stock, stash: LayerStash | None = None, kept: KeptWeights | None = None,
                 reuse: ForwardReuse | None = None):
        self.stock = stock
        self.calls = 0
        self.stash = stash  # the layer call's stash (attention_stash.py), if it has one
        self.memo: dict = {}
        self.kept = kept
        self.reuse = reuse

    def __call__(self, *args, **kwargs):
        self.calls += 1
        recompute = self.calls > 1
        stash_token = self.stash.begin(recompute) if self.stash is not None else None
        token = _RECOMPUTING.set(True) if recompute else None
        memo_token, kept_token = _LAYER_MEMO.set(self.memo), kept_weights.keeping(self.kept, recompute)
        reuse_token = forward_reuse.entering(self.reuse, recompute)
        try:
            return self.stock(*args, **kwargs)
        finally:
            forward_reuse.leaving(reuse_token)
            kept_weights.stop(kept_token)
            _LAYER_MEMO.reset(memo_token)
            if token is not None:
                _RECOMPUTING.reset(token)
            if stash_token is not None:
                LayerStash.end(stash_token)


__all__ = ["ForwardThenRecompute", "layer_memo", "recomputing"]
