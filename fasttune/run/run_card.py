"""What the model cards of a run say, read from its folder: ``run_card_facts(folder, cfg)``.

The base model by its Hub id, or in words when it has none (a local folder, the embedded demo
model); the base's license; the data by Hub id or in words (a local file by its name only, the
embedded task); method and hyperparameters from the run config; held-out results from
``metrics.json`` (the embedded task's exact match) and the Trainer's last ``eval_loss``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import RunConfig
from .folder import RunFolder
from .sources import EMBEDDED, classify_dataset, classify_model

EMBEDDED_BASE = ("fasttune's embedded demo model (a tiny Llama-style model with random weights, built "
                 "in-process); it has no Hub id")
EMBEDDED_DATA = ("fasttune's embedded shift task: each letter of a word moved one place on "
                 "(prompt `abc =`, completion ` bcd`)")
EXACT_MATCH = ("share of {n}held-out words of the embedded task (never trained on) whose greedy completion "
               "is exactly the shifted word")
METHODS = {"lora": "LoRA", "qlora": "QLoRA (LoRA on a 4-bit NF4 base)", "full": "full fine-tuning"}


def read_metrics(folder: RunFolder) -> dict:
    """The run's metrics.json ({} when absent or unreadable)."""
    try:
        data = json.loads(folder.metrics_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _kind(classify, name: str) -> str:
    try:
        return classify(name)
    except ValueError:  # moved or deleted since training: still a local path, never a Hub id
        return "local"


def _base(cfg: RunConfig):
    from ..export.base_license import BaseLicense, find_base_license
    from ..export.card_facts import NO_HUB_ID

    kind = _kind(classify_model, cfg.model.base)
    if kind == EMBEDDED:
        return None, EMBEDDED_BASE, BaseLicense("apache-2.0", source="random weights built by fasttune, "
                                                                      "under fasttune's license")
    base_id = cfg.hub_base_id()
    if kind == "hub":
        return base_id, None, find_base_license(base_id)
    note = None if base_id else (f"a local folder ({Path(cfg.model.base).name}), so {NO_HUB_ID}; set "
                                 "fast.base_model_id to name it")
    return base_id, note, find_base_license(base_id, local_dir=cfg.model.base)


def _data(cfg: RunConfig) -> tuple[list[str], str | None]:
    kind = _kind(classify_dataset, cfg.data.dataset)
    if kind == EMBEDDED:
        return [], EMBEDDED_DATA
    if kind == "local":
        return [], f"a local file, {Path(cfg.data.dataset).name}"
    split = "" if cfg.data.split == "train" else f" (split {cfg.data.split})"
    return [cfg.data.dataset], split.strip() or None


def hyperparameter_rows(cfg: RunConfig) -> list[tuple[str, str]]:
    """The run config's settings that decide what the model learns, as (name, value) rows."""
    from ..export.card_facts import fmt

    t = cfg.training
    rows = [("trainer", cfg.trainer.upper())]
    if cfg.method != "full":
        targets = cfg.lora.target_modules
        rows += [("LoRA rank (r)", cfg.lora.r), ("LoRA alpha", cfg.lora.alpha), ("LoRA dropout", cfg.lora.dropout),
                 ("LoRA target modules", targets if isinstance(targets, str) else fmt(targets))]
    steps = ("max steps", t.max_steps) if t.max_steps > 0 else ("epochs", t.num_train_epochs)
    rows += [("learning rate", t.learning_rate), steps, ("batch size per device", t.per_device_train_batch_size),
             ("gradient accumulation", t.gradient_accumulation_steps),
             ("effective batch size (one device)", t.per_device_train_batch_size * t.gradient_accumulation_steps),
             ("scheduler", t.lr_scheduler_type), ("warmup", t.warmup), ("weight decay", t.weight_decay),
             ("optimizer", t.optim), ("max grad norm", t.max_grad_norm), ("max length", t.max_length),
             ("weights dtype", cfg.model.dtype), ("bf16 mixed precision", t.bf16), ("seed", t.seed)]
    if cfg.trainer == "dpo":
        rows.append(("DPO beta", t.beta))
    return [(k, fmt(v)) for k, v in rows]


def evaluation_rows(folder: RunFolder) -> list[dict[str, str]]:
    from ..export.card_facts import eval_from_history

    rows = []
    metrics = read_metrics(folder)
    exact, n = metrics.get("exact_match"), metrics.get("exact_match_rows")
    if isinstance(exact, (int, float)):
        rows.append({"metric": "exact match", "value": f"{exact:.1%}",
                     "detail": EXACT_MATCH.format(n=f"{n} " if isinstance(n, int) and n else "")})
    try:
        history = json.loads(folder.trainer_state.read_text(encoding="utf-8")).get("log_history", [])
    except (OSError, ValueError):
        history = []
    return rows + eval_from_history(history)


def run_card_facts(folder: RunFolder, cfg: RunConfig):
    """The ``CardFacts`` of a finished run."""
    from ..export.card_facts import CardFacts

    base_id, base_note, license = _base(cfg)
    datasets, data_note = _data(cfg)
    method = f"{METHODS.get(cfg.method, cfg.method)}, {cfg.trainer.upper()} with TRL"
    return CardFacts(base_model_id=base_id, base_note=base_note, license=license, datasets=datasets,
                     dataset_note=data_note, method=method, hyperparameters=hyperparameter_rows(cfg),
                     evaluation=evaluation_rows(folder), stats=folder.run_stats() or {})
