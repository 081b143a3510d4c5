"""Disk-full and other OS errors of a run, turned into one line that names the path and the need.

A full disk surfaces in many shapes: ``OSError [Errno 28]`` without a file name (Python's buffered
writes), ``SafetensorError: ... No space left on device (os error 28)``, torch's zip writer
``[enforce fail at inline_container.cc:...] unexpected pos 576 vs 534`` or ``file write failed``
(no errno, no path), torch's C++ stream ``basic_ios::clear: iostream error`` (which says nothing of
why: it counts as a full disk only when the file system has no room left), numpy's ``1000000
requested and 0 written``. ``explain`` recognises them
(also inside chained exceptions), names the path being written, the free space of its file system
and about how much the run needs there. An export's own ``ExportWriteError`` already is such a line
(``export/write_errors.py``, whose errno reading and wording this module shares) and is kept as it is.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ..export.write_errors import ExportWriteError, describe, error_code, free_bytes

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = re.compile(r"No space left|os error 28|Disk quota exceeded|requested and \d+ written|"
                        r"inline_container\.cc.*(file write failed|unexpected pos)", re.S)
_STREAM_FAILED = re.compile(r"basic_ios::clear|iostream error")  # a failed C++ write, cause unsaid
_NO_ROOM = 1 << 20  # bytes: less than this free, and a write that failed for no stated reason ran out of room


class RunIOError(OSError):
    """An OS error of a run, explained in one line (``str``): the path, what happened, what is needed."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    """``exc`` (or an exception it chains) says the disk or the quota is full, in any of the known shapes."""
    return any(error_code(e) in _FULL_ERRNOS or bool(_FULL_TEXT.search(str(e))) for e in _chain(exc))


def human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def explain(exc: BaseException, where: str | Path, need_bytes: int | None = None, what: str = "") -> str | None:
    """One line for an OS error met while writing under ``where`` (None when ``exc`` is no OS error).

    Args:
        exc: the exception raised.
        where: the path being written (a file name carried by the error wins).
        need_bytes: about how much space the write needs, when known.
        what: what was being written, for the message ("a checkpoint", "the final model").
    """
    named = next((e for e in _chain(exc) if isinstance(e, ExportWriteError)), None)
    if named is not None:
        return str(named)  # the export already said it in one line, about its final file
    filename = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    path = Path(filename or where)
    free = free_bytes(path)
    no_room = free is not None and free < _NO_ROOM
    if is_disk_full(exc) or (no_room and any(_STREAM_FAILED.search(str(e)) for e in _chain(exc))):
        room = f"{human(free)} free on {mount_point(path)}" if free is not None else "no free space"
        need = f"; {what or 'the run'} needs about {human(need_bytes)}" if need_bytes else ""
        return f"disk full writing {path}: {room}{need}; free some space there or use a larger disk"
    for e in _chain(exc):
        err = describe(e, path)
        if err is not None:
            return str(err)
    return None
