"""The run config: one YAML file that says everything ``fasttune train`` does.

Sections (every key documented by ``field_help()``; ``fasttune train --help`` prints them)::

    model:    {base, revision, dtype}
    data:     {dataset, config_name, split, columns, max_samples, eval_dataset, eval_split, eval_size}
    trainer:  sft | dpo
    method:   lora | qlora | full
    lora:     {r, alpha, dropout, target_modules}
    training: {learning_rate, num_train_epochs, max_steps, per_device_train_batch_size, ..., eval_strategy,
               eval_steps, packing, assistant_only_loss, report_to}
    fast:     every FastConfig field (kernels, checkpointing, export and push targets)
    run_name: optional name of the run

Validation collects every problem before anything is loaded, each naming its field and, where
the value comes from a fixed set, the allowed values (``trainer: 'ppo' is not one of sft, dpo``);
unknown keys are rejected with the known ones listed. Only the standard library and PyYAML are
imported here, so a bad config fails in milliseconds; ``checks.py`` then looks at the sources
(model folder, dataset file and columns, optional packages) before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import CHECKPOINTING_MODES, MERGED_DTYPES, FastConfig
from .sources import EMBEDDED, classify_dataset, classify_model

TRAINERS = ("sft", "dpo")
METHODS = ("lora", "qlora", "full")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BF16_CHOICES = ("auto", True, False)
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
              "adafactor", "sgd", "lion_8bit")
SAVE_STRATEGIES = ("no", "steps", "epoch")
EVAL_STRATEGIES = ("auto", "no", "steps", "epoch")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
# Experiment trackers the Trainer reports to; each is an optional extra (pip install 'fasttune[wandb]').
REPORT_TO = ("none", "tensorboard", "wandb")
# Column roles per trainer: each tuple is one accepted dataset format (TRL's names).
FORMATS = {"sft": (("prompt", "completion"), ("messages",), ("text",)),
           "dpo": (("prompt", "chosen", "rejected"), ("chosen", "rejected"))}


class RunConfigError(ValueError):
    """An invalid run config; ``errors`` lists every problem as ``"<field>: <what is wrong>"``."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = list(errors)
        where = f" in {source}" if source else ""
        super().__init__(f"invalid run config{where}:\n" + "\n".join(f"  - {e}" for e in self.errors))


def _f(default, help: str, kind: str, **rules):
    """A documented field; ``kind`` and ``rules`` (choices, min, max, nullable) drive validation."""
    factory = dict(default_factory=lambda: dict(default)) if isinstance(default, dict) else dict(default=default)
    return field(**factory, metadata={"help": help, "kind": kind, **rules})


@dataclass
class ModelSection:
    base: str = _f(EMBEDDED, "Base model: a Hub id ('org/name'), a local folder, or 'embedded' (the "
                             "small in-process model of fasttune.embedded, no download).", "str")
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) of the base model.", "str", nullable=True)
    dtype: str = _f("auto", "Weights dtype: auto (bfloat16 on a bf16 GPU, else float32), float32, bfloat16, "
                            "float16.", "str", choices=DTYPES)


@dataclass
class DataSection:
    dataset: str = _f(EMBEDDED, "Dataset: a Hub id, a local .json/.jsonl/.csv/.parquet file, or 'embedded' "
                                "(the shift task of fasttune.embedded).", "str")
    config_name: str | None = _f(None, "Hub dataset configuration (subset) name.", "str", nullable=True)
    split: str = _f("train", "Split to train on.", "str")
    columns: dict = _f({}, "Role -> dataset column. sft: prompt+completion, messages, or text; dpo: "
                           "prompt+chosen+rejected (or chosen+rejected). Empty: detected from the column names.",
                       "columns")
    max_samples: int | None = _f(None, "Train on at most this many rows (embedded: rows generated, default "
                                       "2000).", "int", nullable=True, min=1)
    eval_dataset: str | None = _f(None, "Held-out data to evaluate on: a Hub id, a local file, or 'embedded' "
                                        "(held-out rows of the embedded task); same columns as the training data.",
                                  "str", nullable=True)
    eval_split: str | None = _f(None, "Split of a Hub dataset to evaluate on (of eval_dataset, else of dataset), "
                                      "e.g. test or validation.", "str", nullable=True)
    eval_size: float = _f(0.0, "Hold out this share (< 1) or number of rows (>= 1) of the training data for "
                               "evaluation; 0: none.", "float", min=0)


