"""patch_model / unpatch_model: put one model instance on the fast path, and take it off again.

Nothing here touches a class or a module of transformers: each patcher swaps the ``forward`` of
individual module instances (``instance.py``) and records how to undo it on the PatchReport,
which lives on the model instance. Patchers run in the fixed order of ``PATCHERS``; each decides from the families
table and the config what it can take, and reports what it leaves stock.
"""

from __future__ import annotations

import logging

from torch import nn

from ..config import FastConfig
from .allocator import use_expandable_segments
from .attention import patch_attention
from .checkpointing import install_checkpointing
from .families import FAMILIES, family_for, resolve_classes
from .head import patch_head
from .hub_kernels import hand_over as hand_over_hub_kernels, suspend_hub_kernels
from .instance import find_causal_lm
from .lora import patch_lora
from .lora_fp8 import patch_fp8_bases
from .mlp import patch_mlp
from .moe import patch_moe
from .norm import patch_norms
from .report import PatchReport, log_report
from .residual import patch_residuals
from .vision import patch_vision_tower

logger = logging.getLogger("fasttune")

STATE_ATTR = "_fasttune_report"

# The patchers in the order they run; each is ``patcher(base, spec, classes, config, report)``. Hub kernels
# first: turning them off restores class forwards, which must not pop a patch already installed.
PATCHERS = (suspend_hub_kernels, patch_head, patch_norms, patch_attention, patch_mlp, patch_moe, patch_lora,
            patch_fp8_bases, patch_residuals, install_checkpointing, patch_vision_tower, use_expandable_segments)


def patch_model(model: nn.Module, config: FastConfig | None = None) -> PatchReport:
    """Swap the forwards of this model's modules for fasttune's kernels.

    Patches this instance only (other instances and the classes stay stock); calling it again
    re-patches with the new config. Unsupported families, modules and options stay stock and are
    listed in ``report.fallbacks`` and the log; nothing raises for them.

    Args:
        model: a transformers causal LM, optionally wrapped by PEFT or DDP.
        config: which fast paths to take: a FastConfig or a dict of its fields; ``FastConfig()`` when None.

    Returns:
        The PatchReport (also stored on the model; ``unpatch_model`` or ``report.undo()`` reverts).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``config`` not a FastConfig/dict/None.
    """
    _check_model(model, "patch_model")
    config = FastConfig.coerce(config, "config")
    base = find_causal_lm(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    report = PatchReport(model_type=model_type)
    previous = getattr(base, STATE_ATTR, None)
    if previous is not None:
        hand_over_hub_kernels(previous, report)  # stays unkernelized through the re-patch
        unpatch_model(base)
    spec = family_for(model_type)
    if spec is None:
        report.fallback("*", str(model_type), f"model_type {model_type!r} is not supported; supported: "
                        + ", ".join(sorted(FAMILIES)))
        logger.warning("fasttune: %s stays on the stock path (unsupported model_type %r)",
                       type(base).__name__, model_type)
    else:
        classes = resolve_classes(spec)
        for patcher in PATCHERS:
            patcher(base, spec, classes, config, report)
    base.__dict__[STATE_ATTR] = report
    log_report(report, base)  # once per instance and outcome: a re-patch with the same result stays quiet
    return report


def patch_report(model: nn.Module) -> PatchReport | None:
    """The report of the patches currently on this model, or None."""
    return getattr(find_causal_lm(model), STATE_ATTR, None)


def unpatch_model(model: nn.Module) -> None:
    """Undo every fasttune patch on this model (no-op when it has none).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    _check_model(model, "unpatch_model")
    base = find_causal_lm(model)
    report = base.__dict__.pop(STATE_ATTR, None)
    if report is not None:
        report.undo()


def _check_model(model, caller: str) -> None:
    """TypeError naming ``model`` for a non-module (a model name passed instead of a model, say)."""
    if not isinstance(model, nn.Module):
        hint = (" (a model id? load it first, e.g. AutoModelForCausalLM.from_pretrained("
                f"{model!r}))") if isinstance(model, str) else ""
        raise TypeError(f"{caller}: model must be a torch.nn.Module (a transformers causal LM, optionally "
                        f"wrapped by PEFT or DDP), got {type(model).__name__}{hint}")
