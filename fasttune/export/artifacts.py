"""The artifacts of a finished run under one folder: ``adapter/``, ``merged/`` (16-bit) and ``gguf/``.

One export at a time per folder (``leftovers.export_lock``); it first sweeps what an interrupted
export left behind, and records in each folder what it wrote and from which source
(``manifest.py``), so a later push can reuse it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Sequence

from ..config import ARTIFACTS
from .adapter import save_adapter
from .gguf import save_gguf
from .gguf_tokenizer import gguf_vocab
from .leftovers import export_lock, remove_stranded
from .manifest import artifact_files, gguf_quants, write_manifest
from .merged import save_merged
from .merged_weights import unwrap_model

logger = logging.getLogger(__name__)


def hub_id_or_none(name: str | None) -> str | None:
    """``name`` if it looks like a Hub model id (``namespace/name``, not a local path), else None."""
    if not name or os.path.exists(name) or not re.fullmatch(r"[\w.\-]+/[\w.\-]+", str(name)):
        return None
    return str(name)


def hub_repos(repo_id: str, kinds) -> dict[str, str]:
    """Artifact kind → its Hub repo, for the kinds in ``kinds``: merged → ``repo_id``, adapter →
    ``<repo_id>-lora``, GGUF → ``<repo_id>-GGUF``."""
    repos = {"adapter": f"{repo_id}-lora", "merged": repo_id, "gguf": f"{repo_id}-GGUF"}
    return {k: v for k, v in repos.items() if k in kinds}


def export_artifacts(model, tokenizer, root: str | Path, artifacts: Sequence[str], *, name: str,
                     gguf_quantizations: Sequence[str] = ("q8_0",), merged_dtype: str = "bfloat16",
                     base_model_id: str | None = None, merge_base: str | None = None,
                     source: str | None = None) -> dict[str, Path]:
    """Saves the requested artifacts under ``root/{adapter,merged,gguf}``; returns kind → folder.

    The adapter is skipped (with a log line) for a model without PEFT adapters. ``source`` names
    the trained weights (``manifest.source_fingerprint``): GGUF files of other types exported from
    the same source stay beside the new ones; files of an earlier source (or of an unknown one)
    are removed.

    Raises:
        ExportBusyError: another export is writing into ``root``.
        ExportWriteError: the disk is full or a file cannot be written (one line, with the path).
    """
    from peft import PeftModel

    bad = [a for a in artifacts if a not in ARTIFACTS]
    if bad:
        raise ValueError(f"artifacts: {bad} not in {ARTIFACTS}")
    root = Path(root)
    config = unwrap_model(model).config
    n_vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if "gguf" in artifacts and tokenizer is not None and n_vocab:
        # a tokenizer GGUF cannot hold is refused before anything is written (a VLM's processor: its tokenizer)
        gguf_vocab(getattr(tokenizer, "tokenizer", tokenizer) if hasattr(tokenizer, "image_processor") else tokenizer,
                   n_vocab)
    out: dict[str, Path] = {}
    with export_lock(root):
        remove_stranded(root)
        if "adapter" in artifacts:
            if isinstance(model, PeftModel):
                out["adapter"] = save_adapter(model, root / "adapter", tokenizer, base_model_id=base_model_id)
                write_manifest(out["adapter"], "adapter", source, artifact_files(out["adapter"], "adapter"))
            else:
                logger.warning("not a PEFT model: skipping the adapter artifact")
        if "merged" in artifacts:
            out["merged"] = save_merged(model, root / "merged", tokenizer, base=merge_base, dtype=merged_dtype)
            write_manifest(out["merged"], "merged", source, artifact_files(out["merged"], "merged"),
                           dtype=merged_dtype)
        if "gguf" in artifacts:
            folder = root / "gguf"
            kept = set(gguf_quants(folder, source).values()) if source else set()
            written = save_gguf(out.get("merged", model), tokenizer, folder, gguf_quantizations, name=name,
                                base_model_id=base_model_id)
            for stale in set(folder.glob("*.gguf")) - set(written) - kept:  # of another model
                stale.unlink()
            write_manifest(folder, "gguf", source, [p.name for p in sorted(set(written) | kept) if p.exists()])
            out["gguf"] = folder
    return out
