"""A full disk without a mount: ``os.write`` under one folder obeys a quota, as a small tmpfs would.

CI cannot mount a tmpfs; this stands in for one where the code under test writes through
``os.write`` (fasttune's state, marker and reserve files do). The quota counts the bytes of every
file under ``root`` when it is installed plus ``free`` bytes; a write that would grow the files
past it writes what fits and then raises ``OSError(ENOSPC)``, as a real file system does
(deleting a file frees its bytes, overwriting existing bytes needs none).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def used_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


class FullDisk:
    """Install with ``monkeypatch``: ``FullDisk(root, free=0).install(monkeypatch)``."""

    def __init__(self, root: str | Path, free: int = 0) -> None:
        self.root = Path(root).resolve()
        self.quota = used_bytes(self.root) + free
        self.refused = 0  # writes that hit the quota
        self._write = os.write

    def install(self, monkeypatch) -> "FullDisk":
        monkeypatch.setattr(os, "write", self.write)
        return self

    def _path(self, fd: int) -> Path | None:
        try:
            return Path(os.readlink(f"/proc/self/fd/{fd}")).resolve()
        except OSError:
            return None

    def write(self, fd: int, data) -> int:
        path = self._path(fd)
        if path is None or self.root not in path.parents:
            return self._write(fd, data)
        pos, size = os.lseek(fd, 0, os.SEEK_CUR), os.fstat(fd).st_size
        growth = max(0, pos + len(data) - size)
        room = self.quota - used_bytes(self.root)
        if growth <= room:
            return self._write(fd, data)
        self.refused += 1
        fits = max(0, size - pos) + max(0, room)
        if fits > 0:
            return self._write(fd, bytes(data)[:fits])  # a short write; the caller's next write fails
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
