"""Multi-GPU runs through accelerate: what fasttune adjusts for DDP, FSDP2 and DeepSpeed ZeRO-3.

The patched forwards need no distributed code of their own in two of the three modes:

- DDP: DDP's forward is the patched model's; every rank holds whole weights, so the fused loss
  reads ``lm_head.weight`` directly. fasttune's checkpointing is non-reentrant, so a parameter is
  marked ready once per backward whatever ``find_unused_parameters`` is; with fasttune
  checkpointing, ``ddp_find_unused_parameters`` left None becomes False, the value transformers
  picks under its own checkpointing (``set_ddp_defaults``): no extra graph traversal per step.
- FSDP2 (``fully_shard``, accelerate's FSDP plugin v2): norms, attention, MLP and LoRA run inside
  their unit's forward and read its unsharded parameters (in the mixed-precision policy's
  ``param_dtype``). The loss head reads ``lm_head.weight`` outside lm_head's own forward, so the
  patched head unshards lm_head's unit itself (``model_patches/head.py``); the root's post-backward
  reduce-scatters its gradient. accelerate's ``activation_checkpointing`` would wrap the decoder
  layers a second time: ``release_fsdp_checkpointing`` leaves the layers to fasttune.
- DeepSpeed ZeRO-3: parameters are gathered only around the forward (and backward) of a module
  that owns them or registered them. ``register_zero3_lm_head`` registers lm_head's parameters as
  external parameters of the causal LM, whose forward computes the fused loss; until then (and if
  it fails) the head takes the stock path, which is exact. (The head does not lean on DeepSpeed
  registering a parameter it sees read during the engine's forward: that gathers it without
  keeping it gathered, and a tied weight is released again after the embedding's forward.)
  Tested on DeepSpeed's CPU accelerator (tests/test_distributed.py): LoRA and full fine-tuning,
  tied embeddings, a model partitioned before or after patching, loss, gradients and AdamW steps
  equal to one process. The fused LoRA path falls back under ZeRO-3 (its hooks sit on every
  projection), and the patch report says so only when the model was partitioned before patching.

Export and Hub uploads run on the main process, but a sharded model must first be gathered by
every rank: ``gathered_weights`` (FSDP2, FSDP1, ZeRO-3) is entered by all ranks around the export.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch
from torch import nn
from transformers import TrainerCallback

from ..config import FastConfig
from ..model_patches import find_causal_lm

logger = logging.getLogger("fasttune")

NONE, DTENSOR, FSDP1, ZERO3 = "none", "dtensor", "fsdp1", "zero3"


def sharding_kind(model: nn.Module) -> str:
    """How ``model``'s parameters are split over ranks.

    Returns:
        "zero3" (DeepSpeed ZeRO-3 partitions), "dtensor" (FSDP2 ``fully_shard`` or tensor
        parallelism), "fsdp1" (a ``FullyShardedDataParallel`` wrapper) or "none" (DDP, one process).
    """
    dtensor = _dtensor_class()
    for p in model.parameters():
        if hasattr(p, "ds_id"):
            return ZERO3
        if dtensor is not None and isinstance(p, dtensor):
            return DTENSOR
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return FSDP1
    return NONE


def _dtensor_class():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


# --- DDP -------------------------------------------------------------------------------------------

def set_ddp_defaults(args, config: FastConfig) -> bool | None:
    """Choose DDP's ``find_unused_parameters`` for a run that fasttune checkpoints.

    transformers passes ``find_unused_parameters = not model.is_activation_checkpointing`` when
    ``args.ddp_find_unused_parameters`` is None; fasttune's checkpointing leaves HF's flags off, so
    that would be True (an extra autograd-graph traversal each step, and a warning). With
    ``config.checkpointing`` set and the argument left None it becomes False, as transformers
    chooses under its own checkpointing; a value the user set is kept.

    Returns:
        The value set, or None when nothing changed.
    """
    if args is None or config.checkpointing is None or getattr(args, "ddp_find_unused_parameters", 0) is not None:
        return None
    args.ddp_find_unused_parameters = False
    return False


# --- FSDP ----------------------------------------------------------------------------------------

def fsdp_checkpointing_requested(args) -> bool:
    """True when FSDP's own activation checkpointing is on (``fsdp_config`` or accelerate's config)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    if plugin_args.get("activation_checkpointing"):
        return True
    if getattr(args, "fsdp", None) and (getattr(args, "fsdp_config", None) or {}).get("activation_checkpointing"):
        return True
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and \
        os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"


def release_fsdp_checkpointing(accelerator, config: FastConfig) -> bool:
    """Turn off the FSDP plugin's activation checkpointing when fasttune checkpoints the layers.

    accelerate would otherwise wrap each decoder layer in ``checkpoint_wrapper`` at ``prepare``,
    around fasttune's checkpointed forward: every layer recomputed twice. Call before ``prepare``.

    Returns:
        True when the plugin's flag was on and is now off.
    """
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if config.checkpointing is None or plugin is None or not getattr(plugin, "activation_checkpointing", False):
        return False
    plugin.activation_checkpointing = False
    logger.info("fasttune: FSDP activation_checkpointing off; fasttune's %r checkpointing wraps the decoder layers",
                config.checkpointing)
    return True


