"""A failure told well: which path was being written, and about how much space the run needs."""

from __future__ import annotations

import errno
import logging

from fasttune.run.checkpoints import write_marker
from fasttune.run.failure import LogFile, checkpoint_bytes, explain_failure
from fasttune.run.folder import RunFolder


def test_the_checkpoint_being_written_and_a_complete_ones_size(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write_state(status="running", phase="training", checkpoint_bytes=10**6)
    done = tmp_path / "checkpoint-2"
    done.mkdir()
    (done / "optimizer.pt").write_bytes(bytes(3_000_000))
    write_marker(done, 2)
    (tmp_path / "checkpoint-4").mkdir()  # the save that hit the full disk
    full = OSError(errno.ENOSPC, "No space left on device")
    line = explain_failure(full, folder)
    assert line.startswith(f"disk full writing {tmp_path / 'checkpoint-4'}: ")
    assert "a checkpoint needs about 3.0 MB" in line and line.endswith(
        "then `fasttune train --resume` continues from the last complete checkpoint")
    folder.write_state(phase="saving")
    assert explain_failure(full, folder).startswith(f"disk full writing {tmp_path / 'final'}: ")
    assert "the final model needs about 1.0 MB" in explain_failure(full, folder)
    assert explain_failure(ValueError("x"), folder) is None


def test_checkpoint_bytes_counts_saved_weights_and_adam_states():
    from peft import LoraConfig, get_peft_model

    from helpers.tiny_models import tiny_model

    model = tiny_model("llama")
    n = sum(p.numel() for p in model.parameters())
    assert checkpoint_bytes(model) == 4 * n + 8 * n  # full fine-tune: every weight, two fp32 states each
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    lora = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert checkpoint_bytes(peft) == 4 * lora + 8 * lora and lora < n / 10


def test_the_log_file_goes_quiet_on_a_full_disk(tmp_path, capsys):
    handler = LogFile(tmp_path / "train.log", encoding="utf-8")
    log = logging.getLogger("fasttune.test_failure")
    log.addHandler(handler)
    try:
        handler.stream.write = lambda s: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        log.error("one")
        log.error("two")
    finally:
        log.removeHandler(handler)
        handler.stream = None
    assert handler.level > logging.CRITICAL and "Logging error" not in capsys.readouterr().err


def test_a_full_disk_between_checkpoints_names_the_run_folder_and_a_checkpoints_need(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write_state(status="running", phase="training", checkpoint_bytes=2_000_000)
    line = explain_failure(OSError(errno.ENOSPC, "No space left on device"), folder)  # the state or log write
    assert line.startswith(f"disk full writing {tmp_path}: ") and "; a checkpoint needs about 2.0 MB;" in line
