"""dequantize_nf4 (Triton) against reference.dequantize_nf4 and bitsandbytes, bit for bit.

Two kinds of input: random packed codes and scales in a duck-typed QuantState (every byte and
scale value is a valid input, no bitsandbytes needed, runs on the GPU image too), and real
``bitsandbytes.functional.quantize_4bit`` outputs compared with ``dequantize_4bit`` and with
``matmul_4bit``'s forward and backward where the compute dtype is not the QuantState's (the
forward rounds the weight once, to the compute dtype; the backward via the QuantState's dtype).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from fasttune.kernels import nf4 as nf4_mod
from fasttune.kernels import reference
from fasttune.kernels.nf4 import dequantize_nf4

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((200, 96), (37, 64), (33, 5))  # 33·5 is odd: the last byte holds one value


def random_nf4(shape, dtype, blocksize, nested, device, seed=0):
    """Random packed NF4 codes and a duck-typed QuantState (scales ~ 1, nested or not)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    n_blocks = -(-n // blocksize)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, generator=g)
    state2, offset = None, None
    if nested:
        absmax = torch.randint(0, 256, (n_blocks,), dtype=torch.uint8, generator=g)
        code2 = torch.sort(torch.rand(256, generator=g) * 2 - 1).values
        absmax2 = torch.rand(-(-n_blocks // 256), generator=g) + 0.5
        state2 = SimpleNamespace(absmax=absmax2.to(device), code=code2.to(device), blocksize=256)
        offset = torch.tensor(0.7312, device=device)
    else:
        absmax = torch.rand(n_blocks, generator=g) * 2 + 0.05
    qs = SimpleNamespace(absmax=absmax.to(device), shape=torch.Size(shape), dtype=dtype, blocksize=blocksize,
                         quant_type="nf4", nested=nested, offset=offset, state2=state2)
    return packed.to(device), qs


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_on_random_codes(device, dtype, blocksize, nested):
    for i, shape in enumerate(SHAPES):
        packed, qs = random_nf4(shape, dtype, blocksize, nested, device, seed=i)
        out = dequantize_nf4(packed, qs)
        assert out.dtype == dtype and out.shape == shape
        assert torch.equal(out, reference.dequantize_nf4(packed, qs))


def test_reference_fallback_path(device, monkeypatch):
    packed, qs = random_nf4((37, 64), torch.bfloat16, 64, True, device)
    expected = dequantize_nf4(packed, qs)
    monkeypatch.setattr(nf4_mod, "use_triton", lambda *t: False)
    buf = torch.empty(37, 64, dtype=torch.float32, device=device)
    assert torch.equal(dequantize_nf4(packed, qs), expected)
    assert dequantize_nf4(packed, qs, out=buf) is buf and torch.equal(buf, expected.float())


def test_out_buffer_and_dtype_cast(device):
    packed, qs = random_nf4((200, 96), torch.float32, 64, True, device, seed=3)
    full = dequantize_nf4(packed, qs)
    buf = torch.full((200, 96), float("nan"), device=device)
    assert dequantize_nf4(packed, qs, out=buf) is buf and torch.equal(buf, full)
    # Another dtype: rounded to quant_state.dtype first, then cast (= dequantize_4bit(...).to(dtype)).
    for out_dtype in (torch.bfloat16, torch.float16):
        buf = torch.empty(200, 96, dtype=out_dtype, device=device)
        assert torch.equal(dequantize_nf4(packed, qs, out=buf), full.to(out_dtype))
    qs.dtype = torch.bfloat16
    as_bf16 = dequantize_nf4(packed, qs)
    buf = torch.empty(200, 96, dtype=torch.float32, device=device)
    assert torch.equal(dequantize_nf4(packed, qs, out=buf), as_bf16.float())


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("state_dtype", DTYPES)
def test_round_to_state_false_rounds_once_to_out_dtype(device, state_dtype, nested, monkeypatch):
    """round_to_state=False: the fp32 value (state dtype float32) rounded once to out's dtype,
    whatever the QuantState's dtype; Triton and the reference fallback alike."""
    for i, shape in enumerate(SHAPES):
        packed, qs = random_nf4(shape, state_dtype, 64, nested, device, seed=10 + i)
        exact = copy.copy(qs)
        exact.dtype = torch.float32
        want32 = reference.dequantize_nf4(packed, exact)
        for use in (True, False):
            monkeypatch.setattr(nf4_mod, "use_triton", lambda *t, _u=use: _u)
            for out_dtype in DTYPES:
                buf = torch.empty(shape, dtype=out_dtype, device=device)
                got = dequantize_nf4(packed, qs, out=buf, round_to_state=False)
                assert got is buf and torch.equal(got, want32.to(out_dtype)), (use, out_dtype)
            assert qs.dtype == state_dtype  # the caller's QuantState is left alone


@pytest.mark.parametrize("min_row_tile", [None, 2048, 256])
@pytest.mark.parametrize("round_to_state", [True, False])
@pytest.mark.parametrize("nested", [False, True])
def test_rows_apart_write_only_their_columns(device, nested, round_to_state, min_row_tile, monkeypatch):
    """out = the first columns of a wider buffer (lora_wide's bordered NF4 weights): the same bits as a
    contiguous out, the other columns untouched. Widths: 4,096 (a row tile of 2,048 values, each row
    two), 1,536 and 3,840 (row tiles of 512 and 256 where the narrowest row tile allows, else runs),
    96 and 48 (programs of runs of 32 and 16 values), 5 (not a multiple of 16: a contiguous copy);
    Triton and the reference fallback alike."""
    cases = (((3, 4096), 64), ((5, 1536), 64), ((2, 3840), 48), ((200, 96), 32), ((37, 48), 16), ((33, 5), 11))
    for i, (shape, extra) in enumerate(cases):
        packed, qs = random_nf4(shape, torch.bfloat16, 64, nested, device, seed=30 + i)
        for out_dtype in (torch.bfloat16, torch.float32):
            want = dequantize_nf4(packed, qs, out=torch.empty(shape, dtype=out_dtype, device=device),
                                  round_to_state=round_to_state)
            for use in (True, False):
                monkeypatch.setattr(nf4_mod, "use_triton", lambda *t, _u=use: _u)
                if min_row_tile is not None:
                    monkeypatch.setattr(nf4_mod, "_MIN_ROW_TILE", min_row_tile)
                buf = torch.full((shape[0], shape[1] + extra), float("nan"), dtype=out_dtype, device=device)
                got = dequantize_nf4(packed, qs, out=buf[:, : shape[1]], round_to_state=round_to_state)
                assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want), (shape, out_dtype, use)
                assert buf[:, shape[1]:].isnan().all(), (shape, out_dtype, use)
            monkeypatch.undo()
    # On CUDA only rows of whole row tiles count as fast (lora_widen borders those): by default
    # (nf4._MIN_ROW_TILE = 512) Llama-3.1-8B's 4,096 and 14,336 (tiles of 2,048) and Qwen2.5-7B's 3,584 and
    # 18,944 (512), not Gemma 3 12B's 3,840 (256); at 2,048 only Llama's, at 256 all of them.
    if min_row_tile is not None:
        monkeypatch.setattr(nf4_mod, "_MIN_ROW_TILE", min_row_tile)
    tiles = {4096: 2048, 14336: 2048, 3584: 512, 18944: 512, 3840: 256}
    for width, tile in tiles.items():
        fast = nf4_mod.fast_rows_apart(width, width + 64, "cuda")
        assert fast == (tile >= (min_row_tile or 512)), width
    assert not nf4_mod.fast_rows_apart(1152, 1216, "cuda") and not nf4_mod.fast_rows_apart(4096, 4100, "cuda")
    assert nf4_mod.fast_rows_apart(96, 128, "cpu")


def test_bad_inputs_raise(device):
    packed, qs = random_nf4((37, 64), torch.float16, 64, False, device)
    with pytest.raises(ValueError, match="shape"):
        dequantize_nf4(packed, qs, out=torch.empty(64, 37, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_nf4(packed, qs, out=torch.empty(64, 37, dtype=torch.float16, device=device).t())
    with pytest.raises(ValueError, match="contiguous"):  # rows apart, but not contiguous within a row
        dequantize_nf4(packed, qs, out=torch.empty(37, 128, dtype=torch.float16, device=device)[:, ::2])
    with pytest.raises(TypeError, match="out must be"):
        dequantize_nf4(packed, qs, out=torch.empty(37, 64, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="bytes"):
        dequantize_nf4(packed[:100], qs)
    with pytest.raises(TypeError, match="packed"):
        dequantize_nf4(packed.tolist(), qs)
    with pytest.raises(TypeError, match="absmax"):
        dequantize_nf4(packed, SimpleNamespace(shape=qs.shape, dtype=qs.dtype, blocksize=64))
    fp4 = copy.copy(qs)
    fp4.quant_type = "fp4"
    with pytest.raises(ValueError, match="nf4"):
        dequantize_nf4(packed, fp4)
    odd = copy.copy(qs)
    odd.blocksize = 48
    with pytest.raises(ValueError, match="power of two"):
        dequantize_nf4(packed, odd)


# --------------------------------------------------------------------------------------------
# Against bitsandbytes itself
# --------------------------------------------------------------------------------------------


def _bnb_dequantize(F, packed, qs):
    """bitsandbytes' dequantize_4bit. On CPU (0.50.2) its AVX-512 kernel mis-reads 2-D weights
    whose rows are a multiple of 16 wide but not of blocksize (e.g. 96 with blocksize 64); the 1-D
    call runs the same kernel over the flat layout that quantize_4bit writes and CUDA reads.
    Eager: its PyTorch fallback (odd widths) is torch.compile'd, seconds per new shape on CPU."""
    if packed.is_cuda:
        return F.dequantize_4bit(packed, qs)
    flat = copy.copy(qs)
    flat.shape = torch.Size([math.prod(qs.shape)])
    with torch.compiler.set_stance("force_eager"):
        return F.dequantize_4bit(packed, flat).reshape(qs.shape)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_bitsandbytes(device, dtype, blocksize, nested):
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(blocksize + nested)
    for shape in SHAPES:
        w = torch.randn(shape, dtype=dtype, device=device)
        packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
        ours = dequantize_nf4(packed, qs)
        assert torch.equal(ours, _bnb_dequantize(F, packed, qs))
        assert torch.equal(ours, reference.dequantize_nf4(packed, qs))


def _float64_math(packed, qs) -> torch.Tensor:
    """NF4_CODE[code] · absmax[block] in float64 (nested scales: code2[q] · absmax2 + offset)."""
    n = math.prod(qs.shape)
    data = packed.reshape(-1).view(torch.uint8).cpu().long()
    codes = torch.stack([data >> 4, data & 15], dim=1).reshape(-1)[:n]
    table = torch.tensor(reference.NF4_CODE, dtype=torch.float64)
    if qs.nested:
        s2 = qs.state2
        blocks = torch.arange(qs.absmax.numel())
        absmax = (s2.code.cpu().double()[qs.absmax.cpu().long()] * s2.absmax.cpu().double()[blocks // s2.blocksize]
                  + float(qs.offset))
    else:
        absmax = qs.absmax.cpu().double()
    return (table[codes] * absmax[torch.arange(n) // qs.blocksize]).reshape(qs.shape)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_3d_weights_match_bitsandbytes_and_float64(device, dtype, nested):
    """Stacked MoE expert weights ([E, out, in], quantised as one flat tensor, blocks crossing rows
    and experts; odd sizes whose last block is partial): bitsandbytes' dequantize_4bit bit for bit,
    and float64 math within one rounding to the weight's dtype (plus the fp32 roundings of the
    nested scale for double quant)."""
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(3 + nested)
    for shape in ((4, 64, 96), (3, 33, 5), (5, 48, 40)):
        w = torch.randn(shape, dtype=dtype, device=device)
        packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
        assert tuple(qs.shape) == shape
        ours = dequantize_nf4(packed, qs)
        assert ours.shape == shape and ours.dtype == dtype
        assert torch.equal(ours, _bnb_dequantize(F, packed, qs))
        ref64 = _float64_math(packed, qs)
        ulp = torch.finfo(dtype).eps * ref64.abs() + torch.finfo(dtype).tiny
        slack = 1.0 if not nested or dtype != torch.float32 else 4.0  # fp32 scale arithmetic under fp32 output
        assert ((ours.cpu().double() - ref64).abs() <= slack * ulp).all(), shape
        if not nested and dtype == torch.float32:  # one fp32 product, rounded once: the float64 value rounded
            assert torch.equal(ours.cpu(), ref64.float())


def test_bitsandbytes_roundtrip_and_storage(device):
    """Our reading of quantize_4bit's layout gives back the weight within NF4's error, and a
    non-uint8 quant_storage (FSDP QLoRA) reads the same bytes."""
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(1)
    w = torch.randn(200, 96, device=device)
    packed, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    out = dequantize_nf4(packed, qs)
    block_max = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    # Largest half-gap between neighbouring NF4 levels is (1 - 0.6962) / 2 < 0.153.
    assert ((out - w).reshape(-1, 64).abs() <= 0.153 * block_max + 1e-6).all()
    packed_bf16, qs_bf16 = F.quantize_4bit(w, blocksize=64, quant_type="nf4", quant_storage=torch.bfloat16)
    assert packed_bf16.dtype == torch.bfloat16
    assert torch.equal(dequantize_nf4(packed_bf16, qs_bf16), out)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("compute_dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", DTYPES)
def test_matches_bitsandbytes_matmul_4bit(device, state_dtype, compute_dtype, nested):
    """``matmul_4bit`` (bitsandbytes 0.50) with a compute dtype: forward y = A·dequant(W, compute
    dtype)ᵀ (its gemm_4bit, rounded once), backward dA = dY·dequantize_4bit(W).to(compute dtype)
    (rounded to the QuantState's dtype first). The two readings, fed to the same torch products,
    give bitwise its y and dA. 1,600 rows: past the CUDA fused-kernel limit (1,536), so CUDA too
    runs dequantise + F.linear; widths multiples of 64 (docs/FACTS.md, bitsandbytes on the CPU)."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(7 + nested)
    w = torch.randn(96, 128, dtype=state_dtype, device=device)
    packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
    a = torch.randn(1600, 128, dtype=compute_dtype, device=device, requires_grad=True)
    dy = torch.randn(1600, 96, dtype=compute_dtype, device=device)
    with torch.compiler.set_stance("force_eager"):  # see _bnb_dequantize
        y = bnb.matmul_4bit(a, packed, qs)
        y.backward(dy)
    w_fwd = dequantize_nf4(packed, qs, out=torch.empty(96, 128, dtype=compute_dtype, device=device),
                           round_to_state=False)
    w_bwd = dequantize_nf4(packed, qs, out=torch.empty(96, 128, dtype=compute_dtype, device=device))
    assert torch.equal(y, torch.nn.functional.linear(a.detach(), w_fwd))
    assert torch.equal(a.grad, torch.mm(dy, w_bwd))


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [False, True])
def test_llama8b_mlp_weight_on_gpu(nested):
    """A Llama-3-8B MLP weight (14336 × 4096), bf16, blocksize 64: bit-exact at full size."""
    packed, qs = random_nf4((14336, 4096), torch.bfloat16, 64, nested, "cuda", seed=5)
    out = dequantize_nf4(packed, qs)
    assert torch.equal(out, reference.dequantize_nf4(packed, qs))
    try:
        import bitsandbytes.functional as F
    except ImportError:
        return
    w = torch.randn(14336, 4096, dtype=torch.bfloat16, device="cuda")
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
    assert torch.equal(dequantize_nf4(packed, qs), F.dequantize_4bit(packed, qs))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 14336), (18944, 3584), (3840, 15360), (1000, 3840)])
def test_rows_apart_at_full_size_on_gpu(shape, monkeypatch):
    """Llama-3.1-8B down, Qwen2.5-7B gate, Gemma 3 12B down and a 3,840-wide weight (row tiles of 2,048,
    512 and 256 values) dequantised into an [out, in + 64] buffer: the contiguous bits, the tail untouched."""
    monkeypatch.setattr(nf4_mod, "_MIN_ROW_TILE", 256)
    packed, qs = random_nf4(shape, torch.bfloat16, 64, True, "cuda", seed=6)
    want = dequantize_nf4(packed, qs)
    buf = torch.full((shape[0], shape[1] + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert nf4_mod.fast_rows_apart(shape[1], shape[1] + 64, "cuda")
    got = dequantize_nf4(packed, qs, out=buf[:, : shape[1]])
    assert torch.equal(got, want) and buf[:, shape[1]:].isnan().all()
