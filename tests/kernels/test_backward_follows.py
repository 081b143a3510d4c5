"""The recompute marker (``kernels/backward_follows.py``): off by default, on inside the block, undone on exit
(errors included); a checkpointed layer's recompute sets it (tests/model_patches/test_no_grad_forward.py)."""

from __future__ import annotations

import pytest

from fasttune.kernels.backward_follows import backward_follows, backward_follows_now


def test_on_only_inside_the_block_and_undone_after_an_error():
    assert not backward_follows_now()
    with backward_follows():
        assert backward_follows_now()
        with backward_follows():
            assert backward_follows_now()
        assert backward_follows_now()
    assert not backward_follows_now()
    with pytest.raises(ValueError, match="boom"):
        with backward_follows():
            raise ValueError("boom")
    assert not backward_follows_now()
