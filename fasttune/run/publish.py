"""``fasttune export`` and ``fasttune push`` of a finished run folder.

``export_run`` writes ``adapter/``, ``merged/`` and ``gguf/`` with their final cards (base model,
license, data, method, hyperparameters, held-out result, loss curve, usage) and the Ollama
``Modelfile``. ``push_run`` first checks the repo id, offline mode, the token and the Hub; then it
uploads what export made from the same ``final/`` weights, exports only what is missing (an
artifact never exported, a GGUF type asked for and not there; GGUF files already there stay),
re-renders the cards only when pushing to other repo ids than they name, and uploads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from .run_card import run_card_facts
from .finished import load_run, trained_adapter, usable_artifacts
from .folder import RunFolder

logger = logging.getLogger("fasttune.publish")

ALL_ARTIFACTS = ("adapter", "merged", "gguf")


def _name(cfg, folder: RunFolder) -> str:
    """File stem of the run's GGUF files: the repo name of ``fast.hub_model_id``, else the run's name."""
    return (cfg.fast.hub_model_id or cfg.run_name or folder.path.resolve().name).split("/")[-1]


def _export(folder: RunFolder, kinds: Sequence[str], name: str, quants, merged_dtype):
    """Loads the run's model and exports ``kinds`` (manifests name ``final/`` as their source);
    returns (cfg, tokenizer, kind → folder)."""
    from ..export.artifacts import export_artifacts
    from ..export.manifest import source_fingerprint

    cfg, model, tok = load_run(folder.path)
    folders = export_artifacts(model, tok, folder.path, kinds, name=name, gguf_quantizations=quants,
                               merged_dtype=merged_dtype, base_model_id=cfg.hub_base_id(),
                               source=source_fingerprint(folder.final))
    return cfg, tok, folders


def export_run(run_dir: str | Path, artifacts=None, gguf_quantizations=None, merged_dtype=None) -> dict[str, str]:
    """Saves adapter / merged / GGUF files of a finished run under ``run_dir``, each with its model
    card (and the GGUF's Modelfile); returns kind → folder.

    Raises:
        ExportWriteError: a file could not be written (full disk, ...): one line naming it.
        ExportBusyError: another export is writing into the same run folder.
    """
    from ..export.cards import card_repos, write_cards

    folder = RunFolder(run_dir)
    folder.require_finished()
    cfg = folder.load_config()
    wanted = tuple(artifacts or usable_artifacts(cfg.fast.export_artifacts or ALL_ARTIFACTS, folder))
    cfg, tok, folders = _export(folder, wanted, _name(cfg, folder), gguf_quantizations or cfg.fast.gguf_quantizations,
                                merged_dtype or cfg.fast.merged_dtype)
    repos, published = card_repos(cfg.fast.hub_model_id, _name(cfg, folder), folders)
    write_cards(folders, repos, tokenizer=tok, fast_config=cfg.fast, facts=run_card_facts(folder, cfg),
                published=published, lora=trained_adapter(folder))
    out = {k: str(v) for k, v in folders.items()}
    folder.record("artifacts", out)
    return out


def _missing(folder: RunFolder, cfg, wanted, gguf_quantizations, source) -> tuple[list[str], list[str], str | None]:
    """(artifacts to export, GGUF types to export, stem of the GGUF files already there)."""
    from ..export.manifest import gguf_quants, read_manifest, reusable

    missing = [k for k in wanted if k != "gguf" and not reusable(folder.path / k, k, source)]
    quants, stem = [], None
    if "gguf" in wanted:
        have = gguf_quants(folder.path / "gguf", source)
        asked = [q.lower() for q in (gguf_quantizations or ([] if have else cfg.fast.gguf_quantizations))]
        quants = [q for q in asked if q not in have]
        if quants:
            missing.append("gguf")
        if have:
            stem = next(f for f in read_manifest(folder.path / "gguf")["files"]
                        if not f.startswith("mmproj-")).rsplit("-", 1)[0]
    return missing, quants, stem


def push_run(run_dir: str | Path, repo_id: str | None = None, artifacts=None, private: bool | None = None,
             token: str | None = None, gguf_quantizations=None, retry=None) -> dict[str, str]:
    """Uploads a finished run: what export made, plus what is missing; returns kind → repo URL.

    Raises:
        ValueError: no or an invalid repo id. HubPushError: offline, token refused, Hub unreachable
        (all before any work) or a Hub call failed. ExportWriteError: a missing artifact could not
        be written.
    """
    from ..export.artifacts import hub_repos
    from ..export.cards import cards_match, write_cards
    from ..export.hub import push_session, upload_artifacts
    from ..export.manifest import source_fingerprint

    folder = RunFolder(run_dir)
    folder.require_finished()
    cfg = folder.load_config()
    repo_id = repo_id or cfg.fast.hub_model_id
    if not repo_id:
        raise ValueError("repo_id: give --repo-id (the run config has no fast.hub_model_id)")
    wanted = tuple(artifacts or usable_artifacts(cfg.fast.push_artifacts, folder))
    with push_session(repo_id, token, retry, folder.path) as (hub, repo_id):
        source = source_fingerprint(folder.final)
        missing, quants, stem = _missing(folder, cfg, wanted, gguf_quantizations, source)
        tok = None
        if missing:
            logger.info("exporting what is not there yet: %s%s", ", ".join(missing),
                        f" (GGUF {', '.join(quants)})" if quants else "")
            _, tok, _ = _export(folder, missing, stem or repo_id.split("/")[-1], quants or cfg.fast.gguf_quantizations,
                                cfg.fast.merged_dtype)
        folders = {k: folder.path / k for k in wanted}
        repos = hub_repos(repo_id, folders)
        if missing or not cards_match(folders, repos):
            if tok is None:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(folder.final))
            write_cards(folders, repos, tokenizer=tok, fast_config=cfg.fast, facts=run_card_facts(folder, cfg),
                        lora=trained_adapter(folder))
        urls = upload_artifacts(hub, folders, repos, cfg.fast.hub_private if private is None else private)
    folder.record("urls", urls)
    folder.record("artifacts", {k: str(folder.path / k) for k in urls})
    return urls

