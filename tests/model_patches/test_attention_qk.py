"""``attention_qk``: q/k split into heads, normed and rotated in each family's order; a stashed core registers
what follows the norms' inputs, and the remake gives bitwise the same q/k (``attention_qk.py``)."""

from __future__ import annotations

import pytest
import torch

from fasttune.model_patches.attention_qk import attention_qk
from fasttune.model_patches.instance import few_rows_without_grad

B, S, H, KV, D = 2, 5, 4, 2, 8


def _rope(q, k):  # any elementwise map of [B, heads, S, D] will do; this one tells q from k and positions
    pos = torch.arange(q.shape[2], dtype=q.dtype).view(1, 1, -1, 1)
    return q * (1 + pos), k - pos


class _Norm(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.graphless_paths = []

    def forward(self, x):
        self.graphless_paths.append(few_rows_without_grad(1))  # what a patched norm would decide
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Stash:
    def __init__(self):
        self.registered = []

    def remakes(self, inputs, outputs, remake):
        self.registered.append((inputs, outputs, remake))


def _expected(qk_norm, q, k, norms):
    heads = lambda t: t.reshape(B, S, -1, D)  # noqa: E731
    if qk_norm == "full":
        q, k = norms[0](q), norms[1](k)
    q, k = heads(q), heads(k)
    if qk_norm == "head":
        q, k = norms[0](q), norms[1](k)
    q, k = _rope(q.transpose(1, 2), k.transpose(1, 2))
    if qk_norm == "head_after_rope":
        q, k = norms[0](q), norms[1](k)
    return q, k


@pytest.mark.parametrize("qk_norm", [None, "head", "full", "head_after_rope"])
def test_the_family_orders_and_a_bitwise_remake_from_the_norms_inputs(qk_norm):
    width = {"full": (H * D, KV * D)}.get(qk_norm, (D, D))
    norms = (_Norm(width[0]), _Norm(width[1]))
    q = torch.randn(B, S, H * D, requires_grad=True)
    k = torch.randn(B, S, KV * D, requires_grad=True)
    stash = _Stash()
    got = attention_qk(q * 1, k * 1, (B, S, -1, D), qk_norm, norms, _rope, stash)
    want = _expected(qk_norm, q, k, norms)
    assert got[0].shape == (B, H, S, D) and got[1].shape == (B, KV, S, D)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if qk_norm is None:
        assert stash.registered == []
        return
    (inputs, outputs, remake), = stash.registered
    assert outputs[0] is got[0] and outputs[1] is got[1]
    norms[0].graphless_paths.clear()
    remade = remake(*(t.detach().clone() for t in inputs))
    assert not remade[0].requires_grad, "the remake runs without autograd"
    assert torch.equal(remade[0], got[0]) and torch.equal(remade[1], got[1])
    assert remade[0].stride() == got[0].stride() and remade[1].stride() == got[1].stride()
    assert norms[0].graphless_paths == [False], "the remake took the training path, not a decode shortcut"


def test_a_layer_that_does_not_rotate():
    q, k = torch.randn(B, S, H * D), torch.randn(B, S, KV * D)
    got = attention_qk(q, k, (B, S, -1, D), None, (None, None), None)
    assert torch.equal(got[0], q.view(B, S, H, D).transpose(1, 2)) and torch.equal(got[1], k.view(B, S, KV, D)
                                                                                   .transpose(1, 2))
