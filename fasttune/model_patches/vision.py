"""The vision tower of a vision-language model: what stays stock, and its activation checkpointing.

The language tower of a VLM row (``FamilySpec.vision``) takes its text family's fast path through
the other patchers, which find its modules by their exact classes. The vision tower keeps its own
attention, MLP and patch embedding (other classes: ViT blocks with biases, LayerNorms and GELU
MLPs in SigLIP and Qwen2-VL); the only modules it shares with the language tower are the family's
RMSNorm class (Qwen2.5-VL's vision blocks and merger, Gemma 3's projector norm), which ``norm.py``
puts on the kernel like any other. ``patch_vision_tower`` says so in the report ("vision_tower").

With ``FastConfig.checkpointing`` set, the tower's blocks (the modules Hugging Face would
checkpoint: its ``GradientCheckpointingLayer`` instances) are recomputed in backward, like the
decoder layers: fasttune's checkpointing replaces Hugging Face's for the whole model (the Trainer's
flag is cleared). Always "recompute" there: a vision block's input is a few thousand patches, not
worth a trip to host memory, and the "auto" budget is planned over the decoder layers only.
"""

from __future__ import annotations

import inspect

from torch import nn

from ..config import FastConfig
from .checkpointing import RECOMPUTE, CheckpointedLayerForward, LayerCheckpointing
from .families import FamilySpec
from .instance import stock_forward, swap_forward
from .report import PatchReport

OP = "vision_tower"
OP_CHECKPOINTING = "vision_checkpointing"


def submodule(base: nn.Module, path: str) -> nn.Module | None:
    """``base``'s submodule at the dotted ``path``, or None."""
    try:
        module = base.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Module) else None


def _checkpointable_layer_class():
    """transformers' ``GradientCheckpointingLayer`` (the blocks HF checkpoints), or None."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def tower_blocks(tower: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of each outermost checkpointable block of the tower, in order."""
    cls = _checkpointable_layer_class()
    if cls is None:
        return []
    blocks = []
    for name, module in tower.named_modules():
        if isinstance(module, cls) and not any(name.startswith(outer + ".") for outer, _ in blocks):
            blocks.append((name, module))
    return blocks


def _checkpoint_blocks(base: nn.Module, tower: nn.Module, path: str, config: FastConfig,
                       report: PatchReport) -> None:
    blocks = []
    for name, block in tower_blocks(tower):
        stock = stock_forward(block)
        if next(iter(_parameters_of(stock)), None) != "hidden_states":
            report.fallback(OP_CHECKPOINTING, f"{path}.{name}", "forward's first parameter is not 'hidden_states'")
            continue
        blocks.append((block, stock))
    if not blocks:
        report.fallback(OP_CHECKPOINTING, path, "no checkpointable block found (transformers' "
                        "GradientCheckpointingLayer) in this version: the vision tower keeps its activations")
        return
    state = LayerCheckpointing(RECOMPUTE, base, len(blocks), config, head_fused=False)
    report.on_undo(state.close)
    state.reclaim()
    for index, (block, stock) in enumerate(blocks):
        swap_forward(block, CheckpointedLayerForward(block, stock, index, state), report)
    report.add(OP_CHECKPOINTING, len(blocks))


def _parameters_of(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def patch_vision_tower(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig,
                       report: PatchReport) -> None:
    """Report what stays stock in the vision tower of a VLM row; recompute its blocks under checkpointing.

    Runs after the other patchers (the norms inside the tower are patched by then). No-op for text rows.
    """
    if spec.vision is None:
        return
    path = spec.vision.vision_tower
    tower = submodule(base, path)
    if tower is None:
        report.fallback(OP, path, f"no vision tower at `{path}` in this transformers version")
        return
    norm_cls = classes.get("norm_class")
    kernel_norms = sum(1 for m in tower.modules() if type(m) is norm_cls and "forward" in m.__dict__)
    projector = submodule(base, spec.vision.projector)
    if projector is not None and not any(m is projector for m in tower.modules()):
        kernel_norms += sum(1 for m in projector.modules() if type(m) is norm_cls and "forward" in m.__dict__)
    uses = f"; its {kernel_norms} {spec.norm_class} modules run the RMSNorm kernel" if kernel_norms else ""
    report.fallback(OP, path, f"{type(tower).__name__} (and the projector `{spec.vision.projector}`): attention, "
                    f"MLP and patch embedding stay stock{uses}")
    if config.checkpointing is not None:
        _checkpoint_blocks(base, tower, path, config, report)


__all__ = ["patch_vision_tower", "submodule", "tower_blocks"]
