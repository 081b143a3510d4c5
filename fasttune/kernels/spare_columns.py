"""Spare columns after a producer's output rows, so a widened LoRA group need not copy its input.

A widened projection group (``lora_wide.py``) multiplies [X | s·XA] [W | B]ᵀ, which needs X in the
first ``in`` columns of an [N, in + R] buffer. Copying X there costs a read and a write of X per
group (~85 µs for an 8B layer's [8,192, 4,096] X through a strided copy: ~5 ms of a step). When X
is the output of a kernel that can write rows with any stride (the RMSNorm before q/k/v and before
gate/up), that kernel can leave the R columns free instead:

- the producer owns a ``SpareColumns`` (its standing offer, width 0 at first) and allocates each
  output with ``output_rows``: rows ``width`` elements longer than the output, which it tags, the
  spare columns zeroed (a GEMM over X may read them before any tail is written);
- a consumer calls ``spare_input(x2, extra)``: it records the width it needs (``request``) and,
  once an output carries at least that many spare columns, gets an [N, in + extra] alias of the
  buffer whose first ``in`` columns are X, and writes its tail there.

The output the producer hands out is not a view of the wider buffer but an alias of its storage
with its own version counter (``storage_alias``), and so is the consumer's widened input: writing
the tail (which lies outside X) neither makes autograd think X was modified in place nor turns X
into a view that in-place ops (or autograd's view checks) would treat specially. Only tagged
buffers are ever written past their logical end: a consumer never writes into columns of a tensor
that fasttune did not allocate for that purpose.
"""

from __future__ import annotations

import torch

__all__ = ["SpareColumns", "WIDTH_MULTIPLE", "output_rows", "spare_input", "storage_alias"]

_TAG = "_fasttune_spare_columns"  # on an output: (its SpareColumns, the row length in elements)
# Widths are multiples of 16 elements, so a row length keeps its divisibility by 16: Triton
# specialises kernels on that, and with the same compiled kernel an output with spare columns is
# bitwise the plain one (another specialisation may pick another reduction layout: fp32 rounding).
WIDTH_MULTIPLE = 16


class SpareColumns:
    """A producer's offer of free columns after each output row; ``width`` grows with requests."""

    __slots__ = ("width",)

    def __init__(self):
        self.width = 0

    def request(self, width: int) -> None:
        """Ask for at least ``width`` spare columns in the producer's next outputs."""
        if width > self.width:
            self.width = -(-int(width) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE

    def __repr__(self) -> str:
        return f"SpareColumns(width={self.width})"


def storage_alias(t: torch.Tensor, shape, strides, offset: int | None = None) -> torch.Tensor:
    """A tensor over ``t``'s storage with the given geometry and a version counter of its own."""
    offset = t.storage_offset() if offset is None else offset
    return t.new_empty(0).set_(t.untyped_storage(), offset, tuple(shape), tuple(strides))


def output_rows(shape, dtype: torch.dtype, device, spare: SpareColumns | None) -> tuple[torch.Tensor, int]:
    """(output of ``shape``, row length): rows ``spare.width`` elements longer than ``shape[-1]``
    (none without ``spare``), the output tagged for ``spare_input``. The caller writes row i of the
    flattened output at element i·(row length) of its data."""
    width = 0 if spare is None else spare.width
    cols = shape[-1]
    row = cols + width
    buf = torch.empty((*shape[:-1], row), dtype=dtype, device=device)
    if width == 0:
        out = buf
    else:
        # Written now, not only by the consumer: products over X read its rows' spare columns
        # before the tail is filled (CPU bf16 GEMMs read past a padded row's end, whole blocks
        # at a time), and 0·NaN = NaN, so garbage there would turn X·Aᵀ NaN at random.
        buf[..., cols:].zero_()
        out = storage_alias(buf, shape, buf.stride(), 0)  # the buffer's own row-major strides
    if spare is not None:
        setattr(out, _TAG, (spare, row))
    return out, row


def spare_input(x2: torch.Tensor, extra: int) -> torch.Tensor | None:
    """An [N, in + extra] widened input whose first ``in`` columns are X itself, or None.

    Args:
        x2: X [N, in], the producer's tagged output flattened to rows (or that output itself).
        extra: the tail width the consumer needs (recorded with the producer either way).

    None when X is not a tagged output, is only part of one, or its rows do not (yet) carry
    ``extra`` spare columns: the caller copies X then.
    """
    owner = x2 if x2._base is None else x2._base
    tag = owner.__dict__.get(_TAG)
    if tag is None or x2.dim() != 2:
        return None
    spare, row = tag
    spare.request(extra)
    n, in_f = x2.shape
    if (row < in_f + extra or x2.stride() != (row, 1) or x2.data_ptr() != owner.data_ptr()
            or owner.numel() != n * in_f):
        return None
    return storage_alias(x2, (n, in_f + extra), (row, 1))
