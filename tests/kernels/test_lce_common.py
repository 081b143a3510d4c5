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


def test_default_workspace_is_smaller_when_the_head_is_frozen():
    mib = 2 ** 20
    assert common.default_workspace_mib(128_256, 2, trainable=True) == common.DEFAULT_WORKSPACE_MIB
    assert common.default_workspace_mib(128_256, 2, trainable=False) == 256  # Llama-3: 1,046 rows
    assert common.default_workspace_mib(152_064, 2, trainable=False) == 1024 * 152_064 * 2 / mib  # Qwen2.5: 1,024 rows
    assert common.default_workspace_mib(10 ** 7, 2, trainable=False) == common.DEFAULT_WORKSPACE_MIB  # never above
    frozen = common.plan_chunk_rows(8192, 128_256, 2, None, trainable=False)
    trained = common.plan_chunk_rows(8192, 128_256, 2, None, trainable=True)
    assert frozen * 128_256 * 2 <= 256 * mib < trained * 128_256 * 2 <= 1024 * mib
    assert common.plan_chunk_rows(8192, 128_256, 2, 1024, trainable=False) == trained  # a given bound is kept


@pytest.mark.parametrize("need_w", [False, True])
def test_head_chunks_plans_by_whether_w_trains(monkeypatch, need_w):
    """head_chunks sizes its chunks with the frozen default unless dW is accumulated, and covers
    every row once either way (bounds shrunk so a tiny head has several chunks)."""
    V, D, N, elem = 64, 8, 100, 4
    monkeypatch.setattr(common, "DEFAULT_WORKSPACE_MIB", 32 * V * elem / 2 ** 20)  # 32 rows
    monkeypatch.setattr(common, "FROZEN_WORKSPACE_MIB", 16 * V * elem / 2 ** 20)  # 16 rows
    monkeypatch.setattr(common, "FROZEN_MIN_ROWS", 1)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    seen = []

    def run_pass(x, s, e):
        seen.append((s, e))
        torch.testing.assert_close(x, h[s:e] @ w.t())

    dh, dw32, _ = common.head_chunks(h, w, None, None, None, run_pass, need_h=True, need_w=need_w)
    sizes = {e - s for s, e in seen[:-1]}
    assert sizes == ({32} if need_w else {16}) and seen[0][0] == 0 and seen[-1][1] == N
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))
    torch.testing.assert_close(dh, (h @ w.t()) @ w)  # run_pass left the logits as their own "gradient"
    assert (dw32 is not None) == need_w


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
