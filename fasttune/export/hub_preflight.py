"""What a push checks before it does any work: the repo id, offline mode, the token, the Hub itself.

Merging and converting take minutes; a push that would fail at the first Hub call fails here
instead, in seconds, with what to fix: an invalid repo id (huggingface_hub's own validator, also
on the ``-lora``/``-GGUF`` repos derived from it), ``HF_HUB_OFFLINE`` set, no token, a token the
Hub rejects or that cannot write, or a Hub that cannot be reached (one ``whoami`` call, retried a
few times under the push's deadlines).
"""

from __future__ import annotations

import os

from .hub_client import HubClient, HubPushError

REPO_SUFFIXES = ("", "-lora", "-GGUF")
_TRUE = ("1", "on", "yes", "true")


def check_repo_id(repo_id) -> None:
    """ValueError naming ``repo_id`` and the rule it breaks, unless it and its derived repos are valid."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo_id must be 'name' or 'namespace/name', got {repo_id!r}")
    for suffix in REPO_SUFFIXES:
        try:
            validate_repo_id(repo_id + suffix)
        except HFValidationError as e:
            what = "" if not suffix else f" (the {suffix[1:]} repo {repo_id + suffix!r})"
            raise ValueError(f"repo_id {repo_id!r} is not a valid Hub repo id{what}: {e}") from None


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set now, or was when huggingface_hub was imported."""
    if any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def check_online() -> None:
    """HubPushError at once when huggingface_hub is in offline mode (it would refuse every call)."""
    if offline():
        raise HubPushError("HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so the Hub cannot be reached: unset "
                           "it (or set it to 0) to push. Nothing was exported or uploaded.")


def preflight(hub: HubClient, repo_id: str, attempts: int = 3) -> str:
    """Checks the repo id, offline mode, the token and the Hub; returns ``namespace/name``.

    Raises:
        ValueError: the repo id is invalid.
        HubPushError: offline, no token, token rejected or read-only, Hub unreachable.
    """
    from huggingface_hub import get_token

    check_repo_id(repo_id)
    check_online()
    endpoint = hub.api.endpoint
    if not (hub.token or get_token()):
        raise HubPushError("no Hub token: set HF_TOKEN, run `hf auth login`, or pass a token (fasttune push "
                           "--token). Nothing was exported or uploaded.")
    try:
        info = hub.whoami(attempts=min(attempts, hub.policy.attempts))
    except HubPushError as e:
        if e.status_code == 401:
            raise HubPushError(f"the Hub at {endpoint} rejected the token (401): use a valid token with write "
                               "access. Nothing was exported or uploaded.", 401) from None
        if e.status_code is None or e.status_code >= 500 or e.status_code == 429:
            raise HubPushError(f"cannot reach the Hub at {endpoint}: {e.detail}. Nothing was exported or uploaded.",
                               e.status_code) from None
        raise
    access = (info.get("auth") or {}).get("accessToken") or {}
    if access.get("role") == "read":
        raise HubPushError(f"the token is read-only ({access.get('displayName', 'unnamed')}): pushing needs a token "
                           "with write access. Nothing was exported or uploaded.", 403)
    return repo_id if "/" in repo_id else f"{info['name']}/{repo_id}"

