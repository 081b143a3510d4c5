"""SIGTERM/SIGINT stop a run cleanly: inside the training loop at the end of the current step,
outside it (loading, exporting) right away."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger("fasttune.runner")


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived outside the training loop (while loading or exporting)."""


class StopSignal:
    """SIGTERM/SIGINT → stop at the end of the current step (inside the loop) or right away."""

    def __init__(self) -> None:
        self.requested = False
        self.in_loop = False
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.requested = True
        logger.warning("fasttune: signal %d received, stopping the run", signum)
        if not self.in_loop:
            raise StopRequested()
