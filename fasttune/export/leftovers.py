"""What a killed export leaves behind, swept by the next export into the same folder.

A SIGKILL (or power loss) skips the ``finally`` blocks that remove temporary files, so an export
can leave, inside ``adapter/``, ``merged/`` and ``gguf/``, hidden files up to the artifact's full
size: atomic writers' temporaries (``.<name>.<random>.tmp``), staging folders (``.staging-*``),
the K-quant intermediate (``.<name>-intermediate-BF16.gguf``) and write probes
(``.fasttune-write-check-*``). Final names are never partial (they appear by ``os.replace``).

``export_lock(root)`` holds an exclusive ``flock`` on ``root/.fasttune-export.lock`` for one export,
so a sweep never removes the temporaries of an export that is still running: a second export
into the same folder fails at once, naming the folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

from ..config import ARTIFACTS

logger = logging.getLogger(__name__)

LOCK_NAME = ".fasttune-export.lock"
_FILE_PATTERNS = (".*.tmp", ".*-intermediate-BF16.gguf", ".fasttune-write-check-*")
_DIR_PATTERNS = (".staging-*",)


class ExportBusyError(RuntimeError):
    """Another export holds the folder's lock."""


def stranded(root: str | Path) -> list[Path]:
    """Temporary files and staging folders an interrupted export left in ``root``'s artifact folders."""
    root = Path(root)
    found: list[Path] = []
    for kind in ARTIFACTS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for pattern in _DIR_PATTERNS:
            found += [p for p in folder.rglob(pattern) if p.is_dir()]
        for pattern in _FILE_PATTERNS:
            found += [p for p in folder.rglob(pattern) if p.is_file() and not any(p.is_relative_to(d) for d in found)]
    return sorted(set(found))


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def remove_stranded(root: str | Path) -> int:
    """Removes what ``stranded`` finds; returns the bytes freed (logged when > 0). Call it under
    ``export_lock``: an export running at the same time would lose its temporaries."""
    freed = 0
    for path in stranded(root):
        try:
            size = _size(path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            freed += size
        except FileNotFoundError:
            continue
    if freed:
        logger.warning("removed %.1f MB of temporary files an interrupted export left in %s", freed / 1e6, root)
    return freed


@contextlib.contextmanager
def export_lock(root: str | Path) -> Iterator[Path]:
    """Exclusive lock of ``root`` for one export (a no-op where ``fcntl`` is missing)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the sweep still runs
        yield root
        return
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportBusyError(f"another export is writing into {root}; wait for it to finish "
                                  f"(lock: {root / LOCK_NAME})") from None
        yield root
    finally:
        os.close(fd)  # closing releases the lock
