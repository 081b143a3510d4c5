"""Triton kernels with hand-derived backward passes, each with a plain-PyTorch twin in
``reference.py``. Imports torch and triton only, never transformers.

One op per module, the public function named like its module, imported from the module::

    from fasttune.kernels.rms_norm import rms_norm
    from fasttune.kernels.cross_entropy import fused_linear_cross_entropy

(Nothing is re-exported here: a package attribute named like a submodule would flip between the
function and the module depending on import order.) Each public function runs the Triton kernel
for CUDA tensors (or CPU tensors under Triton's interpreter) and the reference otherwise. Importing
compiles nothing and touches no device.
"""
