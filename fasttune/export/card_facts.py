"""What a model card says about how the model was made, as plain data for ``hub_cards``.

``CardFacts`` holds the base model (a Hub id, or in words where it has none), its license, the
data, the method, the hyperparameters as (name, value) rows, held-out results and the run's
statistics. ``facts_from_trainer`` fills it from a finished Trainer (``FastTrainer``'s export);
``run/publish.py`` fills it from a run folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .base_license import BaseLicense

NO_HUB_ID = "it has no Hub id"


@dataclass
class CardFacts:
    """Everything a card states about a trained model; all optional, rendered when present."""

    base_model_id: str | None = None
    base_note: str | None = None
    license: BaseLicense = field(default_factory=BaseLicense)
    datasets: list[str] = field(default_factory=list)
    dataset_note: str | None = None
    method: str | None = None
    hyperparameters: list[tuple[str, str]] = field(default_factory=list)
    evaluation: list[dict[str, str]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def context(self) -> dict[str, Any]:
        """Template context keys (see ``hub_cards.render_card``)."""
        return {"base_model_id": self.base_model_id, "base_note": self.base_note, "license": self.license.text,
                "license_meta": self.license.front_matter(), "datasets": list(self.datasets),
                "dataset_note": self.dataset_note, "method": self.method,
                "hyperparameters": [(str(k), str(v)) for k, v in self.hyperparameters],
                "evaluation": list(self.evaluation)}


def fmt(value: Any) -> str:
    """A hyperparameter value as a table cell."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(str(v) for v in (sorted(value) if isinstance(value, set) else value))
    return str(value)


def lora_rows(peft_config) -> list[tuple[str, str]]:
    """LoRA rank, alpha, dropout and target modules of a PEFT LoraConfig (or a mapping of them)."""
    if isinstance(peft_config, dict):
        peft_config = next(iter(peft_config.values()), None)
    if peft_config is None or getattr(peft_config, "r", None) is None:
        return []
    rows = [("LoRA rank (r)", fmt(peft_config.r)), ("LoRA alpha", fmt(peft_config.lora_alpha)),
            ("LoRA dropout", fmt(peft_config.lora_dropout))]
    targets = peft_config.target_modules
    if targets:
        rows.append(("LoRA target modules", fmt(targets) if not isinstance(targets, str) else targets))
    return rows


def training_rows(args) -> list[tuple[str, str]]:
    """The hyperparameters of a TrainingArguments (or TRL config) that decide what a run learns."""
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    per_device = getattr(args, "per_device_train_batch_size", None)
    accum = getattr(args, "gradient_accumulation_steps", 1) or 1
    rows = [("learning rate", getattr(args, "learning_rate", None)),
            ("max steps" if (getattr(args, "max_steps", -1) or -1) > 0 else "epochs",
             args.max_steps if (getattr(args, "max_steps", -1) or -1) > 0 else getattr(args, "num_train_epochs", None)),
            ("batch size per device", per_device), ("gradient accumulation", accum),
            ("effective batch size", per_device * accum * world if per_device else None),
            ("scheduler", getattr(getattr(args, "lr_scheduler_type", None), "value",
                                  getattr(args, "lr_scheduler_type", None))),
            ("warmup steps", getattr(args, "warmup_steps", None)),
            ("weight decay", getattr(args, "weight_decay", None)),
            ("optimizer", getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None))),
            ("max grad norm", getattr(args, "max_grad_norm", None)), ("max length", getattr(args, "max_length", None)),
            ("bf16", getattr(args, "bf16", None)), ("seed", getattr(args, "seed", None))]
    return [(k, fmt(v)) for k, v in rows if v is not None]


def eval_from_history(log_history: Sequence[dict]) -> list[dict[str, str]]:
    """The last held-out loss the Trainer logged (``eval_loss``), as an evaluation row ([] if none)."""
    last = next((h for h in reversed(list(log_history or [])) if "eval_loss" in h), None)
    if last is None:
        return []
    return [{"metric": "eval loss", "value": f"{float(last['eval_loss']):.4g}",
             "detail": f"mean loss on the evaluation split, step {last.get('step', '?')}"}]


def facts_from_trainer(trainer, base_model_id: str | None, base_note: str | None = None,
                       license: BaseLicense | None = None, stats: dict | None = None) -> CardFacts:
    """Facts of a finished Trainer: hyperparameters from its args and PEFT config, eval loss."""
    model = trainer.model
    peft = getattr(model, "peft_config", None)
    quantized = bool(getattr(getattr(model, "base_model", model), "is_loaded_in_4bit", False))
    method = ("QLoRA (LoRA on a 4-bit NF4 base)" if quantized else "LoRA") if peft else "full fine-tuning"
    args = trainer.args
    dataset = getattr(args, "dataset_name", None)
    history = getattr(trainer.state, "log_history", None) or []
    return CardFacts(base_model_id=base_model_id, base_note=base_note, license=license or BaseLicense(),
                     datasets=[dataset] if dataset and "/" in dataset else [],
                     dataset_note=None if dataset else "not recorded by the trainer",
                     method=f"{method}, {type(trainer).__name__}",
                     hyperparameters=lora_rows(peft) + training_rows(args),
                     evaluation=eval_from_history(history), stats=dict(stats or {}))
