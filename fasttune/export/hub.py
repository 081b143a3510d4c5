"""Push a finished run to the Hub: adapter → ``<id>-lora``, merged 16-bit → ``<id>``, GGUF → ``<id>-GGUF``.

Before any work, ``push_session`` checks the repo id, offline mode, the token and that the Hub
answers (``hub_preflight.py``), and puts deadlines on every request (``hub_http.py``). Then the
artifacts are saved under ``output_dir`` (atomic files) with their cards, loss-curve image and,
for GGUF, an Ollama ``Modelfile``, and uploaded, one commit per repo that is never applied twice
(``hub_upload.py``). A failed push leaves everything on disk and a rerun completes it: files the
Hub already has are skipped. Retries, deadlines and token scrubbing: ``hub_client.py``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from ..config import ARTIFACTS
from .artifacts import export_artifacts, hub_id_or_none, hub_repos
from .base_license import find_base_license
from .card_facts import CardFacts
from .cards import write_cards
from .hub_client import HubClient, HubPushError, RetryPolicy
from .hub_http import hub_timeouts
from .hub_preflight import check_online, check_repo_id, preflight
from .hub_upload import upload_folder
from .merged_weights import unwrap_model

logger = logging.getLogger(__name__)

__all__ = ["HubPushError", "RetryPolicy", "push_session", "push_to_hub", "upload_artifacts"]


@contextlib.contextmanager
def push_session(repo_id: str, token: str | None, retry: RetryPolicy | None, output_dir: str | Path,
                 endpoint: str | None = None) -> Iterator[tuple[HubClient, str]]:
    """Checks everything a push needs before any work, then yields (client, ``namespace/name``);
    every huggingface_hub request inside the block runs under the policy's deadlines.

    Raises:
        ValueError: invalid repo id. HubPushError: offline, no or bad token, Hub unreachable.
    """
    check_repo_id(repo_id)
    check_online()
    policy = retry or RetryPolicy()
    with hub_timeouts(connect=policy.connect_timeout, stall=policy.call_timeout):
        hub = HubClient(token, policy, output_dir, endpoint)
        yield hub, preflight(hub, repo_id)


def upload_artifacts(hub: HubClient, folders: dict[str, Path], repos: dict[str, str], private: bool) -> dict[str, str]:
    """Creates each repo (kept when it exists) and uploads its folder; returns kind → repo URL."""
    urls = {}
    for kind in ("merged", "gguf", "adapter"):
        if kind not in folders:
            continue
        urls[kind] = hub.create_repo(repos[kind], private)
        upload_folder(hub, repos[kind], folders[kind], f"fasttune: upload {kind}")
        logger.info("pushed %s to %s", kind, urls[kind])
    return {k: urls[k] for k in folders}


def push_to_hub(model, tokenizer, repo_id: str, *, artifacts: Sequence[str] = ARTIFACTS,
                gguf_quantizations: Sequence[str] = ("q8_0",), private: bool = True, base_model_id: str | None = None,
                token: str | None = None, run_stats: dict | None = None, output_dir: str | Path | None = None,
                fast_config=None, datasets: Sequence[str] | None = None, merged_dtype: str = "bfloat16",
                merge_base: str | None = None, retry: RetryPolicy | None = None,
                facts: CardFacts | None = None) -> dict[str, str]:
    """Saves and uploads a trained model, each artifact to its own repo, with model cards.

    Args:
        model: the trained model (PEFT LoRA or full).
        tokenizer: its tokenizer (saved with each artifact, vocabulary of the GGUF files).
        repo_id: "name" or "namespace/name" of the merged model; the adapter goes to ``<id>-lora``,
            GGUF files to ``<id>-GGUF``. Checked (with the token and the Hub) before any export.
        artifacts: subset of ("adapter", "merged", "gguf").
        gguf_quantizations: GGUF types (see ``save_gguf``).
        private: create the repos as private.
        base_model_id: Hub id of the base model for cards and the adapter config (default: the
            model config's ``_name_or_path`` when it is a Hub id).
        token: Hub token (default: huggingface_hub's stored token / HF_TOKEN). Never logged or saved.
        run_stats: from ``run_stats_from_state`` (steps, loss, tokens/s, peak memory, loss curve).
        output_dir: where artifacts are saved first (default: a new temporary folder, kept).
        fast_config: a FastConfig (or dict) shown in the cards.
        datasets: dataset ids for the cards' front matter.
        merged_dtype: "bfloat16", "float16" or "float32".
        merge_base: merge onto this 16-bit checkpoint (local folder or Hub id) instead of the
            model's own (possibly NF4) base weights.
        retry: deadlines and back-off of Hub calls.
        facts: what the cards state (method, hyperparameters, license, held-out results); built
            from ``base_model_id``, ``datasets`` and ``run_stats`` when not given.

    Returns:
        {artifact: repo URL}.

    Raises:
        ValueError: bad arguments (invalid repo id, unknown artifact).
        HubPushError: offline, token refused, or a Hub call failed; local artifacts stay in ``output_dir``.
        ExportWriteError: an artifact could not be written (full disk, ...).
    """
    artifacts = tuple(dict.fromkeys(artifacts))
    if not artifacts or any(a not in ARTIFACTS for a in artifacts):
        raise ValueError(f"artifacts must be a non-empty subset of {ARTIFACTS}, got {artifacts}")
    check_repo_id(repo_id)
    output_dir = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="fasttune-push-"))
    with push_session(repo_id, token, retry, output_dir) as (hub, repo_id):
        if base_model_id is None:
            base_model_id = hub_id_or_none(getattr(unwrap_model(model).config, "_name_or_path", None))
        folders = export_artifacts(model, tokenizer, output_dir, artifacts, name=repo_id.split("/")[-1],
                                   gguf_quantizations=gguf_quantizations, merged_dtype=merged_dtype,
                                   base_model_id=base_model_id, merge_base=merge_base)
        if facts is None:
            facts = CardFacts(base_model_id=base_model_id, datasets=list(datasets or []), stats=dict(run_stats or {}),
                              license=find_base_license(base_model_id))
        write_cards(folders, hub_repos(repo_id, folders), tokenizer=tokenizer, fast_config=fast_config,
                    facts=facts, lora=hasattr(model, "peft_config"))
        return upload_artifacts(hub, folders, hub_repos(repo_id, folders), private)
