"""The run folder: its layout, and state.json written atomically per rank."""

from __future__ import annotations

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
