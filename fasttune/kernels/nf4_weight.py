"""A frozen weight of any shape held as NF4 codes (bitsandbytes' layout), dequantised on demand.

bitsandbytes' ``Linear4bit`` holds 2-D weights only; the stacked 3-D experts of transformers 5's
MoE layers (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) have no 4-bit home there. An
``NF4Weight`` takes the output of ``bitsandbytes.functional.quantize_4bit`` on such a tensor (the
flat tensor cut into blocks of ``blocksize`` values, one scale each, optionally double-quantised)
and keeps it as buffers of a small module, so ``model.to(device)``, ``copy.deepcopy`` and
``state_dict`` carry it. Every buffer is uint8 (the fp32 scales are stored as their bytes), so a
``model.to(torch.bfloat16)`` moves them but cannot round them.

``dequantize()`` gives the tensor ``bitsandbytes.functional.dequantize_4bit`` gives, bit for bit
(``nf4.dequantize_nf4``, Triton on CUDA / under the interpreter): the weight in the dtype it was
quantised from. The object answers ``shape``, ``dtype``, ``device`` and ``dim()`` like the tensor
it stands for, so shape checks (PEFT's LoRA on a parameter, the grouped expert path) read it as
one; it holds no gradient. Writing ``.data`` (PEFT's in-place merge) is refused: 4-bit codes cannot
take a LoRA delta without requantising, which would change the model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from .nf4 import dequantize_nf4

__all__ = ["NF4Weight"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their raw bytes (uint8), so dtype casts of the module leave them alone."""
    return t.detach().to(torch.float32).reshape(-1).contiguous().view(torch.uint8)


class NF4Weight(nn.Module):
    """One frozen weight in NF4 (module docstring).

    Attributes:
        shape: the dense weight's shape.
        dtype: the dense weight's dtype (what ``dequantize`` returns; bitsandbytes' ``QuantState.dtype``).
        blocksize: values per scale; ``blocksize2`` scales per second-level scale when ``nested``.
        nested: the scales are themselves 8-bit (bitsandbytes' ``compress_statistics``, double quant).
    """

    def __init__(self, packed: torch.Tensor, quant_state):
        super().__init__()
        if getattr(quant_state, "quant_type", "nf4") != "nf4":
            raise ValueError(f"quant_state.quant_type must be 'nf4', got {quant_state.quant_type!r}")
        if quant_state.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"quant_state.dtype must be float32, float16 or bfloat16, got {quant_state.dtype}")
        self.shape = torch.Size(quant_state.shape)
        self.dtype = quant_state.dtype
        self.blocksize = int(quant_state.blocksize)
        self.nested = bool(getattr(quant_state, "nested", False))
        n_bytes = (math.prod(self.shape) + 1) // 2
        data = packed.detach().reshape(-1)
        data = data if data.dtype == torch.uint8 else data.view(torch.uint8)
        if data.numel() < n_bytes:
            raise ValueError(f"packed holds {data.numel()} bytes, shape {tuple(self.shape)} needs {n_bytes}")
        self.register_buffer("packed", data[:n_bytes].clone())
        if self.nested:
            s2 = quant_state.state2
            offset = quant_state.offset
            offset = offset if isinstance(offset, torch.Tensor) else torch.tensor(float(offset))
            self.register_buffer("absmax", quant_state.absmax.detach().reshape(-1).to(torch.uint8).clone())
            self.register_buffer("code2", _bytes(s2.code))
            self.register_buffer("absmax2", _bytes(s2.absmax))
            self.register_buffer("offset", _bytes(offset.to(data.device)))
            self.blocksize2 = int(s2.blocksize)
        else:
            self.register_buffer("absmax", _bytes(quant_state.absmax))
            self.blocksize2 = 0

    # ---- reads like the dense tensor it stands for ------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def is_cuda(self) -> bool:
        return self.packed.is_cuda

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def requires_grad(self) -> bool:
        return False

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def data(self):
        raise RuntimeError(
            f"this {tuple(self.shape)} weight is held in NF4 (fasttune FastConfig.moe_experts_nf4): it cannot be "
            "read or merged into in place as a dense tensor. Export with fasttune.save_merged (it dequantises), or "
            "call fasttune.unpatch_model(model) first (it puts the dequantised weights back as dense parameters).")

    def bytes_held(self) -> int:
        """Bytes of the buffers holding this weight (the codes and every scale)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # ---- the weight ------------------------------------------------------------------------

    def quant_state(self) -> SimpleNamespace:
        """A duck-typed bitsandbytes ``QuantState`` over these buffers (for ``nf4.dequantize_nf4``)."""
        as_f32 = (lambda b: b.view(torch.float32))
        state2 = None
        if self.nested:
            state2 = SimpleNamespace(code=as_f32(self.code2), absmax=as_f32(self.absmax2), blocksize=self.blocksize2)
        absmax = self.absmax if self.nested else as_f32(self.absmax)
        return SimpleNamespace(absmax=absmax, shape=self.shape, dtype=self.dtype, blocksize=self.blocksize,
                               quant_type="nf4", nested=self.nested,
                               offset=as_f32(self.offset) if self.nested else None, state2=state2)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight, ``shape`` in ``dtype`` (into ``out`` when given); no autograd history."""
        with torch.no_grad():
            return dequantize_nf4(self.packed, self.quant_state(), out)

    def dequantize_experts(self, ids: torch.Tensor) -> torch.Tensor | None:
        """``dequantize()[ids]`` without the rest: the slices ``ids`` of the leading dimension
        (experts), when each slice starts on a scale block (and on a second-level block when
        nested); else None (the caller dequantises the whole weight). Same values, bit for bit."""
        E = self.shape[0]
        n_e = math.prod(self.shape[1:])
        per = n_e // self.blocksize
        if E == 0 or n_e % self.blocksize or (self.nested and per % self.blocksize2):
            return None
        qs = self.quant_state()
        state2 = None
        if self.nested:
            state2 = SimpleNamespace(code=qs.state2.code, blocksize=self.blocksize2,
                                     absmax=qs.state2.absmax.view(E, per // self.blocksize2)[ids].reshape(-1))
        state = SimpleNamespace(absmax=qs.absmax.view(E, per)[ids].reshape(-1), shape=torch.Size((ids.numel(),
                                *self.shape[1:])), dtype=self.dtype, blocksize=self.blocksize, quant_type="nf4",
                                nested=self.nested, offset=qs.offset, state2=state2)
        with torch.no_grad():
            return dequantize_nf4(self.packed.view(E, n_e // 2)[ids].reshape(-1), state)

    def extra_repr(self) -> str:
        return (f"shape={tuple(self.shape)}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"blocksize={self.blocksize}, nested={self.nested}")
