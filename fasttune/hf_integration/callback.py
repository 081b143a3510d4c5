"""FastPatchCallback: fasttune's patches on any existing Trainer (transformers or TRL) run."""

from __future__ import annotations

import logging
import sys

from transformers import TrainerCallback

from ..config import FastConfig
from ..model_patches import PatchReport, patch_model

logger = logging.getLogger("fasttune")


class FastPatchCallback(TrainerCallback):
    """Patches the trainer's model when the trainer finishes ``__init__``.

    Works on ``transformers.Trainer`` and TRL's trainers (``SFTTrainer``, ``DPOTrainer``,
    ``GRPOTrainer``...): those call ``model(..., fused_lm_head=True)``, which the patched head
    answers with fasttune's kernel. The report is kept on ``self.report`` and logged.

    Args:
        config: which fast paths to take; ``FastConfig()`` when None.
    """

    def __init__(self, config: FastConfig | None = None):
        self.config = config or FastConfig()
        self.report: PatchReport | None = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            logger.warning("fasttune: FastPatchCallback got no model at on_init_end; nothing patched")
            return control
        # Same mapping as FastTrainer: the Trainer's checkpointing flag becomes fasttune's
        # checkpointer; train() has not run yet, so clearing the flag stops HF wrapping layers too.
        from .trainer import resolve_checkpointing

        self.config = resolve_checkpointing(args, self.config)
        self.report = patch_model(model, self.config)
        if state.is_world_process_zero:
            log_report(self.report)
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A model that arrived with HF's checkpointing switched on: take its layers back.
        from ..model_patches.checkpointing import layer_checkpointing

        from .distributed import setup_sharded_model

        if model is not None:  # ZeRO-3: lm_head registered for the fused loss; FSDP2: adapter layers kept gathered
            setup_sharded_model(model, self.config)
        ckpt = layer_checkpointing(model) if model is not None else None
        if ckpt is not None:
            ckpt.reclaim()
        # TRL adds its fused LM head after on_init_end, over ours: put ours back on top with TRL's settings.
        if model is not None and self.report is not None and "trl" in sys.modules:
            from .trl import attach_trl_head

            attach_trl_head(model, args, self.config)
        return control


def log_report(report: PatchReport) -> None:
    """Log the report: at WARNING when something stayed stock, else at INFO."""
    logger.log(logging.WARNING if report.fallbacks else logging.INFO, "%s", report)