# --- DeepSpeed ZeRO-3 ------------------------------------------------------------------------------

def register_zero3_lm_head(model: nn.Module) -> bool:
    """Let the fused loss see ZeRO-3's lm_head weight.

    The loss runs in the causal LM's forward, not in lm_head's, so ZeRO-3 would leave lm_head's
    weight partitioned there. ``deepspeed.zero.register_external_parameter`` tells it to gather the
    weight (and bias) around the causal LM's forward and backward, where the patched head then finds
    it whole. (``GatheredParameters`` would not do: it re-partitions when its block ends, before
    backward, and gradients cannot reach a partitioned parameter through it.) Call after the
    parameters were partitioned (``zero.Init`` at load, or ``deepspeed.initialize``), before the
    first forward that should be fused; ``model`` may be the ``DeepSpeedEngine``.

    Returns:
        True when registered (or already); False when the weight is not a ZeRO-3 parameter.
    """
    base = find_causal_lm(_unwrap_engine(model))
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    params = [p for p in (getattr(head, "weight", None), getattr(head, "bias", None)) if p is not None]
    if not params or not all(hasattr(p, "ds_id") for p in params):
        return False
    import deepspeed

    external = getattr(base, "ds_external_parameters", None)
    known = [q for _, q in external()] if callable(external) else []
    for p in params:
        if not any(p is q for q in known):
            deepspeed.zero.register_external_parameter(base, p)
    return True


def _unwrap_engine(model: nn.Module) -> nn.Module:
    """The model inside a ``deepspeed.DeepSpeedEngine`` (by name: deepspeed is imported only when present)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


class DistributedHeadCallback(TrainerCallback):
    """At ``on_train_begin`` (after accelerate wrapped the model): ``register_zero3_lm_head``."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and sharding_kind(model) == ZERO3:
            if register_zero3_lm_head(model):
                logger.info("fasttune: ZeRO-3 lm_head registered with the causal LM; the fused loss sees it whole")
        return control


# --- export --------------------------------------------------------------------------------------

@contextlib.contextmanager
def gathered_weights(model: nn.Module, is_main: bool, to_cpu: bool = True) -> Iterator[nn.Module]:
    """Whole weights on the main process for the duration of the block (export, Hub upload).

    Collective: every rank must enter it, in the same order. DDP / one process: nothing to do.
    FSDP2 (DTensor parameters): each is gathered with ``full_tensor`` (the fp32 master, not the
    mixed-precision copy) and, on the main process only, put in place of the shard as a plain
    parameter (on the CPU with ``to_cpu``; tied parameters stay tied); the shards are put back at
    the end. FSDP1: ``summon_full_params(rank0_only=True)``. ZeRO-3:
    ``deepspeed.zero.GatheredParameters`` over every parameter: the whole model in its training
    dtype on every rank's device for the block (``to_cpu`` does not apply), partitioned again after.

    Args:
        model: the trained (possibly wrapped) model.
        is_main: whether this is the process that exports (``trainer.is_world_process_zero()``).
        to_cpu: gather FSDP2 weights into host memory (no GPU peak on the main process).

    Yields:
        ``model``, whose parameters are whole on the main process.
    """
    kind = sharding_kind(model)
    if kind == ZERO3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield model
        return
    if kind == FSDP1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=to_cpu):
            yield model
        return
    if kind == NONE:
        yield model
        return
    swapped = _swap_in_full(model, is_main, to_cpu)
    try:
        yield model
    finally:
        for module, name, shard in reversed(swapped):
            setattr(module, name, shard)


def _swap_in_full(model: nn.Module, is_main: bool, to_cpu: bool) -> list[tuple[nn.Module, str, nn.Parameter]]:
    dtensor = _dtensor_class()
    whole: dict[int, nn.Parameter | None] = {}
    swapped = []
    with torch.no_grad():
        for module in model.modules():  # the same order on every rank: the gathers pair up
            for name, p in list(module._parameters.items()):
                if p is None or not isinstance(p, dtensor):
                    continue
                if id(p) not in whole:
                    full = p.full_tensor()
                    whole[id(p)] = nn.Parameter(full.cpu() if to_cpu else full, requires_grad=p.requires_grad) \
                        if is_main else None
                if is_main:
                    swapped.append((module, name, p))
                    setattr(module, name, whole[id(p)])
    return swapped


__all__ = ["DistributedHeadCallback", "fsdp_checkpointing_requested", "gathered_weights", "register_zero3_lm_head",
           "release_fsdp_checkpointing", "set_ddp_defaults", "sharding_kind"]
