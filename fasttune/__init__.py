"""fasttune: faster, leaner fine-tuning of open LLMs inside the Hugging Face Trainer.

    from fasttune import FastTrainer, FastConfig          # in place of transformers.Trainer
    from fasttune import FastPatchCallback                # on an existing (TRL) trainer

Importing fasttune changes nothing in torch, transformers, peft or trl: names resolve lazily and
patches apply to model instances only (``patch_model``), never to classes.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name → module that defines it (imported on first use).
_EXPORTS = {
    "FastConfig": "fasttune.config",
    "patch_model": "fasttune.model_patches",
    "unpatch_model": "fasttune.model_patches",
    "patch_report": "fasttune.model_patches",
    "PatchReport": "fasttune.model_patches",
    "FAMILIES": "fasttune.model_patches",
    "FastTrainer": "fasttune.hf_integration.trainer",
    "FastPatchCallback": "fasttune.hf_integration.callback",
    "FastSFTTrainer": "fasttune.hf_integration.trl",
    "FastDPOTrainer": "fasttune.hf_integration.trl",
    "FastGRPOTrainer": "fasttune.hf_integration.trl",
    "FastKTOTrainer": "fasttune.hf_integration.trl",
    "FastRLOOTrainer": "fasttune.hf_integration.trl",
    "save_adapter": "fasttune.export.adapter",
    "save_merged": "fasttune.export.merged",
    "save_gguf": "fasttune.export.gguf",
    "push_to_hub": "fasttune.export.hub",
    "load_model": "fasttune.hf_integration.loader",
    "LoraSpec": "fasttune.hf_integration.lora_spec",
    "ModelLoadError": "fasttune.hf_integration.loader",
    "HubPushError": "fasttune.export.hub",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fasttune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
