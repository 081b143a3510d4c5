"""Upload one artifact folder to its repo as one commit, retried without ever committing twice.

1. The repo's head is read, then huggingface_hub's ``preupload_lfs_files`` sends the LFS objects it
   does not have yet (content-addressed: a retry or a late duplicate stores nothing new).
2. The commit names that head as its ``parent_commit``: the Hub refuses (412) a commit whose parent
   is no longer the head, so a timed-out attempt the server applies late and its retry cannot both
   land.
3. After a failed attempt (timeout, 5xx, dropped connection, 412) the repo's files are compared
   with the local ones (sha256 of LFS files, git blob sha1 of the others) before any retry: when
   they match, the commit landed and nothing is sent again.
4. At the end every local file must be in the repo with the local content.

Hidden files (``.fasttune-*``, temporary files) are never uploaded.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from pathlib import Path

from .hub_client import HubClient, HubPushError, status_of, transient

logger = logging.getLogger(__name__)


def folder_files(folder: Path) -> list[Path]:
    """The files of an artifact folder that are uploaded: all but hidden ones, sorted."""
    return [p for p in sorted(folder.rglob("*")) if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)]


class _LocalFile:
    """A file to upload and its remote oid: the sha256 when the Hub stores it in LFS, the git blob
    sha1 otherwise (only files under the Hub's 10 MB LFS threshold can be regular)."""

    REGULAR_MAX = 10 * 1024 * 1024

    def __init__(self, path: Path, repo_path: str, sha256: str) -> None:
        self.path, self.repo_path, self.sha256 = path, repo_path, sha256
        self._git_sha1: str | None = None

    def git_sha1(self) -> str:
        if self._git_sha1 is None:
            data = self.path.read_bytes()
            self._git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return self._git_sha1

    def matches(self, oid: str | None) -> bool:
        if oid is None:
            return False
        return oid == self.sha256 or (self.path.stat().st_size <= self.REGULAR_MAX and oid == self.git_sha1())


def _differences(hub: HubClient, repo_id: str, files: list[_LocalFile]) -> list[str]:
    """Repo paths whose remote content is missing or differs from the local file."""
    remote = hub.remote_oids(repo_id)
    return [f.repo_path for f in files if not f.matches(remote.get(f.repo_path))]


def _commit(hub: HubClient, repo_id: str, ops: list, files: list[_LocalFile], message: str,
            parent: str | None) -> None:
    p = hub.policy
    what = f"commit to {repo_id}"
    start = time.monotonic()
    for attempt in range(1, p.attempts + 1):
        began = time.monotonic()
        try:
            # Fresh operation objects per attempt: huggingface_hub marks committed ones as used.
            hub.api.create_commit(repo_id, operations=[copy.copy(op) for op in ops], commit_message=message,
                                  token=hub.token, parent_commit=parent)
            return
        except Exception as e:  # noqa: BLE001 - classified below, re-raised scrubbed
            moved = status_of(e) == 412
            if not (moved or transient(e)):
                raise hub.failure(what, e, attempt) from None
            if not _differences(hub, repo_id, files):
                logger.warning("%s: %s, but the commit landed; not sending it again", what,
                               hub.scrub(f"{type(e).__name__}: {e}")[:200])
                return
            if moved:  # someone else committed meanwhile: ours goes on top of the new head
                parent = hub.head(repo_id)
            if attempt == p.attempts:
                raise hub.failure(what, e, attempt) from None
            delay = 0.0 if moved else p.delay(attempt, e)
            if not p.room_for(time.monotonic() - start, delay, time.monotonic() - began):
                raise hub.failure(what, e, attempt, f" within {p.total_timeout:g} s") from None
            logger.warning("%s: %s; retry %d/%d in %.1f s", what, hub.scrub(f"{type(e).__name__}: {e}")[:300],
                           attempt, p.attempts - 1, delay)
            time.sleep(delay)


def upload_folder(hub: HubClient, repo_id: str, folder: Path, message: str) -> None:
    """Uploads ``folder``'s files to ``repo_id`` in one commit (files the repo already has with the
    same content are skipped by huggingface_hub).

    Raises:
        HubPushError: a call failed after its retries, or the repo lacks a file after the commit.
    """
    from huggingface_hub import CommitOperationAdd

    ops, files = [], []
    for path in folder_files(folder):
        op = CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
        ops.append(op)
        files.append(_LocalFile(path, op.path_in_repo, op.upload_info.sha256.hex()))
    parent = hub.head(repo_id)
    hub.call(f"upload to {repo_id}", lambda: hub.api.preupload_lfs_files(
        repo_id, additions=ops, token=hub.token, free_memory=False))
    _commit(hub, repo_id, ops, files, message, parent)
    wrong = _differences(hub, repo_id, files)
    if wrong:
        raise HubPushError(f"{repo_id} lacks the local content of {wrong} after the commit; run the push again",
                           None, hub.output_dir)
