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


def steps_with_the_budget_forced_open(model, chain, batch, ref, measured=None, forced_steps: int = 3) -> None:
    """CUDA: ``MEASURING_STEPS`` steps, then ``forced_steps`` with the link budget forced open (every core or output
    goes: the most copies in flight, originals held). Each step equals ``ref`` bitwise and leaves nothing held, and
    the reserve does not grow from step to step. ``measured(stats)``: checks of the chain's counters after the
    measuring steps (which stash nothing)."""
    reserved = []
    for step in range(MEASURING_STEPS + forced_steps):
        assert_bitwise(seeded_step(model, batch), ref)
        assert len(chain.held) == 0
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
        if step == MEASURING_STEPS - 1:
            if measured is not None:
                measured(chain.stats)
            model(**batch)  # a further forward reads what the last step measured
            assert chain.link.measured and chain.link.rate > 1e9 and chain.link.layer_s > 0, vars(chain.link)
            chain.link.admits = lambda nbytes: True
    assert reserved[-1] <= reserved[MEASURING_STEPS + 1], reserved
