"""One training step and a bitwise comparison, for the stash tests (attention, experts, MLP): a stashed run's
loss and every gradient must equal the run without checkpointing exactly."""

from __future__ import annotations

import torch

# Training steps on CUDA before a stash sends anything: the first pins the layer inputs' host buffers (a forward
# that pins does not time the layers, stash_link.py), the second times them; the third reads those figures.
MEASURING_STEPS = 2


def seeded_step(model, batch, backward_kw=None):
    """(loss, {name: grad}) of one forward and backward from a fixed RNG state."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = model(**batch).loss
    loss.backward(**(backward_kw or {}))
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_bitwise(got, ref):
    """``seeded_step`` results equal bit for bit (and there are gradients to compare)."""
    assert torch.equal(got[0], ref[0]), (got[0], ref[0])
    assert got[1].keys() == ref[1].keys() and got[1]
    bad = [n for n in ref[1] if not torch.equal(got[1][n], ref[1][n])]
    assert not bad, f"gradients differ bitwise: {bad[:4]}"
