"""The Hub calls of a push, made reliable: deadlines, retries with back-off, no token in any message.

Deadlines: every request runs inside ``hub_http.hub_timeouts`` (the push opens it), so a request
that makes no progress for ``RetryPolicy.call_timeout`` seconds fails instead of hanging.
huggingface_hub retries preupload and LFS batch/PUT/verify itself; create_repo, validate-yaml, the
commit, model_info and whoami are retried here with exponential back-off on 5xx/429, timeouts and
dropped connections, within ``total_timeout`` seconds per call. A 429 waits at least
``rate_limit_floor`` seconds, whatever its Retry-After says. The token never reaches a log line, a
saved file or an exception message: messages are scrubbed and exceptions re-raised as
``HubPushError`` without the original chain.
"""

from __future__ import annotations

import logging
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

    def __init__(self, message: str, status_code: int | None = None, output_dir: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.output_dir = output_dir
        self.detail = detail or message  # the failure alone, without what to do next


@dataclass
class RetryPolicy:
    """Deadlines and back-off of Hub calls.

    ``attempts`` tries per call, sleeping base_delay·2^k (≤ max_delay; a 429's Retry-After when longer,
    never less than ``rate_limit_floor``) in between, and no new attempt that would end (taking as
    long as the last one) after ``total_timeout`` seconds. Each request fails after
    ``connect_timeout`` s without a connection or ``call_timeout`` s without progress (a stalled
    upload, a server that never answers).
    """

    attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 30.0
    call_timeout: float = 15.0
    connect_timeout: float = 10.0
    total_timeout: float = 120.0
    rate_limit_floor: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        for name in ("call_timeout", "connect_timeout", "total_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def room_for(self, elapsed: float, delay: float, last_attempt: float) -> bool:
        """Another attempt, as long as the last one, still ends within ``total_timeout``."""
        return elapsed + delay + last_attempt <= self.total_timeout

    def delay(self, attempt: int, exc: BaseException) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based) that raised ``exc``."""
        wait = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        if status_of(exc) == 429:
            wait = max(wait, self.rate_limit_floor, min(self.max_delay, retry_after(exc) or 0.0))
        return wait


class _Scrubber:
    def __init__(self, token: str | None) -> None:
        self.secrets = [t for t in {token} if t and len(t) >= 4]

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


def status_of(exc: BaseException) -> int | None:
    """HTTP status of a failed call (None for network errors and timeouts)."""
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def is_timeout(exc: BaseException) -> bool:
    """A request that hit a deadline (the server may still act on it: a commit can land late)."""
    if isinstance(exc, TimeoutError):
        return True
    for mod_name in ("httpx2", "httpx"):
        mod = _module(mod_name)
        if mod is not None and isinstance(exc, mod.TimeoutException):
            return True
    return False


def _module(name: str):
    try:
        return __import__(name)
    except ImportError:
        return None


def transient(exc: BaseException) -> bool:
    """Worth retrying: 408/429/5xx, a timeout, a dropped or refused connection."""
    if status_of(exc) in _RETRY_STATUS or is_timeout(exc) or isinstance(exc, ConnectionError):
        return True
    for mod_name in ("httpx2", "httpx"):
        mod = _module(mod_name)
        if mod is not None and isinstance(exc, (mod.NetworkError, mod.RemoteProtocolError)):
            return True
    return False


def retry_after(exc: BaseException) -> float | None:
    """The Retry-After header of a failed call, in seconds (None when absent or not a number)."""
    response = getattr(exc, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class HubClient:
    """The Hub calls of one push, with retries, a time budget per call and scrubbed messages."""

    def __init__(self, token: str | None, policy: RetryPolicy, output_dir: Path | str,
                 endpoint: str | None = None) -> None:
        from huggingface_hub import HfApi, get_token

        self.api = HfApi(endpoint=endpoint)  # None: huggingface_hub's (HF_ENDPOINT)
        self.token = token
        self.policy = policy
        self.scrub = _Scrubber(token or get_token())
        self.output_dir = str(output_dir)

    def failure(self, what: str, exc: BaseException, attempts: int, why: str = "") -> HubPushError:
        """The HubPushError for a call that will not be retried (scrubbed, no chained exception)."""
        detail = f"{what} failed after {attempts} attempt(s){why}: " + self.scrub(f"{type(exc).__name__}: {exc}")
        return HubPushError(f"{detail}. Local artifacts are kept in {self.output_dir}; run the push again to resume.",
                            status_of(exc), self.output_dir, detail)

    def call(self, what: str, fn: Callable[[], Any], attempts: int | None = None) -> Any:
        """``fn()``, retried on transient failures within the policy's attempts and time budget."""
        p = self.policy
        tries = attempts or p.attempts
        start = time.monotonic()
        for attempt in range(1, tries + 1):
            began = time.monotonic()
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below, re-raised scrubbed
                if not transient(e) or attempt == tries:
                    raise self.failure(what, e, attempt) from None
                delay = p.delay(attempt, e)
                if not p.room_for(time.monotonic() - start, delay, time.monotonic() - began):
                    raise self.failure(what, e, attempt, f" within {p.total_timeout:g} s") from None
                logger.warning("%s: %s; retry %d/%d in %.1f s", what, self.scrub(f"{type(e).__name__}: {e}")[:300],
                               attempt, tries - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def whoami(self, attempts: int | None = None) -> dict:
        return self.call("whoami", lambda: self.api.whoami(token=self.token), attempts)

    def namespace(self) -> str:
        return self.whoami()["name"]

    def create_repo(self, repo_id: str, private: bool) -> str:
        url = self.call(f"create_repo {repo_id}", lambda: self.api.create_repo(
            repo_id, private=private, exist_ok=True, repo_type="model", token=self.token))
        return str(url)

    def head(self, repo_id: str) -> str | None:
        """The commit id at the head of ``repo_id``'s main branch."""
        info = self.call(f"model_info {repo_id}", lambda: self.api.model_info(
            repo_id, token=self.token, timeout=self.policy.call_timeout))
        return info.sha

    def remote_oids(self, repo_id: str) -> dict[str, str]:
        """path → oid of every file in the repo: the sha256 for LFS files, the git blob sha1 otherwise."""
        def listing():
            out = {}
            for entry in self.api.list_repo_tree(repo_id, recursive=True, token=self.token):
                if hasattr(entry, "blob_id"):
                    lfs = getattr(entry, "lfs", None)
                    out[entry.path] = lfs.sha256 if lfs is not None else entry.blob_id
            return out

        return self.call(f"list files of {repo_id}", listing)
