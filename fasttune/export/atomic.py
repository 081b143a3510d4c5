"""Atomic files and folders: a crash or a full disk leaves the previous file or none, never half of one.

A file is written to a temporary name beside its final one (same file system), flushed and
fsynced, then ``os.replace``d into place; a folder's files are written into a staging folder
inside it and moved in one by one. Every exported artifact goes through these helpers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so renames inside it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yields a temporary path next to ``final``; on success fsyncs it and renames it onto ``final``.

    On error the temporary file is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(final: str | Path, data: bytes | str) -> Path:
    """Writes ``data`` to ``final`` atomically (str is UTF-8 encoded)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(final) as tmp:
        tmp.write_bytes(payload)
    return Path(final)


@contextlib.contextmanager
def staged_dir(out_dir: str | Path) -> Iterator[Path]:
    """A staging folder inside ``out_dir``; on success each file in it is fsynced and moved into
    ``out_dir`` with ``os.replace`` (atomic per file). On error ``out_dir`` keeps its old files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=out_dir))
    try:
        yield stage
        for src in sorted(p for p in stage.rglob("*") if p.is_file()):
            with open(src, "rb") as f:
                os.fsync(f.fileno())
            dst = out_dir / src.relative_to(stage)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        fsync_dir(out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
