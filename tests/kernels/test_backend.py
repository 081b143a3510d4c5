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


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The launchers' grid helpers compute what Triton's compute (Triton's are constexpr-function
    objects whose every call costs microseconds of host time)."""
    import triton

    values = list(range(0, 5000)) + [2**k + d for k in range(12, 40) for d in (-1, 0, 1)]
    for n in values:
        assert _backend.next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128, 1000):
            assert _backend.cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_launchers_use_the_host_helpers():
    """No launcher calls ``triton.cdiv`` / ``triton.next_power_of_2`` on the host (``_backend``'s instead)."""
    import ast
    from pathlib import Path

    slow = {"cdiv", "next_power_of_2"}
    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "fasttune" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in slow
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "triton"):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
