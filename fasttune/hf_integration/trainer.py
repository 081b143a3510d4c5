"""FastTrainer: ``transformers.Trainer`` with fasttune's patches, fused loss and throughput logs."""

from __future__ import annotations

import logging

from transformers import Trainer
from transformers.trainer_pt_utils import LabelSmoother

from ..config import FastConfig, resolve_checkpointing
from ..model_patches import find_causal_lm, patch_model
from ..model_patches.head import head_forward
from .call_counts import CallCounts
from .collector import FrozenCollector
from .distributed import DistributedHeadCallback, gathered_weights, release_fsdp_checkpointing, set_ddp_defaults
from .throughput import ThroughputMeter
from .train_end import check_export_before_training, export_after_training

logger = logging.getLogger("fasttune")


class FastTrainerMixin:
    """What makes a Trainer (transformers' or TRL's) a fasttune trainer; mixed in before the
    Trainer class. Subclasses call ``_fast_before_init`` before and ``_fast_after_init`` after
    the Trainer's ``__init__``."""

    fast_config: FastConfig

    def _fast_before_init(self, args, kwargs, fast_config: FastConfig | None) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.fast_config = resolve_checkpointing(training_args, FastConfig.coerce(fast_config, "fast_config"))
        set_ddp_defaults(training_args, self.fast_config)  # before the Trainer builds its DDP kwargs

    def _fast_after_init(self) -> None:
        check_export_before_training(self.model, self.fast_config)  # not after hours of training
        self.patch_report = patch_model(self.model, self.fast_config)  # logged there, once per model
        head = head_forward(find_causal_lm(self.model))
        if head is not None and getattr(self, "label_smoother", None) is not None:
            # Same math as HF's LabelSmoother, inside the fused kernel: the logits stay unmaterialised.
            head.label_smoothing = float(self.label_smoother.epsilon)
            self.label_smoother = None
        release_fsdp_checkpointing(self.accelerator, self.fast_config)  # before prepare(): layers are ours
        self.add_callback(DistributedHeadCallback(self.fast_config))  # ZeRO-3 head, FSDP2 gathered layers
        self._call_counts = CallCounts({"model": self.patch_report})  # what ran fused, after the first step
        self.add_callback(self._call_counts)
        self._collector = FrozenCollector(self.fast_config.gc_freeze)  # after the first step: gc.freeze()
        self.add_callback(self._collector)
        self._throughput = ThroughputMeter()

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.fast_config.log_throughput:
            self._throughput.count(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.fast_config.log_throughput and "loss" in logs:
            logs.update(self._throughput.read())
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        head = head_forward(find_causal_lm(model))
        if head is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        # Label smoothing moved into the fused head (_fast_after_init) serves training forwards only;
        # an eval forward takes the stock head, so give the Trainer its LabelSmoother back for this
        # step: eval_loss is then smoothed, exactly as a stock Trainer's.
        saved_smoother, saved_logits = self.label_smoother, head.return_logits
        if saved_smoother is None and head.label_smoothing > 0:
            self.label_smoother = LabelSmoother(epsilon=head.label_smoothing)
        if not prediction_loss_only:
            head.return_logits = True  # compute_metrics needs logits even from a model left in training mode
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self.label_smoother, head.return_logits = saved_smoother, saved_logits

    def train(self, *args, **kwargs):
        try:
            output = super().train(*args, **kwargs)
        finally:
            self._collector.thaw()  # on_train_end does it too, but not when train() raises
        cfg = self.fast_config
        if cfg.export_artifacts or cfg.push_to_hub:
            with gathered_weights(self.model, self.is_world_process_zero()):  # every rank: FSDP/ZeRO-3 gather
                export_after_training(self, cfg)
        return output


class FastTrainer(FastTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose model runs on fasttune's kernels.

    In ``__init__`` the model instance is patched (``patch_model``); the causal-LM loss is then
    the fused linear cross-entropy (``num_items_in_batch`` honoured, so gradient accumulation over
    micro-batches of different lengths gives the full-batch gradient), label smoothing included.
    The Trainer's activation/gradient checkpointing flag becomes fasttune's offloaded
    checkpointer. Each log line gains ``tokens_per_second`` and ``peak_memory_gib``. At the end of
    ``train()`` the artifacts in ``fast_config.export_artifacts`` are saved and, with
    ``push_to_hub``, pushed (main process only).

    Args:
        *args: as for ``transformers.Trainer``.
        fast_config: fasttune options: a FastConfig or a dict of its fields; ``FastConfig()`` when None.
        **kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args, fast_config: FastConfig | None = None, **kwargs):
        self._fast_before_init(args, kwargs, fast_config)
        super().__init__(*args, **kwargs)
        self._fast_after_init()
