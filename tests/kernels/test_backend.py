"""Where an op runs: Triton for CUDA tensors or CPU tensors under the interpreter, else the reference;
and the argument checks every kernel shares."""

import pytest
import torch

from fasttune.kernels import _backend


def test_cpu_tensors_take_triton_only_under_the_interpreter(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _backend.interpreter_on() and _backend.use_triton(x, None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _backend.interpreter_on() and not _backend.use_triton(x)
    monkeypatch.setattr(_backend, "triton_importable", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _backend.use_triton(x)  # no Triton at all: the reference, whatever the variable says


def test_checks_name_the_argument():
    _backend.check_float("x", torch.zeros(1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="weight must be one of float32, float16, bfloat16, got float64"):
        _backend.check_float("weight", torch.zeros(1, dtype=torch.float64))
    _backend.check_same_device(a=torch.zeros(1), b=None)
    with pytest.raises(ValueError, match="a on cpu, b on meta"):
        _backend.check_same_device(a=torch.zeros(1), b=torch.zeros(1, device="meta"))


@pytest.mark.gpu
def test_cuda_tensors_take_triton():
    assert _backend.use_triton(torch.zeros(1, device="cuda"))
    assert not _backend.use_triton(torch.zeros(1, device="cuda"), torch.zeros(1))  # mixed devices: reference
