"""LoraSpec: the LoRA adapter ``load_model`` attaches, and the modules it targets.

Text models: PEFT's own targeting (``"all-linear"`` or module names). Vision-language models (a
families row with ``vision``): the linear layers of the towers the switches select
(``finetune_language_layers``, ``finetune_vision_layers``, as Unsloth's ``FastVisionModel`` names
them), given to PEFT as one anchored regex of their paths with the layer numbers generalised
(``model.language_model.layers.<n>.self_attn.q_proj``): exactly those modules, whatever other
linears (the vision tower's, the projector's) share their leaf names. Loaded lazily: importing
this module imports no transformers.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field

from torch import nn

LORA_BIASES = ("none", "all", "lora_only")
_LAYER_NUMBER = re.compile(r"(?<=\\\.)\d+(?=\\\.)")  # a numeric path segment between dots (escaped)


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapter ``load_model`` attaches (names as in Unsloth's ``get_peft_model``).

    The fused LoRA kernels take adapters with ``dropout=0.0``, ``bias="none"`` and no DoRA (the
    defaults); other settings work and keep PEFT's own path for those modules (the PatchReport
    lists them).

    Attributes:
        r: adapter rank (> 0).
        alpha: scaling numerator (PEFT's ``lora_alpha``): the update is ``alpha / r · B A``
            (``alpha / sqrt(r)`` with ``use_rslora``).
        dropout: dropout on the adapter input, in [0, 1) (PEFT's ``lora_dropout``).
        target_modules: "all-linear" (every linear layer but the output head) or module names.
        bias: which base biases train: "none", "all" or "lora_only".
        use_rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
        use_dora: weight-decomposed LoRA (DoRA); not fused.
        modules_to_save: modules trained in full and saved with the adapter (e.g. "lm_head").
        seed: seeds the adapter initialisation (the global RNG state is restored); None: current RNG.
        finetune_language_layers: vision-language models: adapters on the language tower.
        finetune_vision_layers: vision-language models: adapters on the vision tower and projector too
            (PEFT's path there; the fused kernels serve the language tower). A text model takes neither
            switch other than its default.
    """

    r: int = 16
    alpha: float = 16
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: tuple[str, ...] | None = None
    seed: int | None = field(default=None, metadata={"help": "seed of the adapter initialisation"})
    finetune_language_layers: bool = True
    finetune_vision_layers: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, numbers.Integral) or self.r <= 0:
            raise ValueError(f"LoraSpec.r must be a positive integer, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real) or not self.alpha > 0:
            raise ValueError(f"LoraSpec.alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraSpec.dropout must be in [0, 1), got {self.dropout!r}")
        if self.bias not in LORA_BIASES:
            raise ValueError(f"LoraSpec.bias must be one of {LORA_BIASES}, got {self.bias!r}")
        object.__setattr__(self, "target_modules", _names("target_modules", self.target_modules, allow_str=True))
        if self.modules_to_save is not None:
            object.__setattr__(self, "modules_to_save", _names("modules_to_save", self.modules_to_save))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"LoraSpec.seed must be an integer or None, got {self.seed!r}")
        for name in ("finetune_language_layers", "finetune_vision_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoraSpec.{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.finetune_language_layers or self.finetune_vision_layers):
            raise ValueError("LoraSpec: finetune_language_layers and finetune_vision_layers are both False: "
                             "no layer would get an adapter")

    def unfused_reason(self) -> str | None:
        """Why these adapters keep PEFT's path instead of the fused kernels, or None."""
        reasons = [why for bad, why in ((self.dropout > 0, f"dropout={self.dropout}"),
                                        (self.bias != "none", f"bias={self.bias!r}"),
                                        (self.use_dora, "use_dora=True")) if bad]
        return ", ".join(reasons) or None

    def to_peft_config(self, model=None):
        """The equivalent ``peft.LoraConfig`` (task type CAUSAL_LM) for ``model`` (its towers, when it
        is a vision-language model: ``target_modules_for``)."""
        from peft import LoraConfig

        targets = target_modules_for(self, model)
        targets = targets if isinstance(targets, str) else list(targets)
        return LoraConfig(r=int(self.r), lora_alpha=self.alpha, lora_dropout=float(self.dropout),
                          target_modules=targets, bias=self.bias, use_rslora=self.use_rslora,
                          use_dora=self.use_dora, task_type="CAUSAL_LM",
                          modules_to_save=None if self.modules_to_save is None else list(self.modules_to_save))


def _names(option: str, value, allow_str: bool = False):
    if isinstance(value, str):
        if allow_str and value:
            return value
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise ValueError(f"LoraSpec.{option} must be a module name or a list of them, got {value!r}") from None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"LoraSpec.{option} must be a non-empty list of module names, got {value!r}")
    return names


def vision_layout(model):
    """The ``VisionLayout`` of ``model``'s families row (PEFT/DDP wrappers allowed), or None."""
    from ..model_patches import find_causal_lm
    from ..model_patches.families import family_for

    if model is None:
        return None
    spec = family_for(getattr(getattr(find_causal_lm(model), "config", None), "model_type", None))
    return None if spec is None else spec.vision


def target_modules_for(spec: LoraSpec, model=None):
    """What PEFT's ``target_modules`` should be for ``model``: ``spec.target_modules`` for a text model,
    else the anchored regex of the selected towers' linear layers (module docstring).

    Raises:
        ValueError: ``finetune_vision_layers`` (or no language layers) on a text model; no linear
            layer of the selected towers matches ``target_modules``.
    """
    from ..model_patches import find_causal_lm

    layout = vision_layout(model)
    if layout is None:
        if spec.finetune_vision_layers or not spec.finetune_language_layers:
            raise ValueError("LoraSpec.finetune_vision_layers / finetune_language_layers select the towers of a "
                             f"vision-language model; {type(model).__name__} is a text model (keep the defaults)")
        return spec.target_modules
    towers = [layout.language_model] if spec.finetune_language_layers else []
    if spec.finetune_vision_layers:
        towers += [layout.vision_tower, layout.projector]
    wanted = None if spec.target_modules == "all-linear" else set(_names("target_modules", spec.target_modules))
    patterns = set()
    for name, module in find_causal_lm(model).named_modules():
        if not isinstance(module, nn.Linear) or not any(name.startswith(t + ".") for t in towers):
            continue
        if wanted is None or name.rsplit(".", 1)[-1] in wanted:
            patterns.add(_LAYER_NUMBER.sub(r"\\d+", re.escape(name)))
    if not patterns:
        raise ValueError(f"LoraSpec.target_modules={spec.target_modules!r}: no linear layer of "
                         f"{', '.join(towers)} matches")
    return "^(?:" + "|".join(sorted(patterns)) + ")$"


__all__ = ["LoraSpec", "target_modules_for", "vision_layout"]
