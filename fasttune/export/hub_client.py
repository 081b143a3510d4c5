"""The Hub calls of a push, made reliable: retries with back-off, deadlines, no token in any message.

huggingface_hub retries preupload, LFS batch/PUT/verify itself but not create_repo, validate-yaml,
the commit call, model_info or whoami. Those run here with exponential back-off on 5xx/429,
timeouts and dropped connections; calls that huggingface_hub sends without a timeout run under a
deadline (``RetryPolicy.call_timeout``). The token never reaches a log line, a saved file or an
exception message: messages are scrubbed and exceptions re-raised as ``HubPushError`` without the
original chain.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

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


class HubClient:
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
