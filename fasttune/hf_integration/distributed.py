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
  layers a second time: ``release_fsdp_checkpointing`` leaves the layers to fasttune. LoRA layers
  (adapters over a frozen base) are all-gathered once per step instead of two or three times when
  their unsharded weights fit (``keep_adapter_layers_gathered``, at train begin).
- DeepSpeed ZeRO-3: parameters are gathered only around the forward (and backward) of a module
  that owns them or registered them. ``register_zero3_lm_head`` registers lm_head's parameters as
  external parameters of the causal LM, whose forward computes the fused loss; until then (and if
  it fails) the head takes the stock path, which is exact. (The head does not lean on DeepSpeed
  registering a parameter it sees read during the engine's forward: that gathers it without
  keeping it gathered, and a tied weight is released again after the embedding's forward.)
  Fused LoRA reads the projections' weights inside the attention / MLP forward, skipping the
  projections' own forwards and DeepSpeed's hooks on them: ``register_zero3_fused_lora`` makes
  those parameters external parameters of the attention / MLP, gathered around its forward and
  backward (inside the engine's forward DeepSpeed also discovers and registers them on first
  read); a call whose weights are not gathered for it takes PEFT's path (``model_patches/zero3.py``).
  Frozen parameters (a LoRA base) that fit are kept gathered from their first use in a step to the
  optimizer step (``keep_frozen_gathered_zero3``): one all-gather each per step.
  Tested on DeepSpeed's CPU accelerator (tests/test_distributed.py): LoRA (fused) and full
  fine-tuning, tied embeddings, a model partitioned before or after patching, loss, gradients
  and AdamW steps equal to one process.

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
from ..model_patches.zero3 import is_zero3_param

logger = logging.getLogger("fasttune")

NONE, DTENSOR, FSDP1, ZERO3 = "none", "dtensor", "fsdp1", "zero3"
GIB = 1 << 30


def sharding_kind(model: nn.Module) -> str:
    """How ``model``'s parameters are split over ranks.

    Returns:
        "zero3" (DeepSpeed ZeRO-3 partitions), "dtensor" (FSDP2 ``fully_shard`` or tensor
        parallelism), "fsdp1" (a ``FullyShardedDataParallel`` wrapper) or "none" (DDP, one process).
    """
    dtensor = _dtensor_class()
    for p in model.parameters():
        if is_zero3_param(p):
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

def fsdp_launch() -> bool:
    """True under ``accelerate launch`` with an FSDP config (accelerate's own variable)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def fsdp_checkpointing_requested(args) -> bool:
    """True when FSDP's own activation checkpointing is on (``fsdp_config`` or accelerate's config)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    if plugin_args.get("activation_checkpointing"):
        return True
    if getattr(args, "fsdp", None) and (getattr(args, "fsdp_config", None) or {}).get("activation_checkpointing"):
        return True
    return fsdp_launch() and os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"


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


GATHER_FROZEN_FRACTION = 0.9   # a unit is "adapter-only" when at least this share of its elements is frozen
GATHER_MEMORY_SHARE = 0.5      # "auto": kept-gathered layers may take at most this share of the free GPU memory


def keep_adapter_layers_gathered(model: nn.Module, config: FastConfig) -> int:
    """FSDP2: keep the weights of adapter-only units all-gathered from their forward to their backward.

    A LoRA/QLoRA unit (a decoder layer) is resharded after its forward by default, so one training
    step all-gathers its frozen base weights two or three times: in forward, again for the
    checkpoint recompute, and again for backward. With ``reshard_after_forward`` off
    (``FSDPModule.set_reshard_after_forward(False)``) it is gathered once per step and freed after
    its backward, at the cost of holding every such layer's unsharded weights at the end of
    forward (what DDP holds all the time). Gradients and optimizer states stay sharded.

    ``config.fsdp_reshard_after_forward``: True leaves FSDP's setting; False applies it to every
    unit below the root with adapters (trainable parameters) over at least 90% frozen elements;
    None ("auto") does so when the units' unsharded size (in the mixed-precision ``param_dtype``)
    is at most half of the GPU memory free now; never without CUDA. With ``checkpointing="auto"``, the memory the gathered
    layers will take is reserved from its activation budget. Call after the model was sharded
    (FastTrainer: at train begin).

    Returns:
        How many units now keep their weights gathered (0 when none or not FSDP2).
    """
    setting = config.fsdp_reshard_after_forward
    if setting is True or not torch.distributed.is_available():
        return 0
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model and _adapter_only(m)
             and _resharding_after_forward(m)]
    if not units:
        return 0
    gathered = sum(_unsharded_bytes(m) for m in units)
    local = sum(_local_bytes(m) for m in units)
    if setting is None:
        device = next(units[0].parameters()).device
        if device.type != "cuda":
            return 0
        free = smallest_free_gpu_memory(device)
        if gathered > GATHER_MEMORY_SHARE * free:
            logger.info("fasttune: FSDP2 layers reshard after forward (%.1f GiB unsharded > half of %.1f GiB free)",
                        gathered / GIB, free / GIB)
            return 0
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    _reserve_from_activation_budget(model, gathered - local)
    logger.info("fasttune: %d FSDP2 units keep their weights gathered from forward to backward (%.1f GiB "
                "unsharded): one all-gather per step", len(units), gathered / GIB)
    return len(units)


