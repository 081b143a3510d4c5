"""Is the process behind a run still alive? A SIGKILLed or crashed ``fasttune train`` cannot write
its final state, so ``state.json`` stays at ``running``; readers compare the recorded process with
the live ones and call such a run "interrupted".

A run records ``pid``, ``host`` and ``pid_start`` (the process start time in clock ticks since boot,
from ``/proc/<pid>/stat``): a pid reused by another process later has another start time. Where
``/proc`` is missing (macOS) the pid alone decides; a run recorded on another host is not judged.
Standard library only.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

ACTIVE = ("starting", "running", "exporting")  # statuses a live process keeps up to date
INTERRUPTED = "interrupted"


def identity(pid: int | None = None) -> dict[str, Any]:
    """``{"pid", "host", "pid_start"}`` of process ``pid`` (default: this one), for ``state.json``."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "pid_start": start_time(pid)}


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (None without /proc or for a gone pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing ")"
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def is_alive(pid: int | None, pid_start: int | None = None) -> bool:
    """``pid`` runs (not a zombie) and, when ``pid_start`` is known, is the process that was recorded."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc (macOS): the pid answered
    if stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    return pid_start is None or start_time(pid) == pid_start


def process_gone(state: dict[str, Any]) -> bool:
    """The state says a process is working (starting/running/exporting) on this host, and it is gone."""
    if state.get("status") not in ACTIVE or not state.get("pid"):
        return False
    host = state.get("host")
    if host is not None and host != socket.gethostname():
        return False  # recorded elsewhere (a shared disk): nothing to judge from here
    return not is_alive(state["pid"], state.get("pid_start"))


def effective_status(state: dict[str, Any]) -> str:
    """The status a reader should show: the recorded one, or "interrupted" when its process is gone."""
    return INTERRUPTED if process_gone(state) else state.get("status", "")


def describe(state: dict[str, Any]) -> str:
    """One line about a run's state for messages: status, step and, for an interrupted run, why."""
    status = effective_status(state)
    step = f", step {state.get('step', 0)}" + (f"/{state['max_steps']}" if (state.get("max_steps") or 0) > 0 else "")
    if status == INTERRUPTED:
        return (f"interrupted{step} (state.json says {state.get('status')!r}, but its process {state.get('pid')} "
                "is gone: killed, crashed or the machine restarted)")
    return f"{status or 'unknown'}{step}"
