"""Marks a forward whose backward runs at once, in the same scope: a checkpointed layer's recompute.

Autograd keeps what a Function saves until its node is freed, which is after its backward returns.
Where the backward follows the forward at once (``model_patches/no_grad_forward.py`` recomputes a
layer inside its backward and back-propagates through it there, eagerly or in a captured CUDA graph), a
Function may hand a large activation to its backward outside autograd's saved tensors and free it in
the backward right after its last read (``grouped_mlp.py``: the experts' gate/up activations, ~0.19 GiB
per Qwen3-30B-A3B layer at 8k tokens, freed before the input gradient's [rows, hidden] buffer is taken).

Anywhere else, saving goes through autograd as usual: a plain forward's backward comes after other
layers' forwards, and saved-tensor hooks (offloading, torch's checkpoint) must see what is saved.
"""

from __future__ import annotations

import contextlib
import contextvars

_FOLLOWS = contextvars.ContextVar("fasttune_backward_follows", default=False)


@contextlib.contextmanager
def backward_follows():
    """Within this block, forwards are recomputes whose backward runs right after, before anything else."""
    token = _FOLLOWS.set(True)
    try:
        yield
    finally:
        _FOLLOWS.reset(token)


def backward_follows_now() -> bool:
    """Inside ``backward_follows``?"""
    return _FOLLOWS.get()


__all__ = ["backward_follows", "backward_follows_now"]
