"""FP8 products with a frozen base weight: Y = X Wᵀ and dX = dY W, W stored as float8_e4m3fn.

An opt-in approximation (``FastConfig.base_dtype="fp8"``); the exact paths never come here.

Storage (``Fp8Weight``). W [out, in] ≈ diag(s_W) Q_W: e4m3 codes Q_W, one byte each, held in a
uint8 tensor (collectives, DDP and FSDP move plain bytes and never cast them), and one scale per
output row s_W [out] (float32). Every scale here is a power of two, the smallest 2^e with
max|row| ≤ 448·2^e (reference.py ``quantize_rows_fp8``): dividing by it and multiplying back is
exact, so the casts to e4m3 are the only roundings, and the Triton quantiser and the reference
agree bit for bit.

Forward. X [N, in] is quantised per row at every call (dynamic scales s_X):

    Y = diag(s_X) (Q_X Q_Wᵀ) diag(s_W)           fp32 accumulation, one rounding to x's dtype

Backward. dX = dY W = dY diag(s_W) Q_W. The weight's per-output-channel scale lies along the
reduction dimension of this product, so it cannot be applied to the result. It is folded into
dY instead: G = dY diag(s_W) (exact, s_W being powers of two), quantised per row (s_G), and

    dX = diag(s_G) (Q_G Q_W)

so the forward's codes and scales serve the backward too: 1 byte per weight in all. The cost:
cuBLAS's FP8 GEMM takes its second operand column-major only, so this product reads Q_W through a
transposed copy made per call and freed at once (out·in bytes, ``byte_transpose.py``: ~0.15 ms per
8B decoder layer at the H200's memory rate; torch's strided copy took ~1.2 ms). Rejected alternatives: a second, transposed FP8 copy with
per-input-channel scales (2 bytes per weight, bf16's memory) and a per-tensor scale for the
backward (every row at the largest row's range: rows of small weights lose bits).

Where the products run: ``torch._scaled_mm`` with row-wise scales on CUDA GPUs that have FP8
tensor cores (probed once per device: compute capability ≥ 8.9 and a working call), for bf16
activations and widths that are multiples of 16, with X and G quantised by one Triton pass
each (the forward product with Hopper's fast FP8 accumulation, as torchao's float8 training runs
it; dX without). Elsewhere (a CPU, an older GPU, fp32/fp16 activations) the same codes are
dequantised and multiplied in fp32 (reference.py ``fp8_scaled_product``): the same numbers up to
accumulation order and precision. ``product_path`` says which, and why. LoRA rank-r terms, norms, attention and the loss
never pass through here. ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` has this
form in torch 2.4 to 2.13 (older versions returned a tuple, handled).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import reference
from ._backend import cdiv, check_float, next_power_of_2, use_triton
from .byte_transpose import transpose_bytes

__all__ = ["FP8_MAX", "Fp8Weight", "quantize_rows", "forward_product", "grad_input_product", "product_path",
           "fp8_linear"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_BLOCK = 2048  # columns per loop iteration of the quantiser
_ONE_TILE = 16384  # rows up to this width are quantised from one read (8B widths: 4,096 and 14,336)


@triton.jit
def _e4m3_code(v):
    """The float8_e4m3fn bits (int32, 0..255) of fp32 v with |v| ≤ 448, rounded to nearest even.
    By hand, not a cast: Triton's interpreter mis-rounds fp32 → fp8 casts that carry into the next
    binade (31.2 → 16) and turns NaN into 384; the GPU's ``cvt.rn`` gives these same bits."""
    vb = v.to(tl.int32, bitcast=True)
    ab = vb & 0x7FFFFFFF
    a = ab.to(tl.float32, bitcast=True)
    a = tl.where(a != a, 0.0, a)  # NaN: its code is set below; keep it out of the integer cast
    # Normal (|v| ≥ 2^-6): round the fp32 bits to 3 mantissa bits (half to even), then rebias the
    # exponent from 127 to 7: the code is (exponent << 3 | mantissa) − 120·8.
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - 960
    # Subnormal: a multiple m of 2^-9 (m = 8 is 2^-6, whose normal code is also 8); adding 2^23
    # rounds a·512 to an integer, half to even.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(v != v, 0x7F, code)
    return code | ((vb < 0).to(tl.int32) << 7)


