"""``kept_weights.py``: what a recompute keeps, when it is taken, and when it is dropped.

The bitwise check on a QLoRA model (kept weights against an unchecked run and the option off) is
``tests/model_patches/test_layer_call.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fasttune.kernels import kept_weights
from fasttune.kernels.kept_weights import KeptWeights, keeps, recording_for
from fasttune.kernels.lora import BaseWeight


def _nf4(dtype=torch.bfloat16, codes=None):
    codes = torch.zeros(8, 1, dtype=torch.uint8) if codes is None else codes
    return BaseWeight(codes, SimpleNamespace(shape=(4, 4), dtype=dtype))


def test_a_weight_kept_by_a_recompute_no_backward_took_is_dropped_by_the_next():
    """A recompute starts with nothing kept (an earlier one's weight a backward never took goes), and a
    weight is taken once: a second backward through the same graph dequantises again."""
    kept = KeptWeights()
    codes, w = torch.zeros(8, 1, dtype=torch.uint8), torch.ones(4, 4, dtype=torch.bfloat16)
    base, same_codes_other_state = _nf4(codes=codes), _nf4(codes=codes)
    token = kept_weights.keeping(kept, recording=True)
    try:
        assert kept_weights.current() is kept and kept.recording
        kept.put(base, w)
    finally:
        kept_weights.stop(token)
    assert kept_weights.current() is None and not kept.recording and len(kept) == 1
    assert kept.take(base, torch.float32) is None  # another dtype: not this weight
    token = kept_weights.keeping(kept, recording=True)
    kept_weights.stop(token)
    assert len(kept) == 0 and kept.take(base, torch.bfloat16) is None
    token = kept_weights.keeping(kept, recording=False)  # a forward: what was kept stays, nothing is put
    kept_weights.stop(token)
    kept.put(base, w)
    assert kept.take(same_codes_other_state, torch.bfloat16) is None  # another module's weight
    assert kept.take(base, torch.bfloat16) is w and kept.take(base, torch.bfloat16) is None


def test_only_nf4_weights_in_their_quant_states_dtype_are_kept():
    assert keeps(_nf4(torch.bfloat16), torch.bfloat16)
    assert not keeps(_nf4(torch.bfloat16), torch.float32)  # fp32 compute: dX reads the bf16-rounded weight
    assert not keeps(BaseWeight(torch.ones(4, 4, dtype=torch.bfloat16)), torch.bfloat16)  # dense: nothing to keep


def test_recording_only_in_a_recompute_and_only_for_an_input_that_needs_its_gradient():
    kept = KeptWeights()
    needs, needs_not = SimpleNamespace(needs_input_grad=(True, False)), SimpleNamespace(needs_input_grad=(False, True))
    assert recording_for(needs) is None  # outside a layer call
    for recording, want in ((False, None), (True, kept)):
        token = kept_weights.keeping(kept, recording)
        try:
            assert recording_for(needs) is want
            assert recording_for(needs_not) is None  # no dX in its backward: a kept weight would never be taken
        finally:
            kept_weights.stop(token)
