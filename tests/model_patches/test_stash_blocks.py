"""What a stashed core leaves in place of its saved tensors (``stash_blocks.py``): the parts that need no
checkpointer (``test_attention_stash.py`` runs the blocks and refs through whole training steps)."""

from __future__ import annotations

import pytest
import torch

from fasttune.model_patches.stash_blocks import RecomputedInput, UnusedOutput, view_of


def test_a_recomputed_input_is_taken_once_per_use_then_let_go():
    held = RecomputedInput()
    # full fine-tuning: q_proj, k_proj and v_proj each save the input, as a [N, D] view of the [B, S, D] one
    uses = [held.use((10, 7)) for _ in range(3)]
    x = torch.randn(2, 5, 7, requires_grad=True) * 2
    held.set(x)
    got = [u.get() for u in uses]
    assert all(g.shape == (10, 7) and g.data_ptr() == x.data_ptr() and not g.requires_grad for g in got)
    assert held.tensor is None  # the last use let it go: it lives no longer than a fetched copy would
    held.set(x)  # a second backward through a retained graph recomputes it again
    assert torch.equal(uses[0].get(), x.detach().view(10, 7)) and held.left == 2


def test_a_recompute_whose_input_has_other_strides_still_hands_the_same_values():
    held = RecomputedInput()
    use = held.use((6, 8))
    wide = torch.randn(6, 10)
    held.set(wide[:, :8])  # the recompute's norm left spare columns the forward's did not
    assert torch.equal(use.get(), wide[:, :8])


def test_an_input_the_recompute_never_made_is_a_clear_error():
    use = RecomputedInput().use((3,))
    with pytest.raises(RuntimeError, match="input was needed before its recompute made it"):
        use.get()


def test_view_of_tells_a_view_of_the_input_from_other_tensors_in_its_memory():
    wide = torch.randn(2, 3, 10)
    x = wide[..., :8]  # the norm's output with spare columns after each row
    assert view_of(x, x) and view_of(wide[..., :8], x)  # another view object of the same memory
    assert view_of(x.reshape(6, 8), x)  # a linear's saved input
    assert not view_of(wide[..., 2:], x)  # same storage, another offset
    assert not view_of(wide[:1, :, :8], x)  # fewer elements
    assert not view_of(x.contiguous(), x) and not view_of(x.to(torch.float64), x)
    assert not view_of(x.transpose(0, 1), x)  # same memory, another order
    y = torch.randn(4, 6)
    assert view_of(y.view(24), y) and not view_of(y.t().contiguous().view(4, 6), y)
    assert not view_of(x, None)


def test_an_unused_output_comes_back_as_nans_of_its_shape():
    out = UnusedOutput(torch.zeros(2, 3, dtype=torch.bfloat16))
    got = out.get()
    assert got.shape == (2, 3) and got.dtype == torch.bfloat16 and torch.isnan(got).all()
