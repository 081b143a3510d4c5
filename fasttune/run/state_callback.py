"""RunStateCallback: the run folder's live state and log, written by the Trainer at each log step."""

from __future__ import annotations

from transformers import TrainerCallback

from .folder import RunFolder, is_main_process
from .stop import StopSignal


class RunStateCallback(TrainerCallback):
    """Writes ``log_history.jsonl`` and ``state.json`` at each log step; honours a stop request.

    Args:
        folder: the run folder.
        stop: the run's signal handler; training stops at the end of the step after a signal.
    """

    def __init__(self, folder: RunFolder, stop: StopSignal) -> None:
        self.folder = folder
        self.stop = stop

    def on_train_begin(self, args, state, control, **kw):
        self.stop.in_loop = True
        self.folder.write_state(status="running", step=0, max_steps=state.max_steps)

    def on_log(self, args, state, control, logs=None, **kw):
        if not is_main_process():
            return
        logs = dict(logs or {}, step=state.global_step)
        self.folder.append_log(logs)
        curve = self.folder.read_state().get("loss", [])
        if "loss" in logs:
            curve.append([state.global_step, float(logs["loss"])])
        self.folder.write_state(step=state.global_step, max_steps=state.max_steps, epoch=state.epoch, loss=curve,
                                last_log={k: v for k, v in logs.items() if isinstance(v, (int, float))})

    def on_step_end(self, args, state, control, **kw):
        if self.stop.requested:
            control.should_training_stop = True
        return control