def smallest_free_gpu_memory(device: torch.device) -> int:
    """The least free memory of any rank's GPU. The keep-gathered choices are made with it: every rank
    must choose alike (ranks that gather differently issue different collectives and hang), and the
    GPUs of one job need not have the same memory free (another process's context on one of them)."""
    free = torch.cuda.mem_get_info(device)[0]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on = device if "nccl" in str(dist.get_backend()) else "cpu"
        t = torch.tensor([free], dtype=torch.int64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        free = int(t.item())
    return free


def _reserve_from_activation_budget(model: nn.Module, nbytes: int) -> None:
    """With ``checkpointing="auto"``: weights kept gathered take ``nbytes`` from its activation budget."""
    from ..model_patches.checkpointing import layer_checkpointing

    state = layer_checkpointing(model)
    if state is not None and state.policy is not None:
        state.policy.reserved_bytes = max(0, nbytes)


def _param_groups(unit) -> list:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per unit
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _resharding_after_forward(unit) -> bool:
    groups = _param_groups(unit)
    return bool(groups) and all(g.post_forward_mesh_info is not None for g in groups)


def _unit_params(unit) -> list:
    return [fp.sharded_param for g in _param_groups(unit) for fp in g.fsdp_params]


def _adapter_only(unit) -> bool:
    params = _unit_params(unit)
    total = sum(p.numel() for p in params)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    # A fully frozen unit (embeddings under LoRA) has no backward to gather for: nothing to save.
    return frozen < total and frozen >= GATHER_FROZEN_FRACTION * total


def _unsharded_bytes(unit) -> int:
    """Bytes of the unit's gathered parameters: global sizes, in the mixed-precision ``param_dtype``."""
    out = 0
    for g in _param_groups(unit):
        group_policy = getattr(g, "mp_policy", None)  # torch <= 2.14: one policy per group
        for fp in g.fsdp_params:
            # torch >= 2.15: the policy is resolved per parameter (FSDPParam.mp_policy)
            dtype = getattr(getattr(fp, "mp_policy", group_policy), "param_dtype", None)
            p = fp.sharded_param
            out += p.numel() * (dtype.itemsize if dtype is not None else p.element_size())
    return out


def _local_bytes(unit) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in _unit_params(unit))


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
    if not params or not all(is_zero3_param(p) for p in params):
        return False
    _register_external(base, params)
    return True


def _register_external(owner: nn.Module, params) -> None:
    """``deepspeed.zero.register_external_parameter(owner, p)`` for each of ``params`` not registered yet."""
    import deepspeed

    external = getattr(owner, "ds_external_parameters", None)
    known = {id(q) for _, q in external()} if callable(external) else set()
    for p in params:
        if id(p) not in known:
            deepspeed.zero.register_external_parameter(owner, p)


def register_zero3_fused_lora(model: nn.Module) -> int:
    """Let fused LoRA run under ZeRO-3: the projections' parameters become external parameters of
    the attention / MLP module whose fused forward reads them.

    DeepSpeed then gathers the base weights and the adapters around that module's forward and its
    backward (where the fused Functions' backward reads them again), and reduce-scatters the
    adapters' gradients as usual; the projections' own forwards, and their hooks, are skipped.
    Costs no more memory than PEFT's path at the peak (one attention's or MLP's weights at a time,
    plus what DeepSpeed prefetches). Call after the parameters were partitioned, like
    ``register_zero3_lm_head``; ``model`` may be the ``DeepSpeedEngine``.

    Returns:
        How many attention / MLP modules had parameters registered (0 when not ZeRO-3).
    """
    from ..model_patches.lora import fused_lora_projections

    owners = [(owner, [p for proj in projections for p in proj.parameters() if is_zero3_param(p)])
              for owner, projections in fused_lora_projections(_unwrap_engine(model))]
    owners = [(owner, params) for owner, params in owners if params]
    for owner, params in owners:
        _register_external(owner, params)
    return len(owners)