@dataclass
class LoraSection:
    r: int = _f(16, "LoRA rank.", "int", min=1)
    alpha: float = _f(32, "LoRA alpha (the update is scaled by alpha / r).", "float", min=0, exclusive_min=True)
    dropout: float = _f(0.0, "LoRA dropout, in [0, 1) (0 keeps fasttune's fused LoRA path).", "float", min=0, max=1,
                        exclusive_max=True)
    target_modules: Any = _f("all-linear", "Modules that get adapters: 'all-linear', a list of names "
                                           "(q_proj, k_proj, ...) or a regex over module paths.", "str_or_list")


@dataclass
class TrainingSection:
    learning_rate: float = _f(2e-4, "Peak learning rate.", "float", min=0, exclusive_min=True)
    num_train_epochs: float = _f(1.0, "Epochs (ignored when max_steps > 0).", "float", min=0, exclusive_min=True)
    max_steps: int = _f(-1, "Optimizer steps; -1: run num_train_epochs.", "int", min=-1)
    per_device_train_batch_size: int = _f(8, "Rows per device per micro-batch.", "int", min=1)
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.", "int", min=1)
    max_length: int = _f(1024, "Tokens per row (longer rows are truncated).", "int", min=8)
    warmup: float = _f(0.0, "Warm-up: a fraction of the run (< 1) or a number of steps (>= 1).", "float", min=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", "float", min=0)
    lr_scheduler_type: str = _f("linear", "Learning-rate schedule.", "str", choices=SCHEDULERS)
    optim: str = _f("adamw_torch", "Optimizer (8-bit ones need bitsandbytes).", "str", choices=OPTIMIZERS)
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0: off).", "float", min=0)
    seed: int = _f(42, "Random seed (data order, LoRA init, embedded model).", "int", min=0)
    logging_steps: int = _f(10, "Log the loss every this many steps.", "int", min=1)
    bf16: Any = _f("auto", "bfloat16 mixed precision: auto (on when the GPU supports it), true, false.",
                   "str_or_bool", choices=BF16_CHOICES)
    save_strategy: str = _f("no", "Intermediate checkpoints: no, steps, epoch (the final model is always "
                                  "saved).", "str", choices=SAVE_STRATEGIES)
    save_steps: int = _f(500, "Checkpoint every this many steps (save_strategy: steps).", "int", min=1)
    save_total_limit: int | None = _f(None, "Keep at most this many checkpoints.", "int", nullable=True, min=1)
    beta: float = _f(0.1, "DPO: strength of the KL penalty towards the reference model.", "float", min=0,
                     exclusive_min=True)
    eval_strategy: str = _f("auto", "When to evaluate on the eval data: auto (every eval_steps when there is eval "
                                    "data, else never), no, steps, epoch. The run always ends with an evaluation "
                                    "when there is eval data.", "str", choices=EVAL_STRATEGIES)
    eval_steps: int | None = _f(None, "Evaluate every this many steps (default: logging_steps).", "int",
                                nullable=True, min=1)
    packing: bool = _f(False, "SFT: pack several rows into each max_length sequence (fewer padding tokens; "
                              "attention stays within each row).", "bool")
    packing_strategy: str = _f("bfd", "SFT packing: bfd (best-fit, truncates long rows), bfd_split (splits them) "
                                      "or wrapped (cuts rows anywhere).", "str", choices=PACKING_STRATEGIES)
    assistant_only_loss: bool = _f(False, "SFT on chat data (a messages column): train on the assistant turns only. "
                                          "prompt/completion data always trains on the completion only.", "bool")
    report_to: Any = _f("none", "Experiment trackers: none, tensorboard, wandb, or a list of them (extras: "
                                "pip install 'fasttune[tensorboard]' / 'fasttune[wandb]').", "report_to")