@triton.jit
def _quantize_rows_kernel(x_ptr,  # [N, K] rows to quantise, any float dtype, unit column stride
                          col_ptr,  # [K] float32 power-of-two column scales folded in first (HAS_COL)
                          q_ptr,  # [N, K] float8_e4m3fn codes out, written as their uint8 bits (unit column stride)
                          s_ptr,  # [N] float32 row scales out
                          n_rows, n_cols, stride_x, stride_q,
                          HAS_COL: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    # BLOCK_M rows per program: a pass for max|v| per row, a second pass to scale and encode. When
    # a row fits in one tile (ONE_TILE: BLOCK_N ≥ n_cols) it is read once and kept in registers;
    # else the second pass re-reads it, mostly from L2.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    offs = tl.arange(0, BLOCK_N)
    if ONE_TILE:
        mask = row_mask[:, None] & (offs < n_cols)[None, :]
        tile = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_COL:
            tile = tile * tl.load(col_ptr + offs, mask=offs < n_cols, other=0.0)[None, :]
        row_max = tl.max(tl.abs(tile), axis=1)
    else:
        amax = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            v = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_COL:
                v = v * tl.load(col_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
            amax = tl.maximum(amax, tl.abs(v))
        row_max = tl.max(amax, axis=1)
    bits = row_max.to(tl.int32, bitcast=True)
    # The smallest 2^e with amax ≤ 448·2^e (448 = 1.75·2^8), from amax's exponent and mantissa bits.
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    tl.store(s_ptr + rows, ((e + 127) << 23).to(tl.float32, bitcast=True), mask=row_mask)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    if ONE_TILE:
        mask = row_mask[:, None] & (offs < n_cols)[None, :]
        # |v·2^-e| ≤ 448 by construction: no clamp needed, and a NaN stays NaN.
        tl.store(q_ptr + rows[:, None] * stride_q + offs[None, :], _e4m3_code(tile * inv[:, None]).to(tl.uint8),
                 mask=mask)
    else:
        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            v = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_COL:
                v = v * tl.load(col_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
            tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], _e4m3_code(v * inv[:, None]).to(tl.uint8),
                     mask=mask)


@functools.lru_cache(maxsize=None)
def _gpu_fp8(index: int) -> str | None:
    """None when row-wise scaled ``torch._scaled_mm`` works on CUDA device ``index``, else why not.
    Probed once per device with a small product checked against the reference."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 tensor cores (8.9+)"
    dev = torch.device("cuda", index)
    g = torch.Generator(device=dev).manual_seed(0)
    a, sa = reference.quantize_rows_fp8(torch.randn(16, 32, device=dev, generator=g))
    b, sb = reference.quantize_rows_fp8(torch.randn(48, 32, device=dev, generator=g))
    try:
        got = _scaled_mm(a, sa, b.t(), sb)
    except (RuntimeError, TypeError) as err:
        return f"torch._scaled_mm with row-wise scales failed here: {str(err).splitlines()[0][:120]}"
    want = reference.fp8_scaled_product(a, sa, b.t(), sb, torch.float32)
    if not torch.allclose(got.float(), want, rtol=1e-2, atol=1e-3):
        return "torch._scaled_mm with row-wise scales gave wrong numbers here"
    return None


def _scaled_mm(a, a_scale, b, b_scale, fast_accum: bool = False):
    """bf16 diag(a_scale) (A B) diag(b_scale): A [M, K] row-major, B [K, N] column-major codes.

    ``fast_accum``: Hopper's faster FP8 accumulation (partial sums kept in the tensor cores'
    reduced precision longer); used for the forward as torchao's float8 training does, not for dX."""
    out = torch._scaled_mm(a, b, a_scale.view(-1, 1), b_scale.view(1, -1), out_dtype=torch.bfloat16,
                           use_fast_accum=fast_accum)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.4 returned (out, amax)


@functools.lru_cache(maxsize=64)
def _ones(n: int, device: torch.device) -> torch.Tensor:
    """A float32 [n] of ones: the column scales of dX's product (one per width and device, kept)."""
    return torch.ones(n, dtype=torch.float32, device=device)


