"""``RemadeTensors``: saved outputs made again from their inputs' copies, once per backward
(``stash_remake.py``). The end-to-end tests are in test_attention_stash.py (q/k norm families)."""

from __future__ import annotations

import pytest
import torch

from fasttune.model_patches.stash_remake import RemadeRef, RemadeTensors


class _Copy:
    """A stand-in for a ``StashedRef``: hands back a copy of a tensor, counting its takes."""

    def __init__(self, t):
        self.t, self.takes = t.clone(), 0

    def get(self):
        self.takes += 1
        return self.t.clone()


def _normed_rotated(q, k):  # a norm, then a transpose: the layout attention_qk's outputs have
    return (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)).transpose(1, 2), (2 * k).transpose(1, 2)


def _registered(calls=None):
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
    out = _normed_rotated(q, k)

    def remake(a, b):
        calls.append(1) if calls is not None else None
        return _normed_rotated(a, b)

    return RemadeTensors((q, k), out, remake), (q, k), out


def test_each_saved_view_gets_the_forward_values_and_the_remake_runs_once_per_backward():
    calls, copies = [], {}
    remade, inputs, out = _registered(calls)
    assert remade.bind(lambda t: copies.setdefault(id(t), _Copy(t)))
    remade.release()  # the core ended: the inputs are no longer held by the remake
    assert remade.inputs is None
    saved = [remade.use(0, out[0]), remade.use(1, out[1]), remade.use(0, out[0][:, :2])]  # one a slice (a view)
    assert all(isinstance(r, RemadeRef) for r in saved)
    for backward in (1, 2):  # a retained graph's second backward remakes again
        got = [r.get() for r in saved]
        assert torch.equal(got[0], out[0]) and torch.equal(got[1], out[1]) and torch.equal(got[2], out[0][:, :2])
        assert got[2].data_ptr() == got[0].data_ptr(), "both views of output 0 read one remade tensor"
        assert len(calls) == backward and remade.made is None, "the last use lets the remade tensors go"
        assert [c.takes for c in copies.values()] == [backward, backward]


def test_an_input_that_cannot_be_copied_leaves_the_outputs_to_the_usual_stash():
    remade, _, _ = _registered()
    assert not remade.bind(lambda t: None)
    remade.release()
    assert not remade.bind(lambda t: _Copy(t)), "after the core ends its inputs are gone: nothing to bind"


def test_a_remake_laid_out_otherwise_fails_loudly():
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
    out = _normed_rotated(q, k)
    remade = RemadeTensors((q, k), out, lambda a, b: tuple(t.contiguous() for t in _normed_rotated(a, b)))
    assert remade.bind(_Copy)
    ref = remade.use(0, out[0])
    with pytest.raises(RuntimeError, match="remade tensor is laid out"):
        ref.get()
