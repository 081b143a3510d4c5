"""Host time per call of the building blocks a training step launches, on the GPU's host.

A step whose GPU waits for the host (RESULTS.md: the FP8 step) is bound by these costs times the number of
calls per layer; they differ from machine to machine with the host CPU. Each row times ``--calls`` calls
on tiny tensors (the GPU finishes each kernel before the next launch is ready), host time only.
`python3 benchmarks/bench_host_costs.py [--calls 3000]`
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.jit
def _add_one_8_kernel(x_ptr, n, a1, a2, a3, a4, a5, a6, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1 + a1 + a2 + a3 + a4 + a5 + a6, mask=i < n)


@triton.jit
def _add_one_16_kernel(x_ptr, y_ptr, z_ptr, w_ptr, n, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
                       BLOCK: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n) + tl.load(y_ptr + i, mask=i < n) + tl.load(z_ptr + i, mask=i < n)
    v += a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11
    tl.store(w_ptr + i, v, mask=i < n)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def per_call_us(fn, calls: int) -> float:
    """Host µs per call of ``fn`` (warmed up; the GPU is synchronised before and after, not between)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args(argv)
    from fasttune.kernels.rms_norm import rms_norm

    x = torch.zeros(1024, device="cuda")
    y, z, w4 = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    x32 = torch.randn(16, 4096, device="cuda")
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    xr = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    rows = {
        "torch add_ (1k elements)": lambda: x.add_(1),
        "Tensor.to bf16 (16x4096 fp32)": lambda: x32.to(torch.bfloat16),
        "torch.mm bf16 64x64x64": lambda: torch.mm(a, a),
        "torch.empty 1 MiB": lambda: torch.empty(1 << 19, device="cuda", dtype=torch.bfloat16),
        "Triton kernel[grid], 2 runtime args": lambda: _add_one_kernel[(1,)](x, 1024, BLOCK=1024),
        "Triton kernel[grid], 8 runtime args": lambda: _add_one_8_kernel[(1,)](x, 1024, 1, 2, 3, 4, 5, 6, BLOCK=1024),
        "Triton kernel[grid], 16 runtime args, 4 constexpr": lambda: _add_one_16_kernel[(1,)](
            x, y, z, w4, 1024, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, BLOCK=1024, F1=True, F2=False, F3=3),
        "autograd.Function.apply, identity, grad on": lambda: _Identity.apply(xr),
        "fasttune rms_norm forward, no grad (64x4096)": lambda: rms_norm(xr.detach(), w, 1e-5),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, fn in rows.items():
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} µs |", flush=True)


if __name__ == "__main__":
    main()
