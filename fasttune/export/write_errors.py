"""A full disk, or any other OS error while an artifact is written, as one line naming the file.

The writers fail in different words: Python's ``OSError(28, 'No space left on device')``,
safetensors' ``SafetensorError('... I/O error: No space left on device (os error 28)')``, numpy's
short write ``OSError('52224 requested and 45216 written')`` (no errno at all: read as a full
disk when under 16 MiB are left, else reported as a write cut short). ``naming_write_errors``
turns each into an ``ExportWriteError`` whose message says what happened, to which final file (not
the temporary name), and for a full disk how much more space the file needs, e.g.::

    disk full writing /runs/a/merged/model.safetensors: needs ~412 MB more (3 MB free)

The temporary file is removed by the atomic writers (``atomic.py``) as the error passes through.
"""

from __future__ import annotations

import contextlib
import errno
import math
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator

_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")
_NEARLY_FULL = 16 * 2**20
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
_REASONS = {errno.EFBIG: "file size limit reached", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.EROFS: "read-only file system",
            errno.EIO: "input/output error", errno.ENAMETOOLONG: "file name too long"}


class ExportWriteError(OSError):
    """Writing an artifact file failed; ``str()`` is one line for the user.

    Attributes:
        path: the final path of the file that was being written.
        needed_bytes: for a full disk, roughly how many more bytes the file needs (None if unknown).
    """

    def __init__(self, message: str, path: Path, code: int | None = None, needed_bytes: int | None = None) -> None:
        super().__init__(code, message)
        self.message, self.path, self.needed_bytes = message, Path(path), needed_bytes

    def __str__(self) -> str:
        return self.message


def error_code(exc: BaseException) -> int | None:
    """The errno behind a write failure, also when a library wrapped it in its own words."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int):
        return code
    text = str(exc)
    match = _OS_ERROR_CODE.search(text)
    if match:
        return int(match.group(1))
    if "No space left on device" in text:
        return errno.ENOSPC
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _mb(n: int) -> str:
    return "<1 MB" if n < 1e6 else f"{math.ceil(n / 1e6):,} MB"


def describe(exc: BaseException, path: str | Path, expected_bytes: int | None = None,
             written_bytes: int | None = None) -> ExportWriteError | None:
    """The ExportWriteError for ``exc`` raised while writing ``path``; None unless it is a failure to
    write (full disk or quota, size limit, permissions, read-only mount, I/O error)."""
    code = error_code(exc)
    path = Path(path)
    short = _SHORT_WRITE.search(str(exc)) if code is None and isinstance(exc, OSError) else None
    free = free_bytes(path)
    if short:  # numpy's short write carries no errno: a full disk when (almost) nothing is left
        if free is None or free < _NEARLY_FULL:
            code = errno.ENOSPC
        else:
            return ExportWriteError(f"write cut short ({short.group(2)} of {short.group(1)} bytes) writing {path}",
                                    path)
    if code not in _FULL and code not in _REASONS:
        return None  # not a failure of the write itself (a missing input, a bug): left as it is
    free_text = f" ({_mb(free)} free)" if free is not None else ""
    if code in _FULL:
        what = "disk quota exceeded" if code != errno.ENOSPC else "disk full"
        needed = None if expected_bytes is None else expected_bytes - (written_bytes or 0) - (free or 0)
        if needed is not None and needed > 0:  # (with a quota, or space freed since, it may not be)
            return ExportWriteError(f"{what} writing {path}: needs ~{_mb(needed)} more{free_text}", path, code, needed)
        return ExportWriteError(f"{what} writing {path}: free some space{free_text} and run the export again",
                                path, code)
    return ExportWriteError(f"{_REASONS[code]} writing {path}", path, code)


@contextlib.contextmanager
def naming_write_errors(path: str | Path, expected_bytes: int | None = None,
                        written: Callable[[], int | None] | None = None) -> Iterator[None]:
    """Re-raises an OS-level failure inside the block as an ExportWriteError about ``path``.

    Args:
        path: the final file (or folder) being written.
        expected_bytes: its full size when known (gives the "needs ~N MB more").
        written: returns how many of those bytes were on disk when the write failed.
    """
    try:
        yield
    except ExportWriteError:
        raise
    except Exception as e:  # noqa: BLE001 - only OS-level failures are renamed, the rest re-raised as is
        try:
            done = written() if written is not None else None
        except OSError:
            done = None
        err = describe(e, path, expected_bytes, done)
        if err is None:
            raise
        raise err from e
