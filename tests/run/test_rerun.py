"""A used run folder: refused unless --overwrite or --resume; a live run refused either way."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fasttune.run.checkpoints import write_marker
from fasttune.run.config import RunConfig
from fasttune.run.folder import RunFolder
from fasttune.run.liveness import identity
from fasttune.run.rerun import RunFolderError, config_changes, prepare


def _previous_run(path, status="completed", steps=(2, 4), complete=(2,), **state):
    folder = RunFolder(path)
    folder.start(RunConfig())
    folder.train_log.write_text("log\n")
    (folder.final).mkdir()
    for step in steps:
        ckpt = path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "optimizer.pt").write_bytes(b"x" * 10)
        if step in complete:
            write_marker(ckpt, step)
    folder.write_state(status=status, step=steps[-1] if steps else 0, max_steps=10, **state)
    return folder


def test_a_fresh_or_space_prepared_folder_starts_at_step_zero(tmp_path):
    assert prepare(RunFolder(tmp_path / "new")) is None
    folder = RunFolder(tmp_path / "space")  # what the Space writes before launching `fasttune train`
    folder.path.mkdir()
    (folder.path / "run_config.yaml").write_text("trainer: sft\n")
    (folder.path / "console.log").write_text("")
    folder.write_state(status="starting", pid=123)
    assert not folder.has_previous_run() and prepare(folder) is None


def test_a_previous_run_is_refused_with_the_ways_out(tmp_path):
    folder = _previous_run(tmp_path / "run")
    with pytest.raises(RunFolderError) as info:
        prepare(folder)
    text = str(info.value)
    assert "already holds a run (completed, step 4/10)" in text
    assert "--resume continues from checkpoint-2" in text and "--overwrite starts over" in text
    with pytest.raises(RunFolderError, match="contradict"):
        prepare(folder, overwrite=True, resume=True)
    assert (folder.path / "checkpoint-4").is_dir()  # refused: nothing touched


def test_overwrite_removes_the_previous_run_and_nothing_else(tmp_path, caplog):
    folder = _previous_run(tmp_path / "run")
    (folder.path / "my_notes.txt").write_text("keep me")
    assert prepare(folder, overwrite=True) is None
    assert sorted(p.name for p in folder.path.iterdir()) == ["my_notes.txt"]
    assert "removed the previous run" in caplog.text


def test_resume_takes_the_newest_complete_checkpoint(tmp_path, caplog):
    caplog.set_level("INFO", logger="fasttune.runner")
    folder = _previous_run(tmp_path / "run", status="running", **identity(2 ** 22 + 4321))  # a dead pid
    assert prepare(folder, resume=True) == folder.path / "checkpoint-2"
    assert "skipping incomplete checkpoint checkpoint-4: no trainer_state.json" in caplog.text
    assert "resuming from checkpoint-2 in" in caplog.text and "the run was interrupted, step 4/10" in caplog.text
    empty = _previous_run(tmp_path / "none", complete=())
    with pytest.raises(RunFolderError, match=r"--resume: no complete checkpoint in .*checkpoint-4: no trainer_state"):
        prepare(empty, resume=True)
    bare = _previous_run(tmp_path / "bare", steps=())
    with pytest.raises(RunFolderError, match=r"none saved \(training.save_strategy\)"):
        prepare(bare, resume=True)


def test_a_run_still_going_is_refused_even_with_a_flag(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folder = _previous_run(tmp_path / "run", status="running", **identity(proc.pid))
        for flags in ({}, {"overwrite": True}, {"resume": True}):
            with pytest.raises(RunFolderError, match=f"still going \\(pid {proc.pid}"):
                prepare(folder, **flags)
    finally:
        proc.kill()
        proc.wait()
    assert prepare(folder, resume=True) == folder.path / "checkpoint-2"  # now it is interrupted


def test_config_changes_lists_dotted_keys():
    before = RunConfig().to_dict()
    after = RunConfig.from_dict({"training": {"max_steps": 8}, "run_name": "x"}).to_dict()
    assert config_changes(before, after) == ["run_name: None -> 'x'", "training.max_steps: -1 -> 8"]
    assert config_changes(before, json.loads(json.dumps(before))) == []


def test_other_ranks_never_clear_and_find_the_same_checkpoint(tmp_path, monkeypatch):
    folder = _previous_run(tmp_path / "run")
    monkeypatch.setenv("RANK", "1")  # rank 0 decides; rank 1 starts while rank 0 writes the new run
    assert prepare(folder) is None and prepare(folder, overwrite=True) is None
    assert (folder.path / "checkpoint-4").is_dir()  # untouched: clearing is rank 0's
    assert prepare(folder, resume=True) == folder.path / "checkpoint-2"
