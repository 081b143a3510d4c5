"""Triton kernels with hand-derived backward passes, each with a plain-PyTorch twin in
``reference.py``. Imports torch and triton only, never transformers.

Public functions pick the Triton kernel for CUDA tensors (or CPU tensors under Triton's
interpreter) and the reference otherwise. Names resolve lazily so ``import fasttune.kernels``
compiles nothing and touches no device.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "fused_linear_cross_entropy": "cross_entropy",
    "cross_entropy": "cross_entropy",
    "fused_linear_logprobs": "logprobs",
    "rms_norm": "rms_norm",
    "rms_norm_add": "rms_norm",
    "apply_rope": "rope",
    "swiglu": "swiglu",
    "geglu": "swiglu",
    "dequantize_nf4": "nf4",
    "lora_linear": "lora",
    "lora_mlp": "lora",
    "lora_qkv": "lora",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fasttune.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fasttune.kernels.{module}"), name)


def __dir__():
    return sorted(list(globals()) + __all__)
