"""Push a finished run to the Hub: adapter → ``<id>-lora``, merged 16-bit → ``<id>``, GGUF → ``<id>-GGUF``.

Every artifact is first saved under ``output_dir`` (atomic files), with its model card, a loss-curve
image and, for GGUF, an Ollama ``Modelfile``; then uploaded. A failed push leaves everything on disk
and a rerun completes it: files the Hub already has are skipped (the preupload answer carries their
oid, LFS objects already stored get no upload action). Retries, deadlines and token scrubbing:
``hub_client.py``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Sequence

from ..config import ARTIFACTS
from .artifacts import export_artifacts, hub_id_or_none, hub_repos
from .cards import write_cards
from .hub_client import HubClient, HubPushError, RetryPolicy
from .merged_weights import unwrap_model

logger = logging.getLogger(__name__)

__all__ = ["HubPushError", "RetryPolicy", "push_to_hub"]


def push_to_hub(model, tokenizer, repo_id: str, *, artifacts: Sequence[str] = ARTIFACTS,
                gguf_quantizations: Sequence[str] = ("q8_0",), private: bool = True, base_model_id: str | None = None,
                token: str | None = None, run_stats: dict | None = None, output_dir: str | Path | None = None,
                fast_config=None, datasets: Sequence[str] | None = None, merged_dtype: str = "bfloat16",
                merge_base: str | None = None, retry: RetryPolicy | None = None) -> dict[str, str]:
    """Saves and uploads a finished run, each artifact to its own repo, with model cards.

    Args:
        model: the trained model (PEFT LoRA or full).
        tokenizer: its tokenizer (saved with each artifact, vocabulary of the GGUF files).
        repo_id: "name" or "namespace/name" of the merged model; the adapter goes to ``<id>-lora``,
            GGUF files to ``<id>-GGUF``.
        artifacts: subset of ("adapter", "merged", "gguf").
        gguf_quantizations: GGUF types (see ``save_gguf``).
        private: create the repos as private.
        base_model_id: Hub id of the base model for cards and the adapter config (default: the
            model config's ``_name_or_path`` when it is a Hub id).
        token: Hub token (default: huggingface_hub's stored token / HF_TOKEN). Never logged or saved.
        run_stats: from ``run_stats_from_state`` (steps, loss, tokens/s, peak memory, loss curve).
        output_dir: where artifacts are saved first (default: a new temporary folder, kept).
        fast_config: a FastConfig (or dict) embedded in the cards.
        datasets: dataset ids for the cards' front matter.
        merged_dtype: "bfloat16", "float16" or "float32".
        merge_base: merge onto this 16-bit checkpoint (local folder or Hub id) instead of the
            model's own (possibly NF4) base weights.
        retry: back-off and timeouts of Hub calls.

    Returns:
        {artifact: repo URL}.

    Raises:
        HubPushError: a Hub call failed; the local artifacts stay in ``output_dir``.
    """
    artifacts = tuple(dict.fromkeys(artifacts))
    if not artifacts or any(a not in ARTIFACTS for a in artifacts):
        raise ValueError(f"artifacts must be a non-empty subset of {ARTIFACTS}, got {artifacts}")
    if not repo_id or repo_id.count("/") > 1:
        raise ValueError(f"repo_id must be 'name' or 'namespace/name', got {repo_id!r}")
    output_dir = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="fasttune-push-"))
    hub = HubClient(token, retry or RetryPolicy(), output_dir)
    if "/" not in repo_id:
        repo_id = f"{hub.namespace()}/{repo_id}"
    name = repo_id.split("/")[-1]
    if base_model_id is None:
        base_model_id = hub_id_or_none(getattr(unwrap_model(model).config, "_name_or_path", None))
    folders = export_artifacts(model, tokenizer, output_dir, artifacts, name=name,
                               gguf_quantizations=gguf_quantizations, merged_dtype=merged_dtype,
                               base_model_id=base_model_id, merge_base=merge_base)
    repos = hub_repos(repo_id, folders)
    write_cards(folders, repos, tokenizer=tokenizer, run_stats=run_stats, fast_config=fast_config,
                base_model_id=base_model_id, datasets=datasets, lora=hasattr(model, "peft_config"))
    urls = {}
    for kind in ("merged", "gguf", "adapter"):
        if kind not in folders:
            continue
        urls[kind] = hub.create_repo(repos[kind], private)
        hub.upload_folder(repos[kind], folders[kind], f"fasttune: upload {kind}")
        logger.info("pushed %s to %s", kind, urls[kind])
    return {k: urls[k] for k in folders}
