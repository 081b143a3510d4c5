"""The CUDA caching allocator in expandable segments while a patched model lives (process-wide).

Checkpointed training allocates working sets whose sizes change from layer to layer and from
forward to backward (a recomputed layer's activations, the loss head's chunks). In fixed segments
the allocator keeps the freed blocks it cannot reuse: at 131,072 tokens on one H200 a QLoRA step
held 28.3 GiB and reserved 56.4 GiB, and it is the reserve that runs out. Expandable segments map
physical pages into one growing virtual range per stream, so freed pages are reused whatever the
size asked next (torch's ``expandable_segments`` setting; Unsloth turns it on at import).

The switch is applied when a model is patched on a machine with CUDA, for allocations made from
then on. A user's own choice wins: ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` naming
``expandable_segments`` (either way) is left alone, so is a multi-process run (``WORLD_SIZE`` > 1:
NCCL and CUDA IPC buffers were not measured under the switch here), and ``FastConfig(cuda_expandable_segments=False)``
turns the switch off. Unpatching restores the previous setting.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ..config import FastConfig
from .families import FamilySpec
from .report import PatchReport

logger = logging.getLogger("fasttune")

OP = "expandable_segments"
SETTING = "expandable_segments"
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_holders = [0]  # patched models that hold the switch on; the last one unpatched turns it back off


def _release() -> None:
    _holders[0] -= 1
    if _holders[0] == 0:
        set_expandable(False)


def user_setting() -> str | None:
    """The environment variable that already decides expandable segments, if one does."""
    for name in ENV_VARS:
        if SETTING in os.environ.get(name, ""):
            return name
    return None


def current_settings() -> str:
    """The allocator's settings string as torch reports it ('' where this torch cannot say)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        return getter() if getter is not None else ""
    except RuntimeError:
        return ""


def set_expandable(on: bool) -> None:
    """Switch expandable segments for allocations made from now on."""
    value = f"{SETTING}:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:  # torch >= 2.9; torch.cuda.memory._set_allocator_settings is deprecated there
        setter(value)
    else:
        torch.cuda.memory._set_allocator_settings(value)


def use_expandable_segments(base: nn.Module, spec: FamilySpec | None, classes: dict, config: FastConfig,
                            report: PatchReport) -> None:
    """Patcher: turn expandable segments on (see the module docstring), recorded in the report."""
    if not config.cuda_expandable_segments or not torch.cuda.is_available():
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:  # several processes share the GPUs' IPC/NCCL buffers; not measured here: left as it is
        logger.info("fasttune: multi-process run (WORLD_SIZE=%d): the CUDA allocator is left as configured", world)
        return
    env = user_setting()
    if env is not None:
        logger.info("fasttune: %s=%r decides expandable segments; left as set", env, os.environ[env])
        return
    if _holders[0] == 0 and f"{SETTING}:True" in current_settings():
        report.add(OP)  # switched on by the user through torch: theirs to keep, nothing to undo
        return
    if _holders[0] == 0:
        try:
            set_expandable(True)
        except (RuntimeError, AttributeError) as err:  # a torch or driver without the feature
            report.fallback(OP, "allocator", f"torch refused expandable segments ({err}); fixed segments kept")
            logger.warning("fasttune: expandable segments unavailable (%s): long runs may fragment the reserve",
                           err)
            return
    _holders[0] += 1
    report.add(OP)
    report.on_undo(_release)
    if _holders[0] == 1:
        logger.info("fasttune: CUDA allocator switched to expandable segments (FastConfig.cuda_expandable_segments)")


__all__ = ["use_expandable_segments", "set_expandable", "current_settings", "user_setting"]
