"""The LoRA adapter as PEFT saves it, written atomically, pointing at the base's Hub id."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .atomic import staged_dir


def save_adapter(model: nn.Module, out_dir: str | Path, tokenizer=None, *, base_model_id: str | None = None) -> Path:
    """Saves the PEFT adapter (``adapter_model.safetensors``, ``adapter_config.json``) and tokenizer.

    Args:
        model: a ``peft.PeftModel``.
        out_dir: destination folder (created).
        tokenizer: saved beside the adapter when given.
        base_model_id: Hub id written as ``base_model_name_or_path`` when the base was loaded
            from a local path (otherwise the adapter would point at a path nobody else has).

    Returns:
        ``out_dir`` as a Path.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"model must be a peft.PeftModel to save an adapter, got {type(model).__name__}")
    out_dir = Path(out_dir)
    # roughly what PEFT writes (the trained weights), for the space a full disk would need
    expected = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    with staged_dir(out_dir, expected_bytes=expected or None) as stage:
        model.save_pretrained(str(stage), safe_serialization=True)
        if base_model_id:
            for cfg_path in stage.rglob("adapter_config.json"):
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
                cfg["base_model_name_or_path"] = base_model_id
                cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(stage))
    return out_dir