_SECTIONS = {"model": ModelSection, "data": DataSection, "lora": LoraSection, "training": TrainingSection}
_TOP_LEVEL = {
    "trainer": dict(help="Trainer: sft (supervised fine-tuning) or dpo (preference pairs).", kind="str",
                    choices=TRAINERS),
    "method": dict(help="lora (adapters on a 16-bit base), qlora (adapters on a 4-bit NF4 base, needs "
                        "bitsandbytes) or full (every weight trains).", kind="str", choices=METHODS),
    "run_name": dict(help="Name of the run (default: from the config file name).", kind="str", nullable=True),
}
KNOWN_KEYS = ("model", "data", "trainer", "method", "lora", "training", "fast", "run_name")


@dataclass
class RunConfig:
    """A validated run config (build it with ``RunConfig.from_dict`` or ``load_run_config``)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    trainer: str = "sft"
    method: str = "lora"
    lora: LoraSection = field(default_factory=LoraSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    fast: FastConfig = field(default_factory=FastConfig)
    run_name: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str | None = None) -> "RunConfig":
        """Validates ``data`` (a parsed YAML mapping); raises RunConfigError listing every problem."""
        errors: list[str] = []
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise RunConfigError([f"the config must be a mapping of sections, got {type(data).__name__}"], source)
        _unknown("", data, KNOWN_KEYS, errors)
        kwargs: dict[str, Any] = {}
        for name, section_cls in _SECTIONS.items():
            kwargs[name] = _section(name, section_cls, data.get(name), errors)
        for name, rules in _TOP_LEVEL.items():
            if name in data:
                kwargs[name] = _value(name, data[name], rules, errors)
        kwargs["fast"] = _fast(data.get("fast"), errors)
        if errors:
            raise RunConfigError(errors, source)
        cfg = cls(**{k: v for k, v in kwargs.items() if v is not _BAD})
        _cross_checks(cfg, errors)
        if errors:
            raise RunConfigError(errors, source)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready dict; ``from_dict(to_dict())`` gives an equal config."""
        out: dict[str, Any] = {}
        for key in KNOWN_KEYS:
            value = getattr(self, key)
            if key == "fast":
                out[key] = value.to_dict()
            elif dataclasses.is_dataclass(value):
                out[key] = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            else:
                out[key] = value
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @property
    def columns(self) -> dict[str, str]:
        return dict(self.data.columns)

    def hub_base_id(self) -> str | None:
        """The base model's Hub id for cards and the adapter config: ``fast.base_model_id``, else
        ``model.base`` when that is a Hub id (a local or embedded base has none)."""
        if self.fast.base_model_id:
            return self.fast.base_model_id
        return self.model.base if classify_model(self.model.base) == "hub" else None

    def hub_datasets(self) -> list[str]:
        """The dataset's Hub id, for the cards' front matter ([] for a local or embedded dataset)."""
        return [self.data.dataset] if classify_dataset(self.data.dataset) == "hub" else []


_BAD = object()


def _plain(v):
    return list(v) if isinstance(v, tuple) else (dict(v) if isinstance(v, dict) else v)


def _unknown(prefix: str, data: dict, known, errors: list[str]) -> None:
    for key in data:
        if key not in known:
            where = f"{prefix}: " if prefix else ""
            errors.append(f"{where}unknown key {key!r}; known keys: {', '.join(known)}")


def _section(name: str, cls, data, errors: list[str]):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        errors.append(f"{name}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}, "
                      f"got {data!r}")
        return _BAD
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _unknown(name, data, list(fields), errors)
    kwargs = {}
    for key, value in data.items():
        if key in fields:
            checked = _value(f"{name}.{key}", value, fields[key].metadata, errors)
            if checked is not _BAD:
                kwargs[key] = checked
    return cls(**kwargs)


def _choice_text(choices) -> str:
    return ", ".join("true" if c is True else "false" if c is False else str(c) for c in choices)


