"""CallCounts: the first optimizer step's calls are logged once, per model, after the counts are reset."""

import logging
from types import SimpleNamespace

from fasttune.hf_integration.call_counts import CallCounts
from fasttune.model_patches.report import FUSED, PatchReport


def _report(op="rms_norm"):
    report = PatchReport(model_type="llama")
    report.add(op, 2, counted=True)
    return report


def test_logged_once_after_the_first_step_from_a_reset(caplog):
    model, ref = _report(), _report("cross_entropy")
    model.calls[("rms_norm", FUSED)] = 7  # before training: cleared at train begin
    counts = CallCounts({"model": model, "reference model": ref})
    state, control = SimpleNamespace(is_world_process_zero=True), SimpleNamespace()
    counts.on_train_begin(None, state, control)
    assert not model.calls
    model.calls[("rms_norm", FUSED)] += 3
    model.calls[("rms_norm", "decode step")] += 1
    caplog.set_level(logging.INFO, logger="fasttune")
    counts.on_step_end(None, state, control)
    assert "rms_norm: 3/4 calls fused (1 stock: decode step)" in caplog.text
    assert "reference model: cross_entropy is patched but ran no call fused" in caplog.text
    caplog.clear()
    counts.on_step_end(None, state, control)
    assert caplog.text == ""  # once per train()


def test_other_ranks_log_nothing(caplog):
    counts = CallCounts({"model": _report()})
    state, control = SimpleNamespace(is_world_process_zero=False), SimpleNamespace()
    caplog.set_level(logging.INFO, logger="fasttune")
    counts.on_train_begin(None, state, control)
    counts.on_step_end(None, state, control)
    assert caplog.text == ""
