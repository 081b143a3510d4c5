"""TRL's trainers on the fast path: FastSFTTrainer, FastDPOTrainer, FastGRPOTrainer, FastKTOTrainer,
FastRLOOTrainer, and the TRL head settings FastPatchCallback needs.

TRL (≥ 1.15) installs its own chunked fused LM head in each trainer's ``__init__``, after the
Trainer's ``on_init_end``, and then asks ``model(..., labels=..., fused_lm_head=True)`` for per-token
log-probabilities. A Fast*Trainer patches the model after TRL's ``__init__``, so fasttune's head sits
on top and answers those calls with its kernels, under the temperature and outputs TRL configured
(read from the trainer's config, ``trl_head_settings``). The reference model, when the trainer holds
a separate one, is patched too (no checkpointing; its head computes log-probabilities only). With
PEFT the reference is the policy with its adapters disabled: the same patched head serves both.

Under fp16/bf16 mixed precision, accelerate wraps a model's forward in autocast when the trainer
prepares it (the reference model in TRL's ``__init__``, the policy in ``train()``). A fasttune head
installed over that wrapper afterwards (the reference here, the policy by ``FastPatchCallback``)
runs its calls under the same autocast (``trl_head_autocast``), as they would have run below it.

Everything else is FastTrainer's: kernels, the Trainer's checkpointing flag as fasttune's
checkpointer, throughput in the logs, export and push at the end of ``train()``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping

import torch
import trl

from ..config import FastConfig, resolve_checkpointing
from ..model_patches import PatchReport, find_causal_lm, patch_model, patch_report
from ..model_patches.head import TrlHeadSettings, configure_trl_head, head_forward, install_trl_head
from ..model_patches.report import describe_forward
from ..model_patches.trl_head import provides_fused_head
from .throughput import ThroughputMeter
from .distributed import set_ddp_defaults
from .trainer import FastTrainerMixin

logger = logging.getLogger("fasttune")


def trl_head_settings(args, reference: bool = False) -> TrlHeadSettings | None:
    """The settings TRL's trainer for ``args`` gives ``add_fused_lm_head`` (TRL 1.15/1.16).

    Args:
        args: the trainer's config (``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``KTOConfig``,
            ``RLOOConfig`` or a subclass).
        reference: the settings of the separate reference model's head instead of the policy's.

    Returns:
        The settings, or None for a config whose trainer is not known here (its head stays TRL's).
    """
    if isinstance(args, (trl.GRPOConfig, trl.RLOOConfig)):
        fp32 = bool(getattr(args, "cast_lm_head_to_fp32", False))
        outputs = ("log_probs",) if reference else ("log_probs", "entropy")
        # GRPO back-propagates the entropy for its entropy bonus.
        return TrlHeadSettings(args.temperature, outputs, entropy_grad=True, fp32_head=fp32)
    if reference and isinstance(args, (trl.DPOConfig, trl.KTOConfig)):
        return TrlHeadSettings(1.0, ("log_probs",), entropy_grad=False)
    if isinstance(args, trl.DPOConfig):
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
        if getattr(args, "use_weighting", False):
            outputs += ("log_sum_sq_probs",)
        return TrlHeadSettings(1.0, outputs, entropy_grad=False)
    if isinstance(args, trl.KTOConfig):
        return TrlHeadSettings(1.0, ("log_probs", "entropy", "mean_logits"), entropy_grad=False)
    if isinstance(args, trl.SFTConfig) and not reference:
        return TrlHeadSettings(1.0, ("log_probs", "entropy", "is_top1"), entropy_grad=False)
    return None


def trl_head_autocast(base):
    """When ``base.forward`` is accelerate's mixed-precision wrapper around TRL's fused head: a
    callable returning the autocast context the wrapper enters. Else None.

    ``Accelerator.prepare_model`` under fp16/bf16 replaces ``model.forward`` by autocast + outputs
    to fp32 around it and keeps the forward it wrapped as ``model._original_forward`` (what
    accelerate's own ``unwrap_model`` reads); the context is ``get_mixed_precision_context_manager``'s,
    read from the accelerator state at each call as the wrapper's was at prepare time.
    """
    from accelerate.utils import get_mixed_precision_context_manager

    current, inner = base.__dict__.get("forward"), base.__dict__.get("_original_forward")
    if current is None or inner is None or current is inner or not provides_fused_head(inner):
        return None
    return functools.partial(get_mixed_precision_context_manager, True)


def attach_trl_head(model, args, config: FastConfig | None = None) -> bool:
    """Make fasttune's head answer TRL's ``fused_lm_head=True`` calls on a model ``patch_model``
    patched before TRL installed its head (``FastPatchCallback``: call from ``on_train_begin``),
    also when accelerate has wrapped the forward for mixed precision since (``trl_head_autocast``).

    Returns:
        True when fasttune's head answers them; False leaves TRL's head answering (unknown
        config, head not patched, ``config.fused_logprobs`` off), which is always correct.
    """
    config = config or FastConfig()
    settings = trl_head_settings(args)
    report = patch_report(model)
    if settings is None or report is None or not config.fused_logprobs:
        return False
    base = find_causal_lm(model)
    attached = install_trl_head(base, settings, config, report, trl_head_autocast(base))
    if not attached:
        logger.warning("fasttune: TRL's fused LM head answers %s's log-probability calls, not fasttune's: "
                       "%s.forward is %s, neither fasttune's head nor TRL's over it", type(args).__name__,
                       type(base).__name__, describe_forward(base.__dict__.get("forward")))
    return attached


def patch_reference(ref_model, args, config: FastConfig) -> PatchReport:
    """Patch a TRL trainer's separate reference model and point its head at TRL's reference settings.

    No checkpointing: the reference only runs forward, under no_grad. TRL has already added its
    head and accelerate may have wrapped the forward for mixed precision: fasttune's head goes on
    top and runs under that wrapper's autocast (``trl_head_autocast``).

    Args:
        ref_model: the trainer's ``ref_model``.
        args: the trainer's config (its reference head settings, ``trl_head_settings``).
        config: fasttune's options.

    Returns:
        The reference model's PatchReport.
    """
    autocast = trl_head_autocast(find_causal_lm(ref_model))  # before patching: the wrapper is on top now
    report = patch_model(ref_model, dataclasses.replace(config, checkpointing=None))
    head = head_forward(find_causal_lm(ref_model))
    if head is not None:
        head.autocast = autocast
        if config.fused_logprobs:
            head.trl_settings = trl_head_settings(args, reference=True)
    return report


class _TrlThroughput(ThroughputMeter):
    """Token counts of TRL batches: GRPO/RLOO train on raw prompts, counted once generated."""

    def count(self, inputs) -> None:
        if not isinstance(inputs, Mapping):
            return
        if "prompt_mask" in inputs and "completion_mask" in inputs:
            inputs = {"attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)}
        super().count(inputs)


class FastTrlTrainerMixin(FastTrainerMixin):
    """FastTrainer's behaviour on a TRL trainer; mixed in before the TRL class.

    Subclasses set ``_args_position``: where ``args`` sits among the TRL trainer's positional
    parameters (after ``model``, ``ref_model`` or ``reward_funcs``).
    """

    _args_position = 1

    def __init__(self, *args, fast_config: FastConfig | None = None, **kwargs):
        pos = self._args_position
        training_args = kwargs.get("args", args[pos] if len(args) > pos else None)
        self.fast_config = resolve_checkpointing(training_args, FastConfig.coerce(fast_config, "fast_config"))
        set_ddp_defaults(training_args, self.fast_config)
        super().__init__(*args, **kwargs)
        self._fast_after_init()

    def _fast_after_init(self) -> None:
        smoother = getattr(self, "label_smoother", None)
        super()._fast_after_init()
        # TRL's trainers use label smoothing their own way (SFT: on the full logits): keep theirs.
        self.label_smoother = smoother
        head = head_forward(find_causal_lm(self.model))
        if head is not None:
            head.label_smoothing = 0.0
        self._throughput = _TrlThroughput()
        self.ref_patch_report = None
        settings = trl_head_settings(self.args) if self.fast_config.fused_logprobs else None
        if settings is None or not configure_trl_head(find_causal_lm(self.model), settings):
            # Asked for (fused_logprobs on) but not possible: say so loudly; the run-time counts will too.
            logger.log(logging.WARNING if self.fast_config.fused_logprobs else logging.INFO,
                       "fasttune: TRL's own fused LM head answers %s's log-probability calls", type(self).__name__)
        ref = getattr(self, "ref_model", None)
        if ref is not None:
            self.ref_patch_report = patch_reference(ref, self.args, self.fast_config)
            self._call_counts.reports["reference model"] = self.ref_patch_report

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.fast_config.log_throughput and model.training and "prompt_mask" in inputs:
            self._throughput.count(inputs)  # GRPO/RLOO: the generated batch
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class FastSFTTrainer(FastTrlTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` on fasttune's kernels: the loss and the entropy/accuracy metrics come
    from the fused head without logits. Label smoothing stays on TRL's full-logits path.

    Args:
        *args: as for ``trl.SFTTrainer``.
        fast_config: fasttune options; ``FastConfig()`` when None.
        **kwargs: as for ``trl.SFTTrainer``.
    """


class FastDPOTrainer(FastTrlTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` on fasttune's kernels, policy and (separate) reference model alike.

    Args: as for ``trl.DPOTrainer``, plus ``fast_config`` (``FastConfig()`` when None).
    """

    _args_position = 2


class FastGRPOTrainer(FastTrlTrainerMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` on fasttune's kernels: log-probabilities and the (differentiable) entropy
    at the sampling temperature, without logits. Generation is the model's stock forward.

    Args: as for ``trl.GRPOTrainer``, plus ``fast_config`` (``FastConfig()`` when None).
    """

    _args_position = 2


class FastKTOTrainer(FastTrlTrainerMixin, trl.KTOTrainer):
    """``trl.KTOTrainer`` on fasttune's kernels.

    Args: as for ``trl.KTOTrainer``, plus ``fast_config`` (``FastConfig()`` when None).
    """

    _args_position = 2


class FastRLOOTrainer(FastTrlTrainerMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` on fasttune's kernels.

    Args: as for ``trl.RLOOTrainer``, plus ``fast_config`` (``FastConfig()`` when None).
    """

    _args_position = 2


__all__ = ["FastDPOTrainer", "FastGRPOTrainer", "FastKTOTrainer", "FastRLOOTrainer", "FastSFTTrainer",
           "FastTrlTrainerMixin", "attach_trl_head", "patch_reference", "trl_head_autocast", "trl_head_settings"]
