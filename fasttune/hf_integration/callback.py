"""FastPatchCallback: fasttune's patches on any existing Trainer (transformers or TRL) run."""

from __future__ import annotations

import inspect
import logging
import sys

from transformers import Trainer, TrainerCallback

from ..config import FastConfig, resolve_checkpointing
from ..model_patches import PatchReport, patch_model, patch_report
from .call_counts import CallCounts
from .collector import FrozenCollector

logger = logging.getLogger("fasttune")
_MAX_FRAMES = 12  # calling_trainer: callback method, call_event, on_<event>, the Trainer's method, subclasses


class FastPatchCallback(TrainerCallback):
    """Patches the trainer's model when the trainer finishes ``__init__``.

    Works on ``transformers.Trainer`` and TRL's trainers (``SFTTrainer``, ``DPOTrainer``,
    ``GRPOTrainer``...): those call ``model(..., fused_lm_head=True)``, which the patched head
    answers with fasttune's kernel. TRL installs its own head after ``on_init_end`` and, under
    fp16/bf16, accelerate wraps the forward before ``on_train_begin``: there fasttune's head goes back
    on top (``trl.attach_trl_head``), and a separate reference model of the trainer is patched
    (``trl.patch_reference``). The reports are kept on ``self.report`` / ``self.ref_report`` and
    logged, with the run-time counts after the first optimizer step (``CallCounts``).

    Args:
        config: which fast paths to take; ``FastConfig()`` when None.
    """

    def __init__(self, config: FastConfig | None = None):
        self.config = FastConfig.coerce(config, "config")
        self.report: PatchReport | None = None
        self.ref_report: PatchReport | None = None
        self.call_counts = CallCounts()
        self.collector = FrozenCollector(self.config.gc_freeze)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            logger.warning("fasttune: FastPatchCallback got no model at on_init_end; nothing patched")
            return control
        # Same mapping as FastTrainer: the Trainer's checkpointing flag becomes fasttune's
        # checkpointer; train() has not run yet, so clearing the flag stops HF wrapping layers too.
        self.config = resolve_checkpointing(args, self.config)
        self.report = patch_model(model, self.config)
        self.call_counts.reports["model"] = self.report  # patch_model logged it (once per model)
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
            self._patch_reference(args, state)
        self.collector.enabled = self.config.gc_freeze
        self.collector.on_train_begin(args, state, control)
        return self.call_counts.on_train_begin(args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        self.collector.on_step_end(args, state, control)
        return self.call_counts.on_step_end(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        return self.collector.on_train_end(args, state, control)

    def _patch_reference(self, args, state) -> None:
        """Patch the separate reference model of a TRL trainer (set in its ``__init__`` after
        ``on_init_end``, so only the trainer itself knows it)."""
        from .trl import patch_reference, trl_head_settings

        if trl_head_settings(args, reference=True) is None:
            return  # a trainer without a reference model
        trainer = calling_trainer(self)
        if trainer is None:
            logger.warning("fasttune: FastPatchCallback found no Trainer calling it; a separate reference "
                           "model, if the trainer has one, stays stock")
            return
        ref = getattr(trainer, "ref_model", None)
        if ref is None or (self.ref_report is not None and patch_report(ref) is self.ref_report):
            return  # PEFT (the policy without its adapters) or no reference; or patched at an earlier train()
        self.ref_report = patch_reference(ref, args, self.config)
        self.call_counts.reports["reference model"] = self.ref_report


def calling_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose event is running ``callback`` now, found on the call stack; None if none is.

    Callback events get the model, not the trainer, and TRL sets a trainer's ``ref_model`` after
    ``on_init_end``. The Trainer's own methods call the events (``CallbackHandler.call_event`` in
    between), so the trainer is the ``self`` of a frame a few levels up that holds this callback.
    """
    frame = inspect.currentframe()  # None on Pythons without frame support
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in getattr(owner.callback_handler, "callbacks", ()):
            return owner
        frame = frame.f_back
    return None
