"""What ``fasttune train`` does with a run folder that already holds a run.

Never silently start again at step 0 over someone's checkpoints: a folder with a previous run
(``RunFolder.has_previous_run``) is refused unless the user says what they want:

- ``overwrite``: remove what the previous run left (``RunFolder.clear_previous_run``) and start over;
- ``resume``: continue from the newest *complete* checkpoint (``checkpoints.newest_complete``;
  checkpoints cut short by a full disk or a kill are skipped, and said so).

A folder whose run is still going (its process is alive) is refused either way. In a launched
multi-process run, rank 0 decides (and clears); the other ranks only look up the same checkpoint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .checkpoints import newest_complete
from .folder import RunFolder, is_main_process
from .liveness import ACTIVE, describe, process_gone

logger = logging.getLogger("fasttune.runner")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked; the message says why and what to pass instead."""


def prepare(folder: RunFolder, overwrite: bool = False, resume: bool = False) -> Path | None:
    """Makes ``folder`` ready for a new run; returns the checkpoint to resume from (None: start at step 0).

    Raises:
        RunFolderError: both flags; a run still going there; a previous run and neither flag;
            ``resume`` without a complete checkpoint.
    """
    if overwrite and resume:
        raise RunFolderError("--overwrite and --resume contradict each other: pick one")
    if not is_main_process():  # rank 0 checks and clears; the others only find the same checkpoint
        return newest_complete(folder.path)[0] if resume else None
    state = folder.read_state()
    other = state.get("pid") not in (None, os.getpid())
    if state.get("status") in ACTIVE and other and folder.has_previous_run() and not process_gone(state):
        raise RunFolderError(f"{folder.path} holds a run that is still going (pid {state['pid']}, "
                             f"{describe(state)}); stop it first")
    if resume:
        return _resume_point(folder, state)
    if not folder.has_previous_run():
        return None
    if overwrite:
        removed = folder.clear_previous_run()
        logger.warning("fasttune: --overwrite: removed the previous run in %s (%s)", folder.path, ", ".join(removed))
        return None
    latest, _ = newest_complete(folder.path)
    hint = f"--resume continues from {latest.name}, " if latest is not None else ""
    raise RunFolderError(f"{folder.path} already holds a run ({describe(state) if state else 'no state.json'}); "
                         f"{hint}--overwrite starts over (and deletes it), or pick another --run-dir")


def _resume_point(folder: RunFolder, state: dict) -> Path:
    latest, skipped = newest_complete(folder.path)
    for path, why in skipped:
        logger.warning("fasttune: skipping incomplete checkpoint %s: %s", path.name, why)
    if latest is None:
        seen = "; ".join(f"{p.name}: {why}" for p, why in skipped) or "none saved (training.save_strategy)"
        raise RunFolderError(f"--resume: no complete checkpoint in {folder.path} ({seen}); "
                             "--overwrite starts over")
    if state:
        logger.info("fasttune: resuming from %s in %s; the run was %s", latest.name, folder.path, describe(state))
    return latest


def config_changes(before: dict, after: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two run-config mappings (for a resumed run's log)."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out
