"""The Space's form as a run config and back: each form input is named by its dotted config path.

``form_to_dict`` turns the form's values into the mapping ``fasttune train`` reads from YAML;
``dict_to_form`` shows a config in the form (the inverse on valid configs, so Export/Import YAML
round-trip); ``build_config`` validates, schema first, then the sources.
"""

from __future__ import annotations

import copy
from typing import Any

from fasttune.run.checks import check_sources
from fasttune.run.config import FORMATS, RunConfig, RunConfigError

# --- form <-> run config ------------------------------------------------------------------------
# Each form field is (dotted config path, component); "data.columns.<role>" are the mapping dropdowns.

def _path_get(d: dict, path: str, default=None):
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _path_set(d: dict, path: str, value) -> None:
    keys = path.split(".")
    for key in keys[:-1]:
        d = d.setdefault(key, {})
    d[keys[-1]] = value


def form_to_dict(paths: list[str], values: list[Any]) -> dict[str, Any]:
    """The run-config mapping the form describes (not yet validated)."""
    given = dict(zip(paths, values, strict=True))
    # "*" holds the last imported config: fields the form does not show survive the round trip.
    data: dict[str, Any] = copy.deepcopy(given.get("*") or {})
    data.setdefault("data", {})["columns"] = {}
    trainer = given.get("trainer", "sft")
    roles = {r for fmt in FORMATS.get(trainer, ()) for r in fmt}
    for path, value in zip(paths, values, strict=True):
        if path == "*":
            continue
        if path.startswith("data.columns."):
            role = path.rsplit(".", 1)[1]
            if value and role in roles:
                _path_set(data, path, value)
            continue
        if path == "lora.target_modules":
            items = [v.strip() for v in str(value or "").split(",") if v.strip()]
            value = items[0] if len(items) == 1 else items  # the run config turns a bare name into a list
        elif path == "training.bf16":
            value = {"true": True, "false": False}.get(value, value)
        elif path == "fast.checkpointing":
            value = None if value in (None, "", "none") else value
        elif path in _TEXT_OR_NONE:
            value = (value or "").strip() or None
        elif path in ("data.max_samples", "training.eval_steps"):  # 0: none
            value = int(value) if value else None
        elif isinstance(value, float) and value.is_integer() and path in _INT_FIELDS:
            value = int(value)
        _path_set(data, path, value)
    return data


_TEXT_OR_NONE = ("fast.hub_model_id", "run_name", "model.revision", "data.config_name", "data.eval_dataset",
                 "data.eval_split")
_INT_FIELDS = {"lora.r", "training.max_steps", "training.per_device_train_batch_size", "training.seed",
               "training.gradient_accumulation_steps", "training.max_length", "training.logging_steps"}


def dict_to_form(paths: list[str], cfg: RunConfig) -> list[Any]:
    """Form values showing ``cfg`` (the inverse of ``form_to_dict`` on valid configs)."""
    data = cfg.to_dict()
    out = []
    for path in paths:
        value = _path_get(data, path)
        if path == "*":
            value = data
        elif path.startswith("data.columns."):
            value = data["data"]["columns"].get(path.rsplit(".", 1)[1], "")
        elif path == "lora.target_modules":
            value = value if isinstance(value, str) else ", ".join(value)
        elif path == "training.bf16":
            value = {True: "true", False: "false"}.get(value, value)
        elif path == "fast.checkpointing":
            value = value or "none"
        elif value is None and path in _TEXT_OR_NONE:
            value = ""
        elif path in ("data.max_samples", "training.eval_steps"):
            value = value or 0
        out.append(value)
    return out


def build_config(paths, values) -> tuple[RunConfig | None, list[str]]:
    """(config, problems): schema errors first; then sources (paths, offline Hub ids, columns)."""
    try:
        cfg = RunConfig.from_dict(form_to_dict(paths, values))
    except RunConfigError as e:
        return None, e.errors
    return cfg, check_sources(cfg)


def problems_md(problems: list[str], ok_text: str) -> str:
    if not problems:
        return f"✅ {ok_text}"
    return "❌ **Fix before starting:**\n" + "\n".join(f"- `{p.split(':', 1)[0]}`:{p.split(':', 1)[1]}"
                                                        if ":" in p else f"- {p}" for p in problems)
