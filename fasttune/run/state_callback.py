"""RunStateCallback: the run folder's live state and log, written by the Trainer at each log step."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from .checkpoints import write_marker
from .folder import RunFolder, is_main_process
from .stop import StopSignal


class RunStateCallback(TrainerCallback):
    """Writes ``log_history.jsonl`` and ``state.json`` at each log step (the loss and eval-loss
    curves), marks each checkpoint complete once the Trainer has saved it (``checkpoints.py``), and
    honours a stop request.

    Args:
        folder: the run folder.
        stop: the run's signal handler; training stops at the end of the step after a signal.
    """

    def __init__(self, folder: RunFolder, stop: StopSignal) -> None:
        self.folder = folder
        self.stop = stop

    def on_train_begin(self, args, state, control, **kw):
        self.stop.in_loop = True
        # global_step is the checkpoint's step on resume
        self.folder.write_state(status="running", phase="training", step=state.global_step, max_steps=state.max_steps)

    def on_log(self, args, state, control, logs=None, **kw):
        if not is_main_process():
            return
        logs = dict(logs or {}, step=state.global_step)
        self.folder.append_log(logs)
        saved = self.folder.read_state()
        curves = {}
        for key, curve in (("loss", "loss"), ("eval_loss", "eval_loss")):
            if key in logs:
                points = [p for p in saved.get(curve, []) if p[0] != state.global_step]
                curves[curve] = [*points, [state.global_step, float(logs[key])]]
        self.folder.write_state(step=state.global_step, max_steps=state.max_steps, epoch=state.epoch, **curves,
                                last_log={k: v for k, v in logs.items() if isinstance(v, (int, float))})

    def on_save(self, args, state, control, **kw):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                write_marker(folder, state.global_step)
                self.folder.write_state(last_checkpoint=folder.name)

    def on_step_end(self, args, state, control, **kw):
        if self.stop.requested:
            control.should_training_stop = True
        return control