def keep_frozen_gathered_zero3(model: nn.Module, config: FastConfig) -> int:
    """ZeRO-3: keep the frozen parameters (a LoRA/QLoRA base) gathered from their first use in a step
    until the optimizer step.

    DeepSpeed all-gathers a module's partitioned parameters around its forward and again around its
    backward (fasttune's checkpoint recompute is a third forward), on the step's critical path, and
    frees them after each. Marked ``ds_persist``, a parameter is left gathered by DeepSpeed's
    coordinator once its trace of the step is complete (from the second step on) until the optimizer
    step partitions every parameter: each frozen weight is then all-gathered once per step, and the
    per-module gathers carry only the adapters. The cost is DDP's memory at the end of forward: each
    GPU holds those weights whole. Trainable parameters are never marked here: they change at every
    step, and DeepSpeed gathers its persistent parameters again after the step only when it chose
    them itself at initialisation (``stage3_param_persistence_threshold``).

    ``config.zero3_keep_frozen_gathered``: False leaves DeepSpeed's setting; True marks them; None
    ("auto") marks them when their whole size is at most half of the smallest free GPU memory among the
    ranks (``smallest_free_gpu_memory``) and DeepSpeed keeps their partitions on the GPU (not offloaded to
    the CPU); never without CUDA. With ``checkpointing="auto"``, their whole size less the local
    partitions is taken from its activation budget. Call on every rank after the parameters were
    partitioned and before the first step (FastTrainer: at train begin); ``model`` may be the engine.

    Returns:
        How many parameters were marked (0 when none, or not ZeRO-3).
    """
    setting = config.zero3_keep_frozen_gathered
    if setting is False:
        return 0
    module = _unwrap_engine(model)
    params = list({id(p): p for p in module.parameters()
                   if is_zero3_param(p) and not p.requires_grad and not getattr(p, "ds_persist", False)}.values())
    if not params:
        return 0
    whole = sum(p.ds_numel * p.element_size() for p in params)
    local = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params if p.ds_tensor is not None)
    if setting is None:
        if not torch.cuda.is_available():
            return 0
        offloaded = [p for p in params if p.ds_tensor is not None and p.ds_tensor.device.type != "cuda"]
        if offloaded:
            logger.info("fasttune: ZeRO-3 frozen parameters are offloaded to %s: DeepSpeed gathers them per module",
                        offloaded[0].ds_tensor.device.type)
            return 0
        free = smallest_free_gpu_memory(torch.device("cuda", torch.cuda.current_device()))
        if whole > GATHER_MEMORY_SHARE * free:
            logger.info("fasttune: ZeRO-3 gathers frozen parameters per module (%.1f GiB whole > half of %.1f GiB "
                        "free)", whole / GIB, free / GIB)
            return 0
    for p in params:
        p.ds_persist = True
    _reserve_from_activation_budget(module, whole - local)
    logger.info("fasttune: ZeRO-3 keeps %d frozen parameters (%.1f GiB whole) gathered from their first use in a "
                "step to the optimizer step: one all-gather each per step", len(params), whole / GIB)
    return len(params)


def _unwrap_engine(model: nn.Module) -> nn.Module:
    """The model inside a ``deepspeed.DeepSpeedEngine`` (by name: deepspeed is imported only when present)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


class DistributedHeadCallback(TrainerCallback):
    """At ``on_train_begin`` (after accelerate wrapped the model): ``register_zero3_lm_head``,
    ``register_zero3_fused_lora`` and ``keep_frozen_gathered_zero3`` under ZeRO-3,
    ``keep_adapter_layers_gathered`` under FSDP2."""

    def __init__(self, config: FastConfig | None = None):
        self.config = config or FastConfig()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            setup_sharded_model(model, self.config)
        return control


def setup_sharded_model(model: nn.Module, config: FastConfig) -> str:
    """What fasttune adjusts once the model is sharded (train begin); returns ``sharding_kind``."""
    kind = sharding_kind(model)
    if kind == ZERO3:
        if register_zero3_lm_head(model):
            logger.info("fasttune: ZeRO-3 lm_head registered with the causal LM; the fused loss sees it whole")
        n = register_zero3_fused_lora(model)
        if n:
            logger.info("fasttune: ZeRO-3 LoRA projections registered with %d attention/MLP modules: "
                        "fused LoRA runs", n)
        keep_frozen_gathered_zero3(model, config)
    elif kind == DTENSOR:
        keep_adapter_layers_gathered(model, config)
    return kind


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


__all__ = ["DistributedHeadCallback", "fsdp_checkpointing_requested", "gathered_weights",
           "keep_adapter_layers_gathered", "keep_frozen_gathered_zero3", "register_zero3_fused_lora",
           "register_zero3_lm_head", "release_fsdp_checkpointing", "set_ddp_defaults", "setup_sharded_model",
           "sharding_kind", "smallest_free_gpu_memory"]
