"""Test set-up shared by every test.

- No GPU: Triton runs in its interpreter on CPU tensors. TRITON_INTERPRET must be set before any
  module holding @triton.jit kernels is imported, hence here, at the top.
- The interpreter feeds raw bf16 bits to np.matmul (docs/FACTS.md, Triton interpreter): upcast bf16 operands of tl.dot.
- No test may reach the Hub.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _patch_interpreter_bf16_dot() -> None:
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "_fasttune_bf16", False):
        return

    def as_f32(h):
        if str(h.dtype.scalar) == "bf16":  # stored as uint16 raw bits
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, interpreter.tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, as_f32(a), as_f32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._fasttune_bf16 = True
    interpreter.InterpreterBuilder.create_dot = create_dot


if not HAS_CUDA:
    _patch_interpreter_bf16_dot()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """The device kernel tests run on: CUDA where present, else CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms for one test (bitwise comparisons on CUDA), then as before."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(old)


# Every buffer a kernel reads must have been written: the kernel and patched-model tests run with
# freed memory poisoned and every uninitialised allocation filled with NaN (helpers/poison.py).
_POISONED_DIRS = ("kernels", "model_patches")


@pytest.fixture(autouse=True)
def _poisoned_memory(request):
    parts = request.node.path.parts
    if "tests" not in parts or parts[parts.index("tests") + 1] not in _POISONED_DIRS \
            or request.node.get_closest_marker("unpoisoned"):
        yield None
        return
    from helpers.poison import poisoned

    with poisoned("cuda" if HAS_CUDA else "cpu") as mode:
        yield mode