def _triton_quantises(x: torch.Tensor) -> bool:
    return use_triton(x) and (not x.is_cuda or _gpu_fp8(x.device.index or 0) is None)


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] float8_e4m3fn, scales [N] float32) of x [N, K] (times ``col_scale`` [K] per
    column first), per row with power-of-two scales; the Triton pass where it runs, else the
    reference (the same bits)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, columns], got {x.dim()}-D")
    check_float("x", x)
    if col_scale is not None and (col_scale.dtype != torch.float32 or col_scale.shape != (x.shape[1],)):
        raise ValueError(f"col_scale must be a float32 tensor of shape [{x.shape[1]}]")
    if not _triton_quantises(x) or x.shape[0] == 0:
        return reference.quantize_rows_fp8(x, col_scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)  # every element stored
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    width = next_power_of_2(max(cols, 16))
    if width <= _ONE_TILE:  # the row block read once, kept in registers
        block_n, warps = width, min(16, max(4, width // 1024))  # ≤ 32 values a thread
        block_m = max(1, _BLOCK // block_n)
    else:
        block_n, warps = _BLOCK, 4
        block_m = 1
    _quantize_rows_kernel[(cdiv(rows, block_m),)](
        x, col_scale, codes.view(torch.uint8), scale, rows, cols, x.stride(0), codes.stride(0),
        HAS_COL=col_scale is not None, ONE_TILE=block_n >= cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return codes, scale


class Fp8Weight:
    """A frozen weight [out, in] as e4m3 codes (uint8 storage) and power-of-two row scales.

    Args:
        codes: uint8 (or float8_e4m3fn) [out, in], contiguous.
        scale: float32 [out], on the same device.
    """

    __slots__ = ("codes", "scale")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.dtype not in (torch.uint8,
                                                                                          torch.float8_e4m3fn):
            raise ValueError("codes must be a 2-D uint8 or float8_e4m3fn tensor [out, in]")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.shape != codes.shape[:1]:
            raise ValueError(f"scale must be a float32 tensor of shape [{codes.shape[0]}]")
        if codes.device != scale.device:
            raise ValueError(f"codes on {codes.device} but scale on {scale.device}")
        self.codes, self.scale = codes, scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        """FP8 codes and scales of a dense float weight [out, in] (computed in float32)."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError("weight must be a 2-D float tensor [out, in]")
        w = weight.detach()
        codes, scale = quantize_rows(w if w.dtype in (torch.float32, torch.float16, torch.bfloat16) else w.float())
        return cls(codes.view(torch.uint8), scale)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def fp8(self) -> torch.Tensor:
        """The codes as float8_e4m3fn (a view; made at each use, so a storage FSDP frees and
        re-gathers between forward and backward is read as it is then)."""
        return self.codes if self.codes.dtype == torch.float8_e4m3fn else self.codes.view(torch.float8_e4m3fn)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """diag(scale) codes in ``dtype`` (float32 math)."""
        return (self.fp8.float() * self.scale[:, None]).to(dtype)


def product_path(x: torch.Tensor, w: Fp8Weight, dtype: torch.dtype | None = None) -> str | None:
    """None when the products of x [..., in] (in ``dtype``, default x's) with w run on FP8 tensor
    cores (``torch._scaled_mm``), else why they run the dequantise-and-matmul reference."""
    dtype = dtype or x.dtype
    if not x.is_cuda:
        return f"no FP8 matrix product on {x.device.type}: dequantise-and-matmul reference"
    if dtype != torch.bfloat16:
        return f"{str(dtype).replace('torch.', '')} activations (row-wise FP8 products return bf16): reference"
    out_f, in_f = w.shape
    if out_f % 16 or in_f % 16:
        return f"widths {out_f}x{in_f} are not multiples of 16: reference"
    why = _gpu_fp8(x.device.index or 0)
    return None if why is None else why + ": reference"


def forward_product(x2: torch.Tensor, w: Fp8Weight, xq: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """X Wᵀ [N, out] in x2's dtype, X quantised per row (or ``xq`` = its ``quantize_rows``, shared by
    the projections of one input)."""
    q, s = quantize_rows(x2) if xq is None else xq
    if product_path(x2, w) is None:
        return _scaled_mm(q, s, w.fp8.t(), w.scale, fast_accum=True)
    return reference.fp8_scaled_product(q, s, w.fp8.t(), w.scale, x2.dtype)


def grad_input_product(dy: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """dY W [N, in] in dy's dtype: dY diag(s_W) quantised per row, times the codes (module docstring)."""
    q, s = quantize_rows(dy, col_scale=w.scale)
    if product_path(dy, w) is None:
        codes = w.fp8
        return _scaled_mm(q, s, transpose_bytes(codes).t(), _ones(codes.shape[1], codes.device))
    return reference.fp8_scaled_product(q, s, w.fp8, None, dy.dtype)


class Fp8LinearFunction(torch.autograd.Function):
    """y = x Wᵀ (+ b) through the FP8 products; gradient for x only (W and b are frozen)."""

    @staticmethod
    def forward(ctx, x, w: Fp8Weight, bias):
        x2 = x.reshape(-1, w.shape[1])
        y = forward_product(x2, w)
        if bias is not None:
            y.add_(bias.to(y.dtype))
        ctx.w = w
        # Not a view of an internal buffer: callers may modify the output in place.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], w.shape[0]))

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = ctx.w
        dx = grad_input_product(dy.reshape(-1, w.shape[0]), w)
        return torch.ops.aten._unsafe_view(dx, (*dy.shape[:-1], w.shape[1])), None, None


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A frozen linear layer ``x Wᵀ (+ bias)`` with W in FP8 (module docstring).

    Args:
        x: input [..., in], float32/float16/bfloat16 (the compute dtype).
        weight: the ``Fp8Weight``.
        bias: optional frozen bias [out] (added in x's dtype).

    Returns:
        [..., out] in x's dtype; the gradient flows to x only.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float("x", x)
    if not isinstance(weight, Fp8Weight):
        raise TypeError(f"weight must be an Fp8Weight, got {type(weight).__name__}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {weight.shape[1]}")
    if x.device != weight.codes.device:
        raise ValueError(f"x on {x.device} but the weight on {weight.codes.device}")
    if bias is not None and (bias.requires_grad or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be a frozen tensor of shape [{weight.shape[0]}]")
    return Fp8LinearFunction.apply(x, weight, bias)
