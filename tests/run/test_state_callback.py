"""RunStateCallback: the loss curve and log lines in the run folder, and a stop request honoured."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fasttune.run.folder import RunFolder, read_state
from fasttune.run.state_callback import RunStateCallback
from fasttune.run.stop import StopSignal


def test_state_callback_records_logs_and_honours_a_stop(tmp_path):
    stop = StopSignal()
    cb = RunStateCallback(RunFolder(tmp_path), stop)
    state = SimpleNamespace(max_steps=10, global_step=0, epoch=0.0)
    control = SimpleNamespace(should_training_stop=False)
    cb.on_train_begin(None, state, control)
    assert stop.in_loop and read_state(tmp_path)["status"] == "running"
    for step, loss in ((2, 3.5), (4, 2.5)):
        state.global_step, state.epoch = step, step / 10
        cb.on_log(None, state, control, logs={"loss": loss, "learning_rate": 1e-3, "note": "x"})
    cb.on_log(None, state, control, logs={"train_runtime": 1.5})
    saved = read_state(tmp_path)
    assert saved["loss"] == [[2, 3.5], [4, 2.5]] and saved["step"] == 4 and saved["max_steps"] == 10
    assert saved["last_log"] == {"train_runtime": 1.5, "step": 4}
    lines = [json.loads(x) for x in (tmp_path / "log_history.jsonl").read_text().splitlines()]
    assert [x.get("loss") for x in lines] == [3.5, 2.5, None] and lines[0]["note"] == "x"
    cb.on_step_end(None, state, control)
    assert control.should_training_stop is False
    stop.requested = True
    cb.on_step_end(None, state, control)
    assert control.should_training_stop is True


def test_eval_losses_form_their_own_curve_and_saves_are_marked_complete(tmp_path):
    from fasttune.run.checkpoints import incomplete_reason

    cb = RunStateCallback(RunFolder(tmp_path), StopSignal())
    state = SimpleNamespace(max_steps=10, global_step=3, epoch=0.3, is_world_process_zero=True)
    args, control = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(should_training_stop=False)
    cb.on_train_begin(args, state, control)
    assert read_state(tmp_path)["step"] == 3  # a resumed run starts at its checkpoint's step
    cb.on_log(args, state, control, logs={"loss": 2.0})
    cb.on_log(args, state, control, logs={"eval_loss": 2.5})
    saved = read_state(tmp_path)
    assert saved["loss"] == [[3, 2.0]] and saved["eval_loss"] == [[3, 2.5]]
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "optimizer.pt").write_bytes(b"x")
    cb.on_save(args, state, control)
    assert incomplete_reason(ckpt) is None and read_state(tmp_path)["last_checkpoint"] == "checkpoint-3"
