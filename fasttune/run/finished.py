"""A finished run's model, as export and push load it: the trained adapter on its 16-bit base, or
the fully fine-tuned weights, from the run folder alone.

The base loads from where the run took it (Hub id, local folder); the embedded base is rebuilt
under ``base/`` when missing (same seed, same weights).
"""

from __future__ import annotations

from pathlib import Path

from .config import RunConfig
from .folder import RunFolder
from .sources import EMBEDDED, classify_model


def torch_dtype(name: str):
    """The torch dtype of a run config's ``model.dtype`` ("auto": bfloat16 on a bf16 GPU, else float32)."""
    import torch

    if name == "auto":
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return getattr(torch, name)


def base_path(cfg: RunConfig, folder: RunFolder) -> str:
    """Where the base weights load from; the embedded model is built and saved under ``folder.base``."""
    if classify_model(cfg.model.base) != EMBEDDED:
        return cfg.model.base
    base = folder.base
    if not (base / "config.json").exists():
        from .. import embedded

        tok = embedded.build_tokenizer()
        embedded.build_model(tok, seed=cfg.training.seed).save_pretrained(str(base))
        tok.save_pretrained(str(base))
    return str(base)


def load_base(cfg: RunConfig, folder: RunFolder):
    """The 16-bit base of a run (also for QLoRA: a clean merge), unpatched, on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_path(cfg, folder), dtype=torch_dtype(cfg.model.dtype),
                                                revision=cfg.model.revision)


def load_run(run_dir: str | Path):
    """(cfg, model, tokenizer) of a finished run: the full model, or the adapter on its 16-bit base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = RunFolder(run_dir)
    folder.require_finished()
    cfg = folder.load_config()
    tok = AutoTokenizer.from_pretrained(str(folder.final))
    if trained_adapter(folder):
        from peft import PeftModel

        model = PeftModel.from_pretrained(load_base(cfg, folder), str(folder.final))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder.final), dtype=torch_dtype(cfg.model.dtype))
    return cfg, model, tok


def trained_adapter(folder: RunFolder) -> bool:
    """The run trained a LoRA adapter (``final/`` holds one), not every weight."""
    return (folder.final / "adapter_config.json").is_file()


def usable_artifacts(wanted, model_or_folder) -> tuple[str, ...]:
    """``wanted`` without "adapter" when the run has no LoRA adapter (a full fine-tune); takes the
    loaded model or the run folder."""
    if isinstance(model_or_folder, RunFolder):
        lora = trained_adapter(model_or_folder)
    else:
        from peft import PeftModel

        lora = isinstance(model_or_folder, PeftModel)
    return tuple(a for a in wanted if a != "adapter" or lora)