def _value(path: str, value, rules, errors: list[str]):
    """Checks one value against its field's rules; returns it normalised, or _BAD after an error."""
    kind, choices = rules.get("kind"), rules.get("choices")
    if value is None:
        if rules.get("nullable"):
            return None
        errors.append(f"{path}: must not be empty")
        return _BAD
    if kind == "bool" and not isinstance(value, bool):
        errors.append(f"{path}: expected true or false, got {value!r}")
        return _BAD
    if kind == "str_or_bool" and not isinstance(value, (str, bool)):
        errors.append(f"{path}: {value!r} is not one of {_choice_text(choices)}")
        return _BAD
    if kind == "str" and not isinstance(value, str):  # e.g. YAML 1.1 reads a bare yes/no as a bool
        errors.append(f"{path}: {value!r} is not one of {_choice_text(choices)}" if choices
                      else f"{path}: expected a string, got {value!r}")
        return _BAD
    if kind in ("int", "float"):
        if kind == "float" and isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int if kind == "int" else (int, float)):
            errors.append(f"{path}: expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
            return _BAD
        value = float(value) if kind == "float" else value
        lo, hi = rules.get("min"), rules.get("max")
        if lo is not None and (value < lo or (rules.get("exclusive_min") and value == lo)):
            errors.append(f"{path}: must be {'>' if rules.get('exclusive_min') else '>='} {lo}, got {value!r}")
            return _BAD
        if hi is not None and (value > hi or (rules.get("exclusive_max") and value == hi)):
            errors.append(f"{path}: must be {'<' if rules.get('exclusive_max') else '<='} {hi}, got {value!r}")
            return _BAD
    if kind == "str_or_list":
        if isinstance(value, str):
            # PEFT full-matches a string against whole module paths: a bare name means a list of one.
            return value if value == "all-linear" or any(c in value for c in ".*|()[]^$?+\\") else [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            errors.append(f"{path}: expected 'all-linear' or a non-empty list of module names, got {value!r}")
            return _BAD
    if kind == "report_to":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(v, str) and v in REPORT_TO for v in items) \
                or ("none" in items and len(items) > 1):
            errors.append(f"{path}: expected none, or one or a list of {', '.join(REPORT_TO[1:])}; got {value!r}")
            return _BAD
        return value if isinstance(value, str) else list(dict.fromkeys(items))
    if kind == "columns":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            errors.append(f"{path}: expected a mapping role -> column name, got {value!r}")
            return _BAD
        return dict(value)
    if choices is not None and value not in choices:
        errors.append(f"{path}: {value!r} is not one of {_choice_text(choices)}")
        return _BAD
    return value


def _fast_kind(f: dataclasses.Field) -> dict[str, Any]:
    t = str(f.type)
    kind = ("list" if t.startswith("tuple") else "bool" if t == "bool" else "int" if t.startswith("int")
            else "float" if t.startswith("float") else "str")
    rules: dict[str, Any] = {"kind": kind, "nullable": "None" in t}
    choices = {"checkpointing": [m for m in CHECKPOINTING_MODES if m is not None],
               "merged_dtype": MERGED_DTYPES}.get(f.name)
    if choices:
        rules["choices"] = tuple(choices)
    return rules


def _fast(data, errors: list[str]):
    if data is None:
        return FastConfig()
    if not isinstance(data, dict):
        errors.append(f"fast: expected a mapping of FastConfig fields, got {data!r}")
        return _BAD
    fields = {f.name: f for f in dataclasses.fields(FastConfig)}
    _unknown("fast", data, list(fields), errors)
    kwargs, n_errors = {}, len(errors)
    for key, value in data.items():
        if key not in fields:
            continue
        rules = _fast_kind(fields[key])
        if rules["kind"] == "list":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                errors.append(f"fast.{key}: expected a list of strings, got {value!r}")
                continue
            kwargs[key] = tuple(value)
            continue
        checked = _value(f"fast.{key}", value, rules, errors)
        if checked is not _BAD:
            kwargs[key] = int(checked) if rules["kind"] == "int" and checked is not None else checked
    if len(errors) > n_errors:
        return _BAD
    try:
        return FastConfig(**kwargs)
    except ValueError as e:  # FastConfig names the field; say which section it is in
        errors.append(f"fast.{e}")
        return _BAD


def _cross_checks(cfg: RunConfig, errors: list[str]) -> None:
    roles = sorted({r for fmt in FORMATS[cfg.trainer] for r in fmt})
    formats = " or ".join("+".join(fmt) for fmt in FORMATS[cfg.trainer])
    cols = cfg.data.columns
    for role in cols:
        if role not in roles:
            errors.append(f"data.columns: {role!r} is not a {cfg.trainer} role; one of {', '.join(roles)}")
    if cols and set(cols) <= set(roles) and set(cols) not in [set(f) for f in FORMATS[cfg.trainer]]:
        errors.append(f"data.columns: roles {', '.join(sorted(cols))} are not a {cfg.trainer} format; "
                      f"give {formats}")
    _eval_checks(cfg, errors)
    t = cfg.training
    if cfg.trainer != "sft":
        errors += [f"training.{k}: SFT only (trainer is {cfg.trainer})" for k in ("packing", "assistant_only_loss")
                   if getattr(t, k)]
    elif t.assistant_only_loss and cols and "messages" not in cols:
        errors.append("training.assistant_only_loss: needs chat data (data.columns.messages); prompt/completion data "
                      "already trains on the completion only")
    if cfg.method == "full" and "adapter" in cfg.fast.export_artifacts:
        errors.append("fast.export_artifacts: 'adapter' needs method lora or qlora (method is full)")
    if cfg.method == "full" and cfg.fast.push_to_hub and cfg.fast.push_artifacts == ("adapter",):
        errors.append("fast.push_artifacts: only 'adapter', but method full trains no adapter")


def _eval_checks(cfg: RunConfig, errors: list[str]) -> None:
    d = cfg.data
    if d.eval_dataset is not None and d.eval_size > 0:
        errors.append("data.eval_size: give eval_dataset or eval_size, not both")
    if d.eval_size >= 1 and not float(d.eval_size).is_integer():
        errors.append(f"data.eval_size: a share must be < 1 and a row count whole, got {d.eval_size}")
    if d.eval_split is not None and d.eval_size > 0:
        errors.append("data.eval_split: give eval_split or eval_size, not both")
    if cfg.training.eval_strategy in ("steps", "epoch") and not has_eval_data(cfg):
        errors.append(f"training.eval_strategy: {cfg.training.eval_strategy!r} needs eval data "
                      "(data.eval_dataset, data.eval_split or data.eval_size)")


def has_eval_data(cfg: RunConfig) -> bool:
    """The config names held-out data: an eval dataset, an eval split or a share of the training rows."""
    d = cfg.data
    return d.eval_dataset is not None or d.eval_split is not None or d.eval_size > 0


def eval_strategy(cfg: RunConfig) -> str:
    """The Trainer's eval_strategy: ``auto`` resolved (steps with eval data, else no)."""
    strategy = cfg.training.eval_strategy
    return ("steps" if has_eval_data(cfg) else "no") if strategy == "auto" else strategy


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"training.max_steps=5"`` → (["training", "max_steps"], 5); the value is read as YAML."""
    import yaml

    if "=" not in text:
        raise RunConfigError([f"--set {text!r}: expected KEY=VALUE, e.g. training.max_steps=20"])
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``section.key=value`` override set."""
    import copy

    data = copy.deepcopy(data or {})
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RunConfigError([f"--set {text!r}: {k!r} is not a section"])
        node[keys[-1]] = value
    return data


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Reads and validates a YAML run config (with optional ``--set`` overrides)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RunConfigError([f"config file {str(path)!r} does not exist"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise RunConfigError([f"not valid YAML: {e}"], str(path)) from None
    return RunConfig.from_dict(apply_overrides(data or {}, overrides or []), source=str(path))


def parse_run_config(text: str) -> RunConfig:
    """Validates a YAML run config given as text (the Space's import box)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RunConfigError([f"not valid YAML: {e}"]) from None
    return RunConfig.from_dict(data or {})


def field_help() -> dict[str, str]:
    """``section.key`` → help text for every run-config field (FastConfig's under ``fast.``)."""
    out = {k: v["help"] for k, v in _TOP_LEVEL.items()}
    for name, cls in _SECTIONS.items():
        out.update({f"{name}.{f.name}": f.metadata["help"] for f in dataclasses.fields(cls)})
    out.update({f"fast.{k}": v for k, v in FastConfig.field_help().items()})
    return out
