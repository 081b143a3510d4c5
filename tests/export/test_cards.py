"""Run statistics for the cards, and the loss-curve image (or why there is none)."""

import sys
from types import SimpleNamespace

from fasttune.export.cards import run_stats_from_state, write_loss_curve


def test_run_stats_and_loss_curve(tmp_path, monkeypatch):
    state = SimpleNamespace(global_step=30, log_history=[
        {"loss": 2.0, "step": 10, "tokens_per_second": 100.0, "peak_memory_gib": 3.0},
        {"loss": 1.5, "step": 20, "tokens_per_second": 110.0, "peak_memory_gib": 4.5},
        {"eval_loss": 1.8, "step": 20},
        {"loss": 1.25, "step": 30, "tokens_per_second": 120.0, "peak_memory_gib": 4.0},
        {"train_runtime": 12.5, "train_loss": 1.6, "step": 30}])
    stats = run_stats_from_state(state)
    assert stats == {"global_step": 30, "final_loss": 1.25, "tokens_per_second": 120.0, "peak_memory_gib": 4.5,
                     "train_runtime": 12.5, "loss_curve": [(10, 2.0), (20, 1.5), (30, 1.25)]}
    assert write_loss_curve(stats["loss_curve"], tmp_path / "a.png") is None
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert "fewer than two" in write_loss_curve([(1, 1.0)], tmp_path / "b.png")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert "matplotlib is not installed" in write_loss_curve(stats["loss_curve"], tmp_path / "c.png")
    assert not (tmp_path / "b.png").exists() and not (tmp_path / "c.png").exists()
