"""Checks of a run config's sources that need no model load: folders, files, columns, optional packages."""

from __future__ import annotations

import importlib.util

from . import data
from .config import RunConfig, RunConfigError
from .sources import EMBEDDED, in_hub_cache, classify_dataset, classify_model, hub_offline


def check_sources(cfg: RunConfig) -> list[str]:
    """Problems with the model and dataset sources that can be found without loading them: paths
    that do not exist, Hub ids while HF_HUB_OFFLINE is set and nothing is cached, column mappings
    that a local file (training or eval) does not have, QLoRA or a tracker without its package, a Hub
    repo id that huggingface_hub would refuse. Returns ``field: reason`` lines."""
    errors = []
    try:
        kind = classify_model(cfg.model.base)
        if kind == "hub" and hub_offline() and not in_hub_cache(cfg.model.base, "model"):
            errors.append(f"model.base: {cfg.model.base!r} is a Hub id but HF_HUB_OFFLINE is set and it is not in "
                          "the local cache; use a local folder or 'embedded', or unset HF_HUB_OFFLINE")
    except ValueError as e:
        errors.append(f"model.base: {e}")
    available = _dataset_errors("data.dataset", cfg.data.dataset, cfg, errors)
    if cfg.data.eval_dataset is not None:
        _dataset_errors("data.eval_dataset", cfg.data.eval_dataset, cfg, errors)
    if cfg.training.assistant_only_loss and available is not None and not cfg.data.columns \
            and "messages" not in available:
        errors.append(f"training.assistant_only_loss: needs chat data (a messages column); the dataset has "
                      f"{', '.join(available)} (prompt/completion data already trains on the completion only)")
    errors += _package_errors(cfg)
    errors += _hub_id_errors(cfg)
    return errors


def _dataset_errors(field: str, name: str, cfg: RunConfig, errors: list[str]) -> list[str] | None:
    """Appends what is wrong with one dataset source; returns its columns when they are known locally."""
    try:
        kind = classify_dataset(name)
        if kind == "hub" and hub_offline() and not in_hub_cache(name, "dataset"):
            errors.append(f"{field}: {name!r} is a Hub id but HF_HUB_OFFLINE is set and it is "
                          "not in the local cache; upload a file or use 'embedded'")
        elif kind in ("local", EMBEDDED):
            available = data.available_columns(name, cfg.trainer)
            errors += data.column_errors(cfg.trainer, cfg.data.columns, available)
            return available
    except ValueError as e:
        errors.append(f"{field}: {e}")
    return None


def _package_errors(cfg: RunConfig) -> list[str]:
    errors = []
    if cfg.method == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        errors.append("method: 'qlora' needs bitsandbytes (pip install 'fasttune[qlora]')")
    fast = cfg.fast
    if "gguf" in fast.export_artifacts or (fast.push_to_hub and "gguf" in fast.push_artifacts):
        if importlib.util.find_spec("gguf") is None:
            errors.append("fast.export_artifacts: 'gguf' needs the gguf package (pip install 'fasttune[gguf]')")
        k_quants = [q for q in fast.gguf_quantizations if "_k" in q]
        if k_quants and importlib.util.find_spec("llama_cpp") is None:
            errors.append(f"fast.gguf_quantizations: {', '.join(k_quants)} need llama-cpp-python "
                          "(pip install 'fasttune[gguf-kquants]'; see the README for its build flags)")
    report_to = cfg.training.report_to
    for tracker in [report_to] if isinstance(report_to, str) else report_to:
        modules = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}.get(tracker, ())
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            errors.append(f"training.report_to: {tracker!r} needs the {tracker} package "
                          f"(pip install 'fasttune[{tracker}]')")
    return errors


def _hub_id_errors(cfg: RunConfig) -> list[str]:
    """huggingface_hub's own repo-id rules, so ``me/bad repo!`` fails here and not after training."""
    repo = cfg.fast.hub_model_id
    if repo is None:
        return []
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return [f"fast.hub_model_id: {e}"]
    return []


def validate(cfg: RunConfig, source: str | None = None) -> None:
    """Raises RunConfigError when ``check_sources`` finds problems (``source``: the file, for the message)."""
    errors = check_sources(cfg)
    if errors:
        raise RunConfigError(errors, source)
