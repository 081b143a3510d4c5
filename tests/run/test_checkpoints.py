"""Checkpoint completeness: a marker written after the save, structural checks without one."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from fasttune.run.checkpoints import (MARKER, checkpoints, incomplete_reason, newest_complete, step_of,
                                      write_marker)


def _checkpoint(run_dir, step: int, marker: bool = True):
    """A checkpoint laid out as the Trainer writes one (weights, optimizer, rng, trainer state last)."""
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({"a": torch.randn(64, 32), "b": torch.randn(32)}, folder / "adapter_model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.randn(4096)}}, "param_groups": []}, folder / "optimizer.pt")
    torch.save({"python": [1, 2, 3]}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if marker:
        write_marker(folder, step)
    return folder


def test_a_marked_checkpoint_is_complete_until_a_file_changes(tmp_path):
    folder = _checkpoint(tmp_path, 4)
    assert incomplete_reason(folder) is None and json.loads((folder / MARKER).read_text())["step"] == 4
    opt = folder / "optimizer.pt"
    size = opt.stat().st_size
    os.truncate(opt, size // 2)  # what a full disk leaves
    assert incomplete_reason(folder) == f"optimizer.pt is {size // 2} bytes, {size} when saved (cut short?)"
    os.truncate(opt, 0)
    torch.save({"state": {0: {"exp_avg": torch.randn(4096)}}, "param_groups": []}, opt)  # a re-save, same size
    os.utime(opt, ns=(1, 1))
    assert "rewritten after the checkpoint was saved" in incomplete_reason(folder)
    other = _checkpoint(tmp_path, 6)
    (other / "rng_state.pth").unlink()
    assert incomplete_reason(other) == "rng_state.pth is missing"


@pytest.mark.parametrize("damage, reason", [
    (lambda f: os.truncate(f / "optimizer.pt", (f / "optimizer.pt").stat().st_size - 100),
     "optimizer.pt is cut short or not a torch file"),
    (lambda f: os.truncate(f / "adapter_model.safetensors", (f / "adapter_model.safetensors").stat().st_size - 4),
     "adapter_model.safetensors is cut short"),
    (lambda f: (f / "trainer_state.json").unlink(), "no trainer_state.json"),
    (lambda f: (f / "trainer_state.json").write_text('{"global_st'), "trainer_state.json is unreadable"),
    (lambda f: (f / "adapter_model.safetensors").unlink(), "no model weights"),
], ids=["torch-file", "safetensors", "no-state", "torn-state", "no-weights"])
def test_without_a_marker_structural_checks_decide(tmp_path, damage, reason):
    folder = _checkpoint(tmp_path, 2, marker=False)
    assert incomplete_reason(folder) is None  # a plain Trainer's complete checkpoint
    damage(folder)
    assert incomplete_reason(folder).startswith(reason)


def test_newest_complete_skips_newer_incomplete_checkpoints(tmp_path):
    assert newest_complete(tmp_path) == (None, []) and checkpoints(tmp_path / "none") == []
    for step in (2, 10):
        _checkpoint(tmp_path, step)
    broken = _checkpoint(tmp_path, 20)
    os.truncate(broken / "optimizer.pt", 100)
    unfinished = tmp_path / "checkpoint-30"
    unfinished.mkdir()  # a save killed before trainer_state.json
    save_file({"a": torch.zeros(2)}, unfinished / "adapter_model.safetensors")
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 10, 20, 30]  # numeric order, not text order
    latest, skipped = newest_complete(tmp_path)
    assert latest == tmp_path / "checkpoint-10" and step_of(latest) == 10
    assert [(p.name, why.split(" ")[0]) for p, why in skipped] == [("checkpoint-30", "no"),
                                                                   ("checkpoint-20", "optimizer.pt")]
    with pytest.raises(ValueError, match="not a checkpoint-N folder"):
        step_of(tmp_path / "final")
