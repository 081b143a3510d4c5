"""Where an op runs: the Triton kernel or the plain-PyTorch reference.

Triton runs on CUDA tensors, and on CPU tensors when Triton's own interpreter is switched on
(``TRITON_INTERPRET=1``, read by Triton at import; CI tests every kernel that way). Anything else
takes ``kernels/reference.py``. Nothing here queries a device at import.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - platforms without triton
        return False
    return True


def interpreter_on() -> bool:
    """True when Triton's interpreter is on (Triton's variable, not one of ours)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every given tensor can be handed to a Triton kernel."""
    if not triton_importable():
        return False
    ts = [t for t in tensors if t is not None]
    if all(t.is_cuda for t in ts):
        return True
    return interpreter_on() and all(t.device.type == "cpu" for t in ts)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints, as ``triton.cdiv`` computes it for a grid. On the host the
    launchers call this, not Triton's: in Triton ≥ 3.5 ``triton.cdiv`` and ``triton.next_power_of_2``
    are constexpr-function objects whose call costs microseconds of host time (~2.7 µs, FACTS)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two ≥ n for n ≥ 1 (0 for 0), as ``triton.next_power_of_2``; see ``cdiv``."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the arguments when tensors live on different devices."""
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        detail = ", ".join(f"{k} on {v}" for k, v in devs.items())
        raise ValueError(f"all tensors must be on one device: {detail}")


def check_float(name: str, t: torch.Tensor, allowed=(torch.float32, torch.float16, torch.bfloat16)) -> None:
    """Raise TypeError when ``t`` is not one of the supported floating dtypes."""
    if t.dtype not in allowed:
        names = ", ".join(str(a).replace("torch.", "") for a in allowed)
        raise TypeError(f"{name} must be one of {names}, got {str(t.dtype).replace('torch.', '')}")
