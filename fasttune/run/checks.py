"""Checks of a run config's sources that need no model load: folders, files, columns, optional packages."""

from __future__ import annotations

import importlib.util

from . import data
from .config import RunConfig, RunConfigError
from .sources import EMBEDDED, in_hub_cache, classify_dataset, classify_model, hub_offline


def check_sources(cfg: RunConfig) -> list[str]:
    """Problems with the model and dataset sources that can be found without loading them: paths
    that do not exist, Hub ids while HF_HUB_OFFLINE is set and nothing is cached, column mappings
    that a local file does not have, QLoRA without bitsandbytes. Returns ``field: reason`` lines."""
    errors = []
    try:
        kind = classify_model(cfg.model.base)
        if kind == "hub" and hub_offline() and not in_hub_cache(cfg.model.base, "model"):
            errors.append(f"model.base: {cfg.model.base!r} is a Hub id but HF_HUB_OFFLINE is set and it is not in "
                          "the local cache; use a local folder or 'embedded', or unset HF_HUB_OFFLINE")
    except ValueError as e:
        errors.append(f"model.base: {e}")
    try:
        kind = classify_dataset(cfg.data.dataset)
        if kind == "hub" and hub_offline() and not in_hub_cache(cfg.data.dataset, "dataset"):
            errors.append(f"data.dataset: {cfg.data.dataset!r} is a Hub id but HF_HUB_OFFLINE is set and it is "
                          "not in the local cache; upload a file or use 'embedded'")
        elif kind in ("local", EMBEDDED):
            available = data.available_columns(cfg.data.dataset, cfg.trainer)
            errors += data.column_errors(cfg.trainer, cfg.data.columns, available)
    except ValueError as e:
        errors.append(f"data.dataset: {e}")
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
    return errors


def validate(cfg: RunConfig, source: str | None = None) -> None:
    """Raises RunConfigError when ``check_sources`` finds problems (``source``: the file, for the message)."""
    errors = check_sources(cfg)
    if errors:
        raise RunConfigError(errors, source)
