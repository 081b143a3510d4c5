"""Atomic files and folders: a crash or a full disk leaves the previous file or none, never half of one.

A file is written to a temporary name beside its final one (same file system), flushed and
fsynced, then ``os.replace``d into place; a folder's files are written into a staging folder
inside it and moved in one by one. Every exported artifact goes through these helpers. An OS error
inside (a full disk, a read-only mount) leaves as an ``ExportWriteError`` naming the final file
(``write_errors.py``), after the temporary file or staging folder is removed. Names of the
temporaries (``.<name>.*.tmp``, ``.staging-*``) are what ``leftovers.py`` sweeps after a killed export.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .write_errors import ExportWriteError, describe, naming_write_errors

TMP_SUFFIX = ".tmp"
STAGING_PREFIX = ".staging-"

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


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


@contextlib.contextmanager
def atomic_path(final: str | Path, expected_bytes: int | None = None) -> Iterator[Path]:
    """Yields a temporary path next to ``final``; on success fsyncs it and renames it onto ``final``.

    On error the temporary file is removed and ``final`` is untouched; an OS error becomes an
    ``ExportWriteError`` about ``final`` (``expected_bytes``, its full size, gives the space it needs).
    """
    final = Path(final)
    with naming_write_errors(final, expected_bytes):
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=TMP_SUFFIX, dir=final.parent)
        os.close(fd)
    tmp = Path(tmp)
    try:
        with naming_write_errors(final, expected_bytes, lambda: _size(tmp)):
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


def _newest_file(stage: Path) -> Path | None:
    files = [p for p in stage.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None


@contextlib.contextmanager
def staged_dir(out_dir: str | Path, expected_bytes: int | None = None) -> Iterator[Path]:
    """A staging folder inside ``out_dir``; on success each file in it is fsynced and moved into
    ``out_dir`` with ``os.replace`` (atomic per file). On error ``out_dir`` keeps its old files; an OS
    error names the file it was writing (the newest one in the stage, by its final name) and, with
    ``expected_bytes`` (everything the folder will hold), the space still needed."""
    out_dir = Path(out_dir)
    with naming_write_errors(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))
    try:
        try:
            yield stage
        except ExportWriteError:
            raise
        except Exception as e:  # noqa: BLE001 - renamed when it is an OS error, else re-raised as is
            newest = _newest_file(stage)
            target = out_dir / newest.relative_to(stage) if newest is not None else out_dir
            written = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
            err = describe(e, target, expected_bytes, written)
            if err is None:
                raise
            raise err from e
        with naming_write_errors(out_dir):
            _move_in(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _move_in(stage: Path, out_dir: Path) -> None:
    for src in sorted(p for p in stage.rglob("*") if p.is_file()):
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        dst = out_dir / src.relative_to(stage)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
    fsync_dir(out_dir)
