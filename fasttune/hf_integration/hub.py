"""Push a finished run to the Hub: adapter → ``<id>-lora``, merged 16-bit → ``<id>``, GGUF → ``<id>-GGUF``.

Every artifact is first saved under ``output_dir`` (atomic files), with its model card, a loss-curve
image and, for GGUF, an Ollama ``Modelfile``; then uploaded. A failed push leaves everything on disk
and a rerun completes it: files the Hub already has are skipped (the preupload answer carries their
oid, LFS objects already stored get no upload action).

Reliability: huggingface_hub retries preupload, LFS batch/PUT/verify itself but not create_repo,
validate-yaml, the commit call, model_info or whoami. Those run here with exponential back-off on
5xx/429, timeouts and dropped connections; calls that huggingface_hub sends without a timeout run
under a deadline (``RetryPolicy.call_timeout``). The token never reaches a log line, a card, a saved
file or an exception message: messages are scrubbed and exceptions re-raised as ``HubPushError``
without the original chain.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .export import atomic_write, save_adapter, save_merged
from .gguf import save_gguf
from .merged_weights import unwrap_model

logger = logging.getLogger(__name__)

ARTIFACTS = ("adapter", "merged", "gguf")
_RETRY_STATUS = (408, 429, 500, 502, 503, 504)


class HubPushError(RuntimeError):
    """A Hub call failed (after retries where the failure was transient). The message holds no token.

    Attributes:
        status_code: HTTP status of the last failure, or None (network error, timeout).
        output_dir: where the local artifacts were kept.
    """

    def __init__(self, message: str, status_code: int | None = None, output_dir: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.output_dir = output_dir


@dataclass
class RetryPolicy:
    """Back-off for Hub calls: ``attempts`` tries, sleeping base_delay·2^k (≤ max_delay, or the 429
    Retry-After) in between; calls huggingface_hub sends without a timeout get ``call_timeout`` s."""

    attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 30.0
    call_timeout: float = 120.0


class _Scrubber:
    def __init__(self, token: str | None) -> None:
        self.secrets = [t for t in {token} if t and len(t) >= 4]

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


class _CallTimeout(TimeoutError):
    pass


def _with_deadline(fn: Callable[[], Any], timeout: float | None) -> Any:
    """Runs ``fn`` in a daemon thread and gives up waiting after ``timeout`` s (the thread is left to
    finish on its own: huggingface_hub offers no per-call timeout for these requests)."""
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="fasttune-hub-call")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _CallTimeout(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _transient(exc: BaseException) -> bool:
    if _status(exc) in _RETRY_STATUS:
        return True
    if isinstance(exc, (_CallTimeout, TimeoutError, ConnectionError)):
        return True
    for mod_name in ("httpx2", "httpx"):
        try:
            mod = __import__(mod_name)
        except ImportError:
            continue
        if isinstance(exc, (mod.TimeoutException, mod.NetworkError, mod.RemoteProtocolError)):
            return True
    return False


def _retry_after(exc: BaseException) -> float | None:
    response = getattr(exc, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class _Hub:
    """The Hub calls of one push, with retries, deadlines and scrubbing."""

    def __init__(self, token: str | None, policy: RetryPolicy, output_dir: Path) -> None:
        from huggingface_hub import HfApi, get_token

        self.api = HfApi()
        self.token = token
        self.policy = policy
        self.scrub = _Scrubber(token or get_token())
        self.output_dir = str(output_dir)

    def call(self, what: str, fn: Callable[[], Any], deadline: bool = True) -> Any:
        p = self.policy
        for attempt in range(1, p.attempts + 1):
            try:
                return _with_deadline(fn, p.call_timeout if deadline else None)
            except Exception as e:  # noqa: BLE001 - classified below, re-raised scrubbed
                status = _status(e)
                detail = self.scrub(f"{type(e).__name__}: {e}")
                if not _transient(e) or attempt == p.attempts:
                    raise HubPushError(f"{what} failed after {attempt} attempt(s): {detail}. Local artifacts are "
                                       f"kept in {self.output_dir}; run the push again to resume.",
                                       status, self.output_dir) from None
                delay = _retry_after(e) if status == 429 else None
                delay = min(p.max_delay, delay if delay is not None else p.base_delay * 2 ** (attempt - 1))
                logger.warning("%s: %s; retry %d/%d in %.1f s", what, detail[:300], attempt, p.attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def namespace(self) -> str:
        info = self.call("whoami", lambda: self.api.whoami(token=self.token))
        return info["name"]

    def create_repo(self, repo_id: str, private: bool) -> str:
        url = self.call(f"create_repo {repo_id}", lambda: self.api.create_repo(
            repo_id, private=private, exist_ok=True, repo_type="model", token=self.token))
        return str(url)

    def upload_folder(self, repo_id: str, folder: Path, message: str) -> None:
        from huggingface_hub import CommitOperationAdd

        files = [p for p in sorted(folder.rglob("*")) if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
        ops = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
               for p in files]
        # LFS uploads can take long: no deadline (huggingface_hub retries them itself).
        self.call(f"upload to {repo_id}", lambda: self.api.preupload_lfs_files(
            repo_id, additions=ops, token=self.token, free_memory=False), deadline=False)
        # Fresh operation objects per attempt: a timed-out attempt may still be running.
        self.call(f"commit to {repo_id}", lambda: self.api.create_commit(
            repo_id, operations=[copy.copy(op) for op in ops], commit_message=message, token=self.token))
        info = self.call(f"model_info {repo_id}", lambda: self.api.model_info(
            repo_id, token=self.token, timeout=self.policy.call_timeout), deadline=False)
        remote = {s.rfilename for s in (info.siblings or [])}
        missing = sorted(op.path_in_repo for op in ops if op.path_in_repo not in remote)
        if missing:
            raise HubPushError(f"{repo_id} is missing {missing} after the commit", None, self.output_dir)


# --- run statistics and images --------------------------------------------------------------

def run_stats_from_state(state) -> dict[str, Any]:
    """Steps, final loss, tokens/s, peak memory, runtime and the loss curve from a ``TrainerState``.

    Reads ``log_history`` keys "loss", "tokens_per_second" and "peak_memory_gib" (logged by
    FastTrainer), "train_runtime" and "train_loss" (the Trainer's summary).
    """
    history = list(getattr(state, "log_history", None) or [])
    curve = [(int(h.get("step", i)), float(h["loss"])) for i, h in enumerate(history) if "loss" in h]

    def last(key):
        return next((h[key] for h in reversed(history) if key in h), None)

    peaks = [h["peak_memory_gib"] for h in history if "peak_memory_gib" in h]
    final_loss = curve[-1][1] if curve else last("train_loss")
    return {"global_step": getattr(state, "global_step", None), "final_loss": final_loss,
            "tokens_per_second": last("tokens_per_second"), "peak_memory_gib": max(peaks) if peaks else None,
            "train_runtime": last("train_runtime"), "loss_curve": curve}


def write_loss_curve(points: Sequence[tuple[int, float]], path: Path) -> str | None:
    """Writes a PNG of the loss curve; returns None, or why no image was written."""
    if len(points) < 2:
        return "Loss curve not shown: fewer than two logged losses."
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "Loss curve not shown: matplotlib is not installed."
    import io

    fig = Figure(figsize=(6, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([p[0] for p in points], [p[1] for p in points], color="#3b6fb6", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    atomic_write(path, buf.getvalue())
    return None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_HEADLINE_QUANTS = ("Q8_0", "Q4_K_M", "Q6_K", "Q5_K_M")


def _quant_of(path: Path) -> str:
    stem = path.stem
    for q in sorted(("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M",
                     "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"), key=len, reverse=True):
        if stem.endswith("-" + q):
            return q
    return stem.rsplit("-", 1)[-1]


def _gguf_rank(path: Path) -> tuple:
    q = _quant_of(path)
    return (_HEADLINE_QUANTS.index(q) if q in _HEADLINE_QUANTS else len(_HEADLINE_QUANTS), path.name)


def hub_id_or_none(name: str | None) -> str | None:
    """``name`` if it looks like a Hub model id (``namespace/name``, not a local path), else None."""
    if not name or os.path.exists(name) or not re.fullmatch(r"[\w.\-]+/[\w.\-]+", str(name)):
        return None
    return str(name)


# --- export + cards ----------------------------------------------------------------------------

def export_artifacts(model, tokenizer, root: str | Path, artifacts: Sequence[str], *, name: str,
                     gguf_quantizations: Sequence[str] = ("q8_0",), merged_dtype: str = "bfloat16",
                     base_model_id: str | None = None, merge_base: str | None = None) -> dict[str, Path]:
    """Saves the requested artifacts under ``root/{adapter,merged,gguf}``; returns kind → folder.

    The adapter is skipped (with a log line) for a model without PEFT adapters.
    """
    from peft import PeftModel

    bad = [a for a in artifacts if a not in ARTIFACTS]
    if bad:
        raise ValueError(f"artifacts: {bad} not in {ARTIFACTS}")
    root = Path(root)
    out: dict[str, Path] = {}
    if "adapter" in artifacts:
        if isinstance(model, PeftModel):
            out["adapter"] = save_adapter(model, root / "adapter", tokenizer, base_model_id=base_model_id)
        else:
            logger.warning("not a PEFT model: skipping the adapter artifact")
    if "merged" in artifacts:
        out["merged"] = save_merged(model, root / "merged", tokenizer, base=merge_base, dtype=merged_dtype)
    if "gguf" in artifacts:
        source = out.get("merged", model)
        written = save_gguf(source, tokenizer, root / "gguf", gguf_quantizations, name=name,
                            base_model_id=base_model_id)
        for stale in set((root / "gguf").glob("*.gguf")) - set(written):  # from an earlier export here
            stale.unlink()
        out["gguf"] = root / "gguf"
    return out


def write_cards(folders: dict[str, Path], repos: dict[str, str], *, tokenizer=None, run_stats=None,
                fast_config=None, base_model_id=None, datasets=None, endpoint: str | None = None,
                lora: bool = True) -> None:
    """README.md (+ loss_curve.png, + Modelfile for GGUF) in each artifact folder; ``lora`` says
    whether the run trained adapters (the merged card then says they were merged) or all weights."""
    from fasttune.hub_cards import render_card

    if endpoint is None:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    stats = dict(run_stats or {})
    curve = stats.pop("loss_curve", None) or []
    config = fast_config.to_dict() if hasattr(fast_config, "to_dict") else fast_config
    for kind, folder in folders.items():
        note = write_loss_curve(curve, folder / "loss_curve.png") if curve else "No training log available."
        ctx = dict(repo_id=repos[kind], repos=repos, endpoint=endpoint, base_model_id=base_model_id,
                   datasets=list(datasets or []), stats=stats, fast_config=config,
                   loss_curve=None if note else "loss_curve.png", loss_curve_note=note,
                   chat_template=getattr(tokenizer, "chat_template", None), lora=lora)
        if kind == "gguf":
            files = sorted(folder.glob("*.gguf"), key=_gguf_rank)  # the usage snippets show the first
            ctx["gguf_files"] = [{"file": f.name, "quant": _quant_of(f), "size": _human(f.stat().st_size)}
                                 for f in files]
            if files:
                ctx["modelfile_gguf"] = files[0].name
                atomic_write(folder / "Modelfile", render_card("modelfile", **ctx))
        atomic_write(folder / "README.md", render_card(kind, **ctx))


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
    hub = _Hub(token, retry or RetryPolicy(), output_dir)
    if "/" not in repo_id:
        repo_id = f"{hub.namespace()}/{repo_id}"
    name = repo_id.split("/")[-1]
    if base_model_id is None:
        base_model_id = hub_id_or_none(getattr(unwrap_model(model).config, "_name_or_path", None))
    folders = export_artifacts(model, tokenizer, output_dir, artifacts, name=name,
                               gguf_quantizations=gguf_quantizations, merged_dtype=merged_dtype,
                               base_model_id=base_model_id, merge_base=merge_base)
    repos = {"adapter": f"{repo_id}-lora", "merged": repo_id, "gguf": f"{repo_id}-GGUF"}
    repos = {k: v for k, v in repos.items() if k in folders}
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
        repo = fast_config.hub_model_id
        repos = {k: v for k, v in {"adapter": f"{repo}-lora", "merged": repo, "gguf": f"{repo}-GGUF"}.items()
                 if k in folders}
        write_cards(folders, repos, tokenizer=tokenizer, run_stats=stats, fast_config=fast_config,
                    base_model_id=base_model_id, datasets=datasets, lora=hasattr(model, "peft_config"))
    return {"folders": folders, "urls": {}}
