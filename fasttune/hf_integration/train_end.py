"""The end of ``FastTrainer.train()``: export the artifacts ``FastConfig`` asks for, and push them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..export.artifacts import export_artifacts, hub_id_or_none
from ..export.base_license import find_base_license
from ..export.card_facts import NO_HUB_ID, facts_from_trainer
from ..export.cards import card_repos, run_stats_from_state, write_cards
from ..export.gguf import gguf_refusal
from ..export.hub import push_to_hub
from ..export.merged_weights import unwrap_model


def _facts(trainer, model, fast_config):
    name_or_path = str(getattr(unwrap_model(model).config, "_name_or_path", "") or "")
    base_model_id = fast_config.base_model_id or hub_id_or_none(name_or_path)
    local = name_or_path if name_or_path and os.path.isdir(name_or_path) else None
    note = None
    if base_model_id is None:
        note = (f"loaded from a local folder, so {NO_HUB_ID} (set FastConfig.base_model_id to name it)" if local
                else f"not recorded, so {NO_HUB_ID}")
    return facts_from_trainer(trainer, base_model_id, note, find_base_license(base_model_id, local),
                              run_stats_from_state(trainer.state))


def check_export_before_training(model, fast_config) -> None:
    """Refuse at the start what the end-of-``train()`` export would refuse after the training: a GGUF
    artifact (in ``export_artifacts``, or in ``push_artifacts`` with ``push_to_hub``) of a model whose
    family or config fasttune cannot write as GGUF.

    Raises:
        ValueError: naming the argument and why.
    """
    wanted = set(fast_config.export_artifacts)
    if fast_config.push_to_hub:
        wanted |= set(fast_config.push_artifacts)
    if "gguf" not in wanted:
        return
    why = gguf_refusal(unwrap_model(model).config)
    if why is not None:
        where = "export_artifacts" if "gguf" in fast_config.export_artifacts else "push_artifacts"
        raise ValueError(f"fast_config.{where} asks for a GGUF artifact, which would fail after training: "
                         f"{why.rstrip('.')}. Leave 'gguf' out of {where}.")


def export_after_training(trainer, fast_config) -> dict[str, Any] | None:
    """End-of-``train()`` export: called by FastTrainer with its ``FastConfig``.

    On the main process only, saves ``fast_config.export_artifacts`` (plus ``push_artifacts`` when
    ``push_to_hub``) under ``args.output_dir/{adapter,merged,gguf}``, each with its model card, and
    pushes when ``push_to_hub``.

    Returns:
        {"folders": {kind: path}, "urls": {kind: url}} or None when there is nothing to do here.
    """
    if hasattr(trainer, "is_world_process_zero") and not trainer.is_world_process_zero():
        return None
    wanted = list(fast_config.export_artifacts)
    if fast_config.push_to_hub:
        wanted += [a for a in fast_config.push_artifacts if a not in wanted]
    if not wanted:
        return None
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    tokenizer = getattr(trainer, "processing_class", None)
    output_dir = Path(trainer.args.output_dir)
    facts = _facts(trainer, model, fast_config)
    if fast_config.push_to_hub:
        urls = push_to_hub(model, tokenizer, fast_config.hub_model_id, artifacts=wanted,
                           gguf_quantizations=fast_config.gguf_quantizations, private=fast_config.hub_private,
                           base_model_id=facts.base_model_id, token=getattr(trainer.args, "hub_token", None),
                           output_dir=output_dir, fast_config=fast_config, merged_dtype=fast_config.merged_dtype,
                           facts=facts)
        return {"folders": {k: output_dir / k for k in urls}, "urls": urls}
    name = (fast_config.hub_model_id or output_dir.resolve().name).split("/")[-1]
    folders = export_artifacts(model, tokenizer, output_dir, wanted, name=name,
                               gguf_quantizations=fast_config.gguf_quantizations,
                               merged_dtype=fast_config.merged_dtype, base_model_id=facts.base_model_id)
    repos, published = card_repos(fast_config.hub_model_id, name, folders)
    write_cards(folders, repos, tokenizer=tokenizer, fast_config=fast_config, facts=facts, published=published,
                lora=hasattr(model, "peft_config"))
    return {"folders": folders, "urls": {}}
