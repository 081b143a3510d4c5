"""A run's failure, told well: the traceback to train.log only, one line for an OS error.

``explain_failure`` names what was being written when the disk filled (the checkpoint folder
being saved, ``final/``, or the run folder, from the state's ``phase``) and about how much space it
needs: the size of a complete checkpoint of the run, else ``checkpoint_bytes`` of the model
(recorded in the state when the model loads).
"""

from __future__ import annotations

import logging

from .folder import RunFolder
from .os_errors import explain

# The traceback of a failure goes to train.log only; the console gets one line for known errors.
trace = logging.getLogger("fasttune.runner.traceback")
trace.propagate = False


class LogFile(logging.FileHandler):
    """train.log; on a full disk it stops writing instead of printing a traceback per record."""

    def handleError(self, record) -> None:  # noqa: N802 - logging's name
        self.setLevel(logging.CRITICAL + 1)


def explain_failure(e: BaseException, folder: RunFolder) -> str | None:
    """One line for an OS error (disk full: the path being written and the space needed), else None."""
    from .checkpoints import checkpoints, incomplete_reason

    state = folder.read_state()
    phase = state.get("phase")
    where, what = folder.path, ""
    if phase == "training":  # a checkpoint being saved, else the state or the log (the need: a checkpoint's)
        saving = [c for _, c in checkpoints(folder.path) if incomplete_reason(c) is not None]
        where, what = (saving[-1] if saving else folder.path), "a checkpoint"
    elif phase == "saving":
        where, what = folder.final, "the final model"
    done = [sum(f.stat().st_size for f in c.rglob("*") if f.is_file()) for _, c in checkpoints(folder.path)
            if incomplete_reason(c) is None]
    need = max(done) if done and what == "a checkpoint" else state.get("checkpoint_bytes")
    line = explain(e, where, need, what)
    if line and phase == "training" and done:
        line += "; then `fasttune train --resume` continues from the last complete checkpoint"
    return line


def checkpoint_bytes(model) -> int:
    """About the size of one checkpoint: the saved weights (the adapter, or every weight) and AdamW's two
    fp32 states per trainable weight."""
    from peft import PeftModel

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved = trainable if isinstance(model, PeftModel) else params
    return sum(p.numel() * p.element_size() for p in saved) + sum(8 * p.numel() for p in trainable)
