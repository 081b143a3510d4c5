"""patch_model / unpatch_model: put one model instance on the fast path, and take it off again.

Nothing here touches a class or a module of transformers: each patcher swaps the ``forward`` of
individual module instances (``instance.py``) and records how to undo it on the PatchReport,
which lives on the model instance. Patchers run in a fixed order; each decides from the families
table and the config what it can take, and reports what it leaves stock.
"""

from __future__ import annotations

import importlib
import logging

from torch import nn

from ..config import FastConfig
from .families import FAMILIES, FamilySpec, family_for
from .head import patch_head
from .report import PatchReport

logger = logging.getLogger("fasttune")

STATE_ATTR = "_fasttune_report"
_CLASS_FIELDS = ("causal_lm_class", "decoder_layer_class", "attention_class", "mlp_class", "norm_class")


def _patchers():
    """The patchers in the order they run (import here keeps optional parts lazy)."""
    patchers = [patch_head]
    for module_name, fn_name in (("norm", "patch_norms"), ("attention", "patch_attention"),
                                 ("mlp", "patch_mlp"), ("lora", "patch_lora"), ("residual", "patch_residuals"),
                                 ("checkpointing", "install_checkpointing")):
        try:
            module = importlib.import_module(f"{__package__}.{module_name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}.{module_name}":
                raise
            continue
        patchers.append(getattr(module, fn_name))
    return patchers


def find_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside DDP/FSDP-style ``.module`` wrappers and PEFT."""
    m = model
    for _ in range(4):
        if hasattr(m, "get_base_model"):  # PeftModel
            m = m.get_base_model()
        elif type(m).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
                getattr(m, "module", None), nn.Module):
            m = m.module
        else:
            break
    return m


def resolve_classes(spec: FamilySpec) -> dict[str, type]:
    """Field name → class of this family in the installed transformers (missing ones omitted)."""
    try:
        module = importlib.import_module(spec.modeling_module)
    except ImportError:
        return {}
    found = {}
    for field_name in _CLASS_FIELDS:
        cls = getattr(module, getattr(spec, field_name), None)
        if isinstance(cls, type):
            found[field_name] = cls
    return found


def family_class(spec: FamilySpec, classes: dict, field_name: str, op: str, report: PatchReport) -> type | None:
    """The family's class ``field_name`` (e.g. "norm_class") from ``resolve_classes``, or None after
    reporting that this transformers version lacks it."""
    cls = classes.get(field_name)
    if cls is None:
        report.fallback(op, spec.model_type, f"{getattr(spec, field_name)} not found in {spec.modeling_module}")
    return cls


def family_modules(base: nn.Module, spec: FamilySpec, classes: dict, field_name: str, op: str, report: PatchReport):
    """(name, module) for each module of exactly the family's class ``field_name`` (none, and the
    class reported missing, when this transformers version lacks it)."""
    cls = family_class(spec, classes, field_name, op, report)
    if cls is not None:
        yield from ((name, m) for name, m in base.named_modules() if type(m) is cls)


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
    if getattr(base, STATE_ATTR, None) is not None:
        unpatch_model(base)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    report = PatchReport(model_type=model_type)
    spec = family_for(model_type)
    if spec is None:
        report.fallback("*", str(model_type), f"model_type {model_type!r} is not supported; supported: "
                        + ", ".join(sorted(FAMILIES)))
        logger.warning("fasttune: %s stays on the stock path (unsupported model_type %r)",
                       type(base).__name__, model_type)
    else:
        classes = resolve_classes(spec)
        for patcher in _patchers():
            patcher(base, spec, classes, config, report)
        logger.info("%s", report)
    base.__dict__[STATE_ATTR] = report
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
