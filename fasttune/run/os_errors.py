"""Disk-full and other OS errors of a run, turned into one line that names the path and the need.

A full disk surfaces in many shapes: ``OSError [Errno 28]`` without a file name (Python's buffered
writes), ``SafetensorError: ... No space left on device (os error 28)``, torch's zip writer
``[enforce fail at inline_container.cc:...] unexpected pos 576 vs 534`` or ``file write failed``,
numpy's ``1000000 requested and 0 written``. ``explain`` recognises them (also inside chained
exceptions), finds the file system of the path being written, and says how much is free there and
about how much the run needs. Standard library only.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXT = re.compile(r"No space left|os error 28|Disk quota exceeded|requested and \d+ written|"
                        r"inline_container\.cc.*(file write failed|unexpected pos)", re.S)


class RunIOError(OSError):
    """An OS error of a run, explained in one line (``str``): the path, what happened, what is needed."""


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    """``exc`` (or an exception it chains) says the disk or the quota is full, in any of the known shapes."""
    return any((isinstance(e, OSError) and e.errno in _FULL_ERRNOS) or bool(_FULL_TEXT.search(str(e)))
               for e in _chain(exc))


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
    filename = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    path = Path(filename or where)
    if is_disk_full(exc):
        mount = mount_point(path)
        try:
            free = f"{human(shutil.disk_usage(mount).free)} free on {mount}"
        except OSError:
            free = f"the file system of {mount} is full"
        need = f", about {human(need_bytes)} needed" + (f" for {what}" if what else "") if need_bytes else ""
        return f"disk full while writing {path}: {free}{need}; free some space there or use a larger disk"
    oserr = next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno is not None), None)
    if oserr is None:
        return None
    reason = oserr.strerror or errno.errorcode.get(oserr.errno, str(oserr.errno))
    hint = {errno.EACCES: "check the folder's permissions", errno.EPERM: "check the folder's permissions",
            errno.EROFS: "the file system is read-only: choose another --run-dir",
            errno.EIO: "the disk reported an I/O error: check it"}.get(oserr.errno, "")
    return f"{reason}: {path}" + (f"; {hint}" if hint else "")
