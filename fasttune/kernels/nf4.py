"""NF4 dequantisation of bitsandbytes 4-bit weights (``Params4bit`` data + its ``QuantState``).

Forward, for element i of the flattened weight (n = prod(shape) values, two 4-bit codes per byte,
high nibble first):

    W[i] = round_to(state.dtype, NF4_CODE[c_i] · absmax[i // blocksize])

and with double quantisation (``state.nested``) the per-block scale is itself 8-bit:

    absmax[b] = state2.code[q_b] · state2.absmax[b // state2.blocksize] + state.offset

Both products and the sum are single fp32 operations in that order (the kernel is compiled
without FMA contraction), and the result is rounded once, to nearest even, to ``state.dtype``:
exactly what ``bitsandbytes.functional.dequantize_4bit`` computes on CUDA and in its PyTorch
path. An ``out`` buffer of another dtype can take either of bitsandbytes' two readings of a
weight whose compute dtype differs from ``state.dtype`` (bitsandbytes 0.50, ``matmul_4bit``):

- ``round_to_state=True`` (default): that rounded value cast again, i.e.
  ``dequantize_4bit(...).to(out.dtype)``, what its backward multiplies the output gradient by;
- ``round_to_state=False``: the fp32 value rounded once, straight to ``out.dtype``, what its
  forward (``gemm_4bit``: dequantise to the input's dtype, then a plain product) multiplies by.
  With a float32 compute dtype over a bfloat16 QuantState (the usual QLoRA load) that is the
  exact fp32 weight, not a bf16-rounded one.

No gradient: the weights are frozen.

Limits: quant_type "nf4" only; blocksize and state2.blocksize powers of two (bitsandbytes uses
32 … 4096 and 256); output fp32/fp16/bf16. The QuantState is duck-typed (no bitsandbytes import).
The packed tensor may have any shape or storage dtype (``quant_storage``); its bytes are read in
order. Unlike bitsandbytes' legacy shim, a packed tensor of shape [1, n/2] is not transposed back.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import triton
import triton.language as tl

from . import reference
from ._backend import cdiv, check_same_device, use_triton

__all__ = ["dequantize_nf4", "fast_rows_apart"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_VALUES_PER_PROGRAM = 2048  # ~5 KB of traffic per program in bf16
# The narrowest row tile (ROW_TILE) CUDA takes. On an H100 (benchmarks/bench_nf4.py, RESULTS.md) tiles of
# 1,024 store at the contiguous rate, 512 (Qwen2.5's 3,584 and 18,944) at 1.21x, 256 (Gemma 3's 3,840) at
# 2.31x, slower than runs. At 512 the Qwen2.5-7B NF4 step gains from the bordered groups (630 against 640 ms,
# RESULTS.md session 44); 256 is not taken.
_MIN_ROW_TILE = 512


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """fp32 → DTYPE rounding to nearest even. The interpreter truncates bf16 casts, so bf16 is
    rounded by hand (same bits as the GPU's cvt.rn for finite values)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _nf4_dequant_kernel(
    packed_ptr,  # packed codes [(n + 1) // 2], uint8, two 4-bit codes per byte (high nibble first)
    table_ptr,  # the 16 NF4 code values [16], fp32
    absmax_ptr,  # per-block scales [n / BLOCKSIZE]: floating point, or uint8 codes when NESTED
    code2_ptr,  # the second-level code book [256], fp32 (NESTED only)
    absmax2_ptr,  # second-level scales [blocks / BLOCKSIZE2], fp32 (NESTED only)
    offset_ptr,  # the nested scales' offset [1], fp32 (NESTED only)
    out_ptr,  # out: the weight [n], contiguous, or [n / in_f, in_f] rows `pitch` apart (PITCHED); OUT_DTYPE
    n, in_f, pitch,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    STATE_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, VALUES: tl.constexpr, PITCHED: tl.constexpr,
    RUN: tl.constexpr, ROW_TILE: tl.constexpr,
):
    # A program owns VALUES consecutive output values, one per lane of a flat tile: each thread's
    # values are contiguous, so its stores are 16-byte vectors. The byte and scale loads repeat
    # (two values per byte, BLOCKSIZE per scale) and hit L1. On an H100 this ran an 8B MLP weight
    # at 2.4 TB/s; a [bytes, 2] tile, whose threads store 4-byte pairs, at 1.8.
    start = tl.program_id(0).to(tl.int64) * VALUES
    # Rows apart (PITCHED): with in_f a multiple of VALUES the tile lies in one row, whose start is one
    # scalar (ROW_TILE; VALUES is then the largest power of two up to 2,048 dividing in_f, at least
    # _MIN_ROW_TILE): the same 16-byte stores as the contiguous case (an 8B MLP weight in
    # 66 µs on an H100, as contiguous). Else the tile as runs of RUN values (RUN divides in_f: a run lies
    # in one row), which stored at about half that rate on the same GPU ([1, 2,048]: 118 µs): for widths
    # with no row tile.
    if PITCHED and not ROW_TILE:
        run0 = start + tl.arange(0, VALUES // RUN)[:, None] * RUN
        idx = run0 + tl.arange(0, RUN)[None, :]
    else:
        idx = start + tl.arange(0, VALUES)
    in_range = idx < n
    byte = tl.load(packed_ptr + idx // 2, mask=in_range, other=0).to(tl.int32)
    nib = (byte >> ((1 - (idx & 1).to(tl.int32)) * 4)) & 15
    val = tl.load(table_ptr + nib)
    blk = idx // BLOCKSIZE
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=in_range, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q, mask=in_range, other=0.0)
        scale = scale * tl.load(absmax2_ptr + blk // BLOCKSIZE2, mask=in_range, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + blk, mask=in_range, other=0.0).to(tl.float32)
    w = cast_rne(val * scale, STATE_DTYPE)
    if OUT_DTYPE != STATE_DTYPE:
        w = cast_rne(w.to(tl.float32), OUT_DTYPE)
    if PITCHED and ROW_TILE:
        row = start // in_f
        dst = tl.multiple_of(row * pitch + (start - row * in_f), 16) + tl.arange(0, VALUES)
    elif PITCHED:
        row = run0 // in_f
        dst = row * pitch + (run0 - row * in_f) + tl.arange(0, RUN)[None, :]
    else:
        dst = idx
    tl.store(out_ptr + dst, w, mask=in_range)


@functools.lru_cache(maxsize=None)
def _nf4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(reference.NF4_CODE, dtype=torch.float32, device=device)


def _is_pow2(v) -> bool:
    return isinstance(v, int) and v > 0 and (v & (v - 1)) == 0


def _check_state(packed: torch.Tensor, qs) -> int:
    """Validate the duck-typed QuantState against ``packed``; returns n = prod(shape)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    for attr in ("absmax", "shape", "dtype", "blocksize"):
        if not hasattr(qs, attr):
            raise TypeError(f"quant_state has no {attr!r}: expected a bitsandbytes QuantState")
    if getattr(qs, "quant_type", "nf4") != "nf4":
        raise ValueError(f"quant_state.quant_type must be 'nf4', got {qs.quant_type!r}")
    if qs.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quant_state.dtype must be float32, float16 or bfloat16, got {qs.dtype}")
    if not _is_pow2(qs.blocksize) or qs.blocksize < 2:
        raise ValueError(f"quant_state.blocksize must be a power of two >= 2, got {qs.blocksize}")
    n = math.prod(qs.shape)
    n_bytes = packed.numel() * packed.element_size()
    if n_bytes < (n + 1) // 2:
        raise ValueError(f"packed holds {n_bytes} bytes, quant_state.shape {tuple(qs.shape)} needs {(n + 1) // 2}")
    n_blocks = -(-n // qs.blocksize)
    if qs.absmax.numel() < n_blocks:
        raise ValueError(f"quant_state.absmax has {qs.absmax.numel()} scales, {n_blocks} blocks need one each")
    if getattr(qs, "nested", False):
        s2 = getattr(qs, "state2", None)
        if s2 is None or qs.absmax.dtype != torch.uint8:
            raise ValueError("nested quant_state needs uint8 absmax codes and a state2")
        if not _is_pow2(s2.blocksize):
            raise ValueError(f"quant_state.state2.blocksize must be a power of two, got {s2.blocksize}")
        if s2.code.numel() < 256 or s2.absmax.numel() < -(-n_blocks // s2.blocksize):
            raise ValueError("quant_state.state2 has too few code entries or scales")
    elif not qs.absmax.is_floating_point():
        raise TypeError(f"quant_state.absmax must be floating point when not nested, got {qs.absmax.dtype}")
    return n


def _check_out(out: torch.Tensor, qs, packed: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(qs.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, quant_state.shape is {tuple(qs.shape)}")
    if out.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out must be float32, float16 or bfloat16, got {out.dtype}")
    if not (out.is_contiguous() or _pitch(out) is not None):
        raise ValueError("out must be contiguous, or rows of contiguous values further apart (a column slice)")
    check_same_device(packed=packed, out=out)


def _pitch(out: torch.Tensor) -> int | None:
    """The row stride of a 2-D ``out`` whose rows are contiguous but further apart than their length
    (the first columns of a wider buffer, ``lora_wide.py``'s bordered NF4 weights), else None."""
    if out.dim() != 2 or out.stride(1) != 1 or out.stride(0) <= out.shape[1]:
        return None
    return out.stride(0)


def _as_bytes(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1)  # a view for Params4bit data ([n/2, 1] or its .t())
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _launch(packed: torch.Tensor, qs, out: torch.Tensor, n: int, round_to_state: bool) -> torch.Tensor:
    device = packed.device
    data = _as_bytes(packed)
    nested = bool(getattr(qs, "nested", False))
    absmax = qs.absmax.reshape(-1)
    if nested:
        s2 = qs.state2
        code2 = s2.code.reshape(-1).to(device=device, dtype=torch.float32)
        absmax2 = s2.absmax.reshape(-1).to(device=device, dtype=torch.float32)
        offset = qs.offset
        if isinstance(offset, torch.Tensor):
            offset = offset.reshape(1).to(device=device, dtype=torch.float32)
        else:
            offset = torch.full((1,), float(offset), dtype=torch.float32, device=device)
        blocksize2 = s2.blocksize
    else:
        code2 = absmax2 = offset = absmax  # unused pointers
        blocksize2 = 1
    pitch = _pitch(out) if not out.is_contiguous() else None
    in_f = out.shape[-1]
    # Rows apart: a program's values come in runs that each lie in one row, the largest power of two up
    # to 2,048 that divides a row (one run of 2,048 for 4,096- and 14,336-wide rows).
    run = _VALUES_PER_PROGRAM if pitch is None else min(_VALUES_PER_PROGRAM, in_f & -in_f)
    row_tile = pitch is not None and _row_tile(in_f, pitch)
    # A row tile is one run: tl.multiple_of(row start, 16) holds, as start and in_f are multiples of the
    # run (≥ 16) and pitch of 16. One warp per 512 values: 16 per thread (16-byte bf16 stores), as 2,048 on 4.
    values = run if row_tile else _VALUES_PER_PROGRAM
    grid = (cdiv(n, values),)
    # Not rounding to the state's dtype = rounding to out's: the kernel's second cast drops out.
    state_dtype = qs.dtype if round_to_state else out.dtype
    _nf4_dequant_kernel[grid](
        data, _nf4_table(device), absmax, code2, absmax2, offset, out,
        n, in_f, 0 if pitch is None else pitch,
        BLOCKSIZE=qs.blocksize, BLOCKSIZE2=blocksize2, NESTED=nested,
        STATE_DTYPE=_TL_DTYPE[state_dtype], OUT_DTYPE=_TL_DTYPE[out.dtype], VALUES=values,
        PITCHED=pitch is not None, RUN=run, ROW_TILE=row_tile,
        num_warps=max(1, values // 512), enable_fp_fusion=False,  # bitsandbytes multiplies then adds: no FMA
    )
    return out


def _row_tile(in_features: int, pitch: int) -> bool:
    """Rows ``pitch`` apart take one row tile per program (``ROW_TILE``)."""
    return min(_VALUES_PER_PROGRAM, in_features & -in_features) >= max(_MIN_ROW_TILE, 16) and pitch % 16 == 0


def fast_rows_apart(in_features: int, pitch: int, device: torch.device) -> bool:
    """Does a CUDA out whose rows are ``pitch`` apart store at the contiguous rate (``ROW_TILE`` in the
    kernel)? Always True off CUDA, where the rate does not matter."""
    return torch.device(device).type != "cuda" or _row_tile(in_features, pitch)


def dequantize_nf4(packed: torch.Tensor, quant_state, out: torch.Tensor | None = None, *,
                   round_to_state: bool = True) -> torch.Tensor:
    """Dequantise a bitsandbytes NF4 weight, bit-exact with ``bitsandbytes.functional.dequantize_4bit``.

    Args:
        packed: the packed codes (``Params4bit.data``: uint8 ``[n/2, 1]``, or another storage dtype).
        quant_state: its ``QuantState`` (``absmax``, ``shape``, ``dtype``, ``blocksize``,
            ``nested``, ``offset``, ``state2``); duck-typed.
        out: optional buffer of shape ``quant_state.shape`` to write into, so callers can reuse
            one buffer instead of keeping each full-precision weight: contiguous, or the first
            columns of a wider 2-D buffer (rows further apart). Its dtype may differ from
            ``quant_state.dtype`` (see ``round_to_state``).
        round_to_state: for an ``out`` of another dtype, round to ``quant_state.dtype`` first
            (``dequantize_4bit(...).to(out.dtype)``, bitsandbytes' backward); False rounds once,
            straight to ``out.dtype`` (bitsandbytes' ``gemm_4bit`` forward). Module docstring.

    Returns:
        ``out``, or a new tensor of ``quant_state.shape`` and ``quant_state.dtype``.
    """
    n = _check_state(packed, quant_state)
    check_same_device(packed=packed, absmax=quant_state.absmax)
    if out is None:
        out = torch.empty(tuple(quant_state.shape), dtype=quant_state.dtype, device=packed.device)  # all stored
    else:
        _check_out(out, quant_state, packed)
    if n == 0:
        return out
    if use_triton(packed, out):
        if out.is_contiguous() or out.shape[1] % 16 == 0:
            _launch(packed, quant_state, out, n, round_to_state)
        else:  # rows apart whose length is not a multiple of 16: through a contiguous copy
            out.copy_(_launch(packed, quant_state, torch.empty_like(out, memory_format=torch.contiguous_format),
                              n, round_to_state))
        return out
    if not round_to_state and out.dtype != quant_state.dtype:
        quant_state = copy.copy(quant_state)  # a shallow copy: the reference rounds to its dtype
        quant_state.dtype = out.dtype
    out.copy_(reference.dequantize_nf4(packed, quant_state))
    return out
