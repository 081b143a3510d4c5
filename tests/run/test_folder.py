"""The run folder: its layout, and state.json written atomically per rank."""

from __future__ import annotations

import json

import pytest

from fasttune.run.config import RunConfig
from fasttune.run.folder import RunFolder, read_state, write_state


def test_state_file_merges_updates_atomically(tmp_path):
    assert read_state(tmp_path) == {}
    write_state(tmp_path, status="running", step=1, loss=[[1, 2.0]])
    state = write_state(tmp_path, step=2)
    assert state["status"] == "running" and state["step"] == 2 and state["loss"] == [[1, 2.0]]
    assert read_state(tmp_path) == state
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temporary files left
    (tmp_path / "state.json").write_text('{"status": "runn')  # a torn file reads as no state
    assert read_state(tmp_path) == {}


def test_other_ranks_never_write_state_json(tmp_path, monkeypatch):
    write_state(tmp_path, status="running", step=3)
    monkeypatch.setenv("RANK", "1")
    write_state(tmp_path, status="running", step=5)
    assert read_state(tmp_path)["step"] == 5
    monkeypatch.setenv("RANK", "0")
    assert read_state(tmp_path)["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".state.rank1.json", "state.json"]


def test_the_folder_knows_its_layout_and_records_artifacts(tmp_path):
    folder = RunFolder(tmp_path / "run")
    assert not folder.is_finished()
    folder.start(RunConfig())
    assert folder.config_file.is_file() and folder.fast_config_file.is_file() and folder.log_history.read_text() == ""
    folder.final.mkdir()
    assert folder.is_finished() and folder.load_config() == RunConfig()
    folder.record("artifacts", {"merged": "m"})
    folder.record("artifacts", {"gguf": "g"})
    assert folder.read_state()["artifacts"] == {"merged": "m", "gguf": "g"}
    assert folder.run_stats() is None  # no trainer_state.json yet


def test_a_full_disk_still_records_the_failure(tmp_path, monkeypatch):
    """The failure write on a full disk: the reserve is freed for it; without one the state is
    overwritten in place (no new blocks); the state never stays "running" with no error."""
    from helpers.full_disk import FullDisk

    from fasttune.run.folder import RESERVE_BYTES

    folder = RunFolder(tmp_path / "run")
    folder.start(RunConfig())
    assert folder.reserve_file.stat().st_size == RESERVE_BYTES
    folder.write_state(status="running", step=7, error=None, loss=[[i, 1.0] for i in range(200)])
    disk = FullDisk(folder.path, free=0).install(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        folder.write_state(step=8, loss=[[i, 1.0] for i in range(300)])  # what failed in the first place
    assert read_state(folder.path)["step"] == 7 and not list(folder.path.glob(".state.json.*.tmp"))
    assert folder.write_state_robustly(status="failed", error="disk full writing x") is None
    assert not folder.reserve_file.exists() and disk.refused >= 2
    state = read_state(folder.path)
    assert state["status"] == "failed" and state["error"] == "disk full writing x" and len(state["loss"]) == 200

    # no reserve left: written in place, cut down to the essential keys when the full state is larger
    monkeypatch.undo()
    folder.write_state(status="running", error=None)
    FullDisk(folder.path, free=0).install(monkeypatch)
    huge = "x" * 50_000
    assert folder.write_state_robustly(status="failed", error="disk full", note=huge) is None
    state = read_state(folder.path)
    assert state["status"] == "failed" and state["error"] == "disk full" and "note" not in state
    assert state["step"] == 7

    # nothing can be written at all: a message that says so, and what readers will see
    def refuse(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.write", refuse)
    problem = folder.write_state_robustly(status="failed", error="again")
    assert problem.startswith(f"could not record the run's state in {folder.state_file} (No space left on device)")
    assert "interrupted" in problem


def test_a_previous_run_is_recognised_and_cleared_to_the_last_file(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    (folder.path / "console.log").write_text("the Space's")
    folder.write_state(status="starting")
    assert not folder.has_previous_run()
    folder.start(RunConfig())
    assert not folder.has_previous_run()  # an empty log
    folder.append_log({"loss": 1.0, "step": 1})
    assert folder.has_previous_run()
    (folder.path / "checkpoint-5").mkdir()
    folder.final.mkdir()
    removed = folder.clear_previous_run()
    assert set(removed) == {"run_config.yaml", "fast_config.json", "state.json", ".state.reserve", "log_history.jsonl",
                            "final", "checkpoint-5"}
    assert sorted(p.name for p in folder.path.iterdir()) == ["console.log"]


def test_resuming_keeps_the_log_up_to_the_checkpoint(tmp_path):
    folder = RunFolder(tmp_path)
    folder.start(RunConfig())
    for step in (2, 4, 6):
        folder.append_log({"loss": 1.0 / step, "step": step})
    folder.start(RunConfig(), resume_step=4)
    assert [json.loads(x)["step"] for x in folder.log_history.read_text().splitlines()] == [2, 4]
    folder.start(RunConfig())
    assert folder.log_history.read_text() == ""
