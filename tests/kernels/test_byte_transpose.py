"""kernels/byte_transpose.py: the tiled transpose of one-byte tensors against torch's own copy.

Inputs hold bytes 0..254 only: the poisoned allocations (conftest) fill new memory with 0xFF, so
an output byte the kernel never wrote reads 0xFF and fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from fasttune.kernels.byte_transpose import transpose_bytes


def _bytes(rows, cols, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8).to(device)


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 64), (65, 130), (200, 3)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn])
def test_transpose_matches_torch(device, shape, dtype):
    x = _bytes(*shape, device, seed=sum(shape)).view(dtype)
    got = transpose_bytes(x)
    assert got.dtype == dtype and got.shape == shape[::-1] and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), x.view(torch.uint8).t().contiguous())


def test_transpose_of_a_row_strided_view(device):
    base = _bytes(40, 100, device, seed=3)
    x = base[:, 10:77]  # rows 100 bytes apart, 67 columns
    assert torch.equal(transpose_bytes(x), x.t().contiguous())
    assert torch.equal(transpose_bytes(base.t()), base)  # a column-major input is made contiguous first


def test_transpose_of_an_empty_tensor(device):
    assert transpose_bytes(torch.empty(0, 5, dtype=torch.uint8, device=device)).shape == (5, 0)


def test_transpose_bad_input(device):
    with pytest.raises(ValueError, match="2-D tensor of one-byte"):
        transpose_bytes(torch.zeros(4, 4, device=device))
    with pytest.raises(ValueError, match="2-D tensor of one-byte"):
        transpose_bytes(torch.zeros(4, dtype=torch.uint8, device=device))


@pytest.mark.gpu
def test_transpose_at_8b_widths_on_gpu():
    for rows, cols in ((14336, 4096), (4096, 14336), (1024, 4096)):
        x = _bytes(rows, cols, "cuda", seed=rows)
        assert torch.equal(transpose_bytes(x), x.t().contiguous())
