"""The end of ``FastTrainer.train()``: export the artifacts ``FastConfig`` asks for, and push them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..export.artifacts import export_artifacts, hub_id_or_none, hub_repos
from ..export.cards import run_stats_from_state, write_cards
from ..export.hub import push_to_hub
from ..export.merged_weights import unwrap_model


def export_after_training(trainer, fast_config) -> dict[str, Any] | None:
    """End-of-``train()`` export: called by FastTrainer with its ``FastConfig``.

    On the main process only, saves ``fast_config.export_artifacts`` (plus ``push_artifacts`` when
    ``push_to_hub``) under ``args.output_dir/{adapter,merged,gguf}`` and pushes when ``push_to_hub``.

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
    base_model_id = fast_config.base_model_id or hub_id_or_none(
        getattr(unwrap_model(model).config, "_name_or_path", None))
    stats = run_stats_from_state(trainer.state)
    datasets = [d for d in [getattr(trainer.args, "dataset_name", None)] if hub_id_or_none(d)]
    if fast_config.push_to_hub:
        urls = push_to_hub(model, tokenizer, fast_config.hub_model_id, artifacts=wanted,
                           gguf_quantizations=fast_config.gguf_quantizations, private=fast_config.hub_private,
                           base_model_id=base_model_id, token=getattr(trainer.args, "hub_token", None),
                           run_stats=stats, output_dir=output_dir, fast_config=fast_config, datasets=datasets,
                           merged_dtype=fast_config.merged_dtype)
        return {"folders": {k: output_dir / k for k in urls}, "urls": urls}
    name = (fast_config.hub_model_id or output_dir.resolve().name).split("/")[-1]
    folders = export_artifacts(model, tokenizer, output_dir, wanted, name=name,
                               gguf_quantizations=fast_config.gguf_quantizations,
                               merged_dtype=fast_config.merged_dtype, base_model_id=base_model_id)
    if fast_config.hub_model_id and "/" in fast_config.hub_model_id:
        write_cards(folders, hub_repos(fast_config.hub_model_id, folders), tokenizer=tokenizer, run_stats=stats,
                    fast_config=fast_config, base_model_id=base_model_id, datasets=datasets,
                    lora=hasattr(model, "peft_config"))
    return {"folders": folders, "urls": {}}
