"""LabelSummary: the loss head's count and range check, started early, read later without a new sync."""

import pytest
import torch

from fasttune.kernels import _lce_common as common
from fasttune.kernels.cross_entropy import fused_linear_cross_entropy
from fasttune.kernels.label_summary import LabelSummary

from helpers.compare import make_head_inputs

IGN = -100


def _random_labels(device, n, V, ignore_frac, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignore_frac] = IGN
    return y.to(device)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_count_and_range_match_a_direct_reading(device, seed):
    n = 37 + 11 * seed
    y = _random_labels(device, n, 50, 0.3, seed)
    valid = y != IGN
    summary = LabelSummary(y, IGN)
    assert summary.valid() == int(valid.sum()) == summary.count(50)
    top = int(y[valid].max())
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, {top}\) or ignore_index=-100; found {top}"):
        summary.count(top)  # V = the largest label: that one lies outside [0, V)


def test_edge_cases(device):
    assert LabelSummary(torch.tensor([], dtype=torch.long, device=device), IGN).count(5) == 0
    assert LabelSummary(torch.full((4,), IGN, device=device), IGN).count(5) == 0  # all ignored: no range check
    assert LabelSummary(torch.tensor([-1, 3], device=device), None).count(5) == 2  # log-probs: negatives read as 0
    with pytest.raises(ValueError, match="found -7"):
        LabelSummary(torch.tensor([2, -7], device=device), IGN).count(5)
    with pytest.raises(ValueError, match="found 5"):
        LabelSummary(torch.tensor([5, IGN], device=device, dtype=torch.int32), IGN).count(5)


def test_label_summary_takes_a_started_one_only_for_the_same_unchanged_labels(device):
    y = _random_labels(device, 20, 9, 0.2, 0)
    started = LabelSummary(y, IGN)
    assert common.label_summary(y, 9, IGN, started) == common.label_summary(y, 9, IGN)
    with pytest.raises(ValueError, match="label_stats"):
        common.label_summary(y.clone(), 9, IGN, started)  # another tensor
    with pytest.raises(ValueError, match="label_stats"):
        common.label_summary(y, 9, -1, started)  # another ignore_index
    with pytest.raises(ValueError, match="label_stats"):
        common.label_summary(y, 9, IGN, "count=20")
    y[0] = 3  # changed in place after the start: stale
    with pytest.raises(ValueError, match="label_stats"):
        common.label_summary(y, 9, IGN, started)


def test_labels_made_under_inference_mode_are_summarised(device):
    """Inference tensors keep no version counter: the summary still starts and matches them."""
    with torch.inference_mode():
        y = _random_labels(device, 30, 9, 0.2, 1)
    started = LabelSummary(y, IGN)
    assert common.label_summary(y, 9, IGN, started) == int((y != IGN).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_with_a_started_summary_gives_the_same_loss_and_gradients(device, dtype):
    h, W, b, y = make_head_inputs(device, 45, 24, 70, dtype, True, 0.3, 4)

    def run(**kw):
        hl, wl = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
        loss = fused_linear_cross_entropy(hl, wl, y, b, ignore_index=IGN, **kw)
        loss.backward()
        return loss.detach(), hl.grad, wl.grad

    plain, early = run(), run(label_stats=LabelSummary(y, IGN))
    for a, e in zip(plain, early):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="label_stats"):
        run(label_stats=LabelSummary(y.clone(), IGN))


@pytest.mark.gpu
def test_gpu_starting_does_not_sync_and_reading_waits_for_the_copy():
    y = _random_labels("cuda", 8192, 151_936, 0.25, 0)
    torch.cuda._sleep(50_000_000)  # the stream is busy: a sync would wait for this
    torch.cuda.set_sync_debug_mode("error")
    try:
        summary = LabelSummary(y, IGN)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary.count(151_936) == int((y != IGN).sum())
