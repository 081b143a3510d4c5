"""What the loss-head kernels share: chunk planning, fp32-accumulated products, label checks."""

import pytest
import torch

from fasttune.kernels import _lce_common as common


def test_chunks_stay_within_the_workspace_and_cover_every_row():
    assert common.plan_chunk_rows(100, 1000, 2, 64) == 100  # fits whole
    rows = common.plan_chunk_rows(100_000, 128_256, 2, 1024)
    assert rows % 16 == 0 and rows * 128_256 * 2 <= 1024 * 2 ** 20
    assert -(-100_000 // rows) * rows >= 100_000
    assert common.plan_chunk_rows(10_000, 10 ** 9, 4, 1) == common.MIN_CHUNK_ROWS  # never below the minimum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_products_accumulate_in_fp32(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 19, generator=g).to(dtype), torch.randn(19, 23, generator=g).to(dtype)
    want = a.double() @ b.double()
    out = common.mm_fp32(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-5)
    common.addmm_fp32_(out, a, b)  # beta = 1 adds a second product
    torch.testing.assert_close(out.double(), 2 * want, rtol=1e-6, atol=1e-5)


def test_label_summary_counts_valid_rows_and_rejects_out_of_range():
    labels = torch.tensor([0, 4, -100, 2])
    assert common.label_summary(labels, 5, -100) == 3
    assert common.label_summary(torch.tensor([], dtype=torch.long), 5, -100) == 0
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\) or ignore_index=-100; found 5"):
        common.label_summary(torch.tensor([5, -100]), 5, -100)
    assert common.label_summary(torch.tensor([-1, 3]), 5, None) == 2  # log-probs: negatives read as 0


def test_argument_checks_name_the_argument():
    with pytest.raises(ValueError, match="workspace_mib"):
        common.check_workspace(0)
    with pytest.raises(ValueError, match="softcap"):
        common.check_transform(-1.0, None)
    with pytest.raises(ValueError, match="logit_scale"):
        common.check_transform(None, float("nan"))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        common.check_labels_dtype(torch.zeros(2))
    assert common.transform_args(None, 30.0) == (1.0, 30.0, 1 / 30.0)
