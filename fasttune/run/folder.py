"""A run folder: the files ``fasttune train`` writes, their layout, and the live state of the run.

::

    run_config.yaml   fast_config.json   state.json        log_history.jsonl   train.log
    trainer_state.json   metrics.json   final/ (adapter or full model + tokenizer)
    base/ (the embedded base model, when used)   adapter/ merged/ gguf/ (exports)

``state.json`` is the live status (written atomically at every log step): status (starting,
running, exporting, completed, failed, stopped), the phase (loading data, loading model,
training, saving, exporting), step / max_steps, the loss curve, the error, the exported folders
and the pushed repos' URLs, and the process writing it (pid, host, start time: a reader that finds
that process gone shows the run as "interrupted", ``liveness.py``). Other ranks of a distributed
run keep their own state file: ``state.json`` is rank 0's alone.

A full disk must not leave the state at "running" with no error: ``start`` sets aside a small
reserve file, and ``write_state_robustly`` (the failure path) frees it and retries, then
overwrites the state in place (no new blocks), and only then gives up with a message.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from .checkpoints import checkpoints
from .config import RunConfig, load_run_config

STATE_FILE = "state.json"
TERMINAL = ("completed", "failed", "stopped", "interrupted")
RESERVE_BYTES = 256 * 1024
# What a previous `fasttune train` leaves in a run folder (--overwrite removes exactly these).
RUN_FILES = ("final", "adapter", "merged", "gguf", "base", "runs", "README.md", "run_config.yaml", "fast_config.json",
             STATE_FILE, ".state.reserve", "log_history.jsonl", "train.log", "trainer_state.json", "metrics.json")
# Kept when the state must be cut down to be written at all (disk full): who, what, where it stopped.
_ESSENTIAL = ("status", "phase", "error", "step", "max_steps", "pid", "host", "pid_start", "started_at",
              "finished_at", "updated_at", "run_name", "trainer", "method", "resumed_from", "created_at")


def is_main_process() -> bool:
    """Rank 0 under torchrun/accelerate (RANK set by the launcher), or a single process."""
    return os.environ.get("RANK", "0") in ("0", "")


class RunFolder:
    """The folder of one run, named by ``path``; knows where each file of the run lives."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # --- layout ----------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / "run_config.yaml"

    @property
    def fast_config_file(self) -> Path:
        return self.path / "fast_config.json"

    @property
    def log_history(self) -> Path:
        return self.path / "log_history.jsonl"

    @property
    def train_log(self) -> Path:
        return self.path / "train.log"

    @property
    def trainer_state(self) -> Path:
        return self.path / "trainer_state.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.json"

    @property
    def final(self) -> Path:
        """The trained model (adapter or full weights) and its tokenizer."""
        return self.path / "final"

    @property
    def base(self) -> Path:
        """The embedded base model, built once and saved here (other bases load from their source)."""
        return self.path / "base"

    @property
    def state_file(self) -> Path:
        name = STATE_FILE if is_main_process() else f".state.rank{os.environ['RANK']}.json"
        return self.path / name

    def is_finished(self) -> bool:
        """A training run ended here: its config and its final model are saved."""
        return self.config_file.is_file() and self.final.is_dir()

    @property
    def reserve_file(self) -> Path:
        """Space set aside for the failure write (each rank its own, like its state file)."""
        return self.path / (".state.reserve" if is_main_process() else f".state.rank{os.environ['RANK']}.reserve")

    def has_previous_run(self) -> bool:
        """A `fasttune train` ran here before: a log, checkpoints, a final model. (The run config,
        console.log and a "starting" state.json that the Space writes before launching do not count.)"""
        p = self.path
        return (self.train_log.exists() or self.final.exists() or self.trainer_state.exists()
                or bool(checkpoints(p)) or (self.log_history.is_file() and self.log_history.stat().st_size > 0))

    def clear_previous_run(self) -> list[str]:
        """Removes what a previous run left here (``RUN_FILES`` and ``checkpoint-*``); other files stay."""
        removed = []
        for name in [*RUN_FILES, *(c.name for _, c in checkpoints(self.path))]:
            target = self.path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            else:
                continue
            removed.append(name)
        return removed

    def require_finished(self) -> None:
        """FileNotFoundError naming the folder and what it lacks, unless ``is_finished``."""
        if not self.is_finished():
            raise FileNotFoundError(f"{self.path} is not a finished fasttune run (needs run_config.yaml and final/)")

    def load_config(self) -> RunConfig:
        return load_run_config(self.config_file)

    # --- starting a run --------------------------------------------------------------------------
    def start(self, cfg: RunConfig, resume_step: int | None = None) -> None:
        """Creates the folder, writes the config files and an empty log (rank 0), and sets aside the
        reserve. Resuming at ``resume_step`` keeps the log and loss curve up to that step."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not is_main_process():
            self.make_reserve()
            return
        self.config_file.write_text(cfg.to_yaml(), encoding="utf-8")
        self.fast_config_file.write_text(json.dumps(cfg.fast.to_dict(), indent=2), encoding="utf-8")
        if resume_step is None or not self.log_history.is_file():
            self.log_history.write_text("", encoding="utf-8")
        else:  # the steps after the checkpoint are trained again: their old log lines go
            lines = [x for x in self.log_history.read_text(encoding="utf-8").splitlines()
                     if x.strip() and json.loads(x).get("step", 0) <= resume_step]
            self.log_history.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        self.make_reserve()

    def make_reserve(self) -> None:
        """Sets aside ``RESERVE_BYTES`` (real blocks, not a sparse file) for the failure write."""
        try:
            _write_file(self.reserve_file, bytes(RESERVE_BYTES))
        except OSError:
            pass  # the disk is already full: the in-place fallback remains

    def release_reserve(self) -> None:
        try:
            self.reserve_file.unlink()
        except FileNotFoundError:
            pass

    def append_log(self, logs: dict[str, Any]) -> None:
        with open(self.log_history, "a", encoding="utf-8") as f:
            f.write(json.dumps(logs) + "\n")

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        self.metrics_file.write_text(json.dumps(metrics, indent=2), encoding="utf-8")

    # --- state.json ------------------------------------------------------------------------------
    def read_state(self) -> dict[str, Any]:
        """The run's state ({} when there is none yet)."""
        try:
            return json.loads(self.state_file.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write_state(self, **updates: Any) -> dict[str, Any]:
        """Merges ``updates`` into the state (atomic replace; readers never see half a file)."""
        state = self.read_state()
        state.update(updates, updated_at=time.time())
        final = self.state_file
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            _write_file(tmp, json.dumps(state, indent=1).encode())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return state

    def write_state_robustly(self, **updates: Any) -> str | None:
        """``write_state`` for the failure path, where the disk may be full: on an OSError it frees
        the reserve and retries, then overwrites ``state.json`` in place (cut down to its essential
        keys if need be: no new blocks are needed). Returns None once written, else why it could not be."""
        try:
            self.write_state(**updates)
            return None
        except OSError:
            self.release_reserve()
        try:
            self.write_state(**updates)
            return None
        except OSError:
            pass
        state = {**self.read_state(), **updates, "updated_at": time.time()}
        full = json.dumps(state).encode()
        small = json.dumps({k: state[k] for k in _ESSENTIAL if k in state}).encode()
        try:
            size = self.state_file.stat().st_size
        except OSError:
            size = 0
        try:
            _overwrite(self.state_file, full if len(full) <= size else small)
            return None
        except OSError as e:
            return (f"could not record the run's state in {self.state_file} ({e.strerror or e}); readers will show "
                    "the run as interrupted once this process has exited")

    def record(self, key: str, entries: dict[str, Any]) -> dict[str, Any]:
        """Merges ``entries`` into the state's mapping ``key`` ("artifacts": kind → folder, "urls": kind → URL)."""
        return self.write_state(**{key: {**self.read_state().get(key, {}), **entries}})

    def run_stats(self) -> dict[str, Any] | None:
        """Steps, loss, tokens/s, memory and the loss curve from ``trainer_state.json`` (None before it exists)."""
        from types import SimpleNamespace

        from ..export.cards import run_stats_from_state

        if not self.trainer_state.is_file():
            return None
        data = json.loads(self.trainer_state.read_text(encoding="utf-8"))
        return run_stats_from_state(SimpleNamespace(log_history=data.get("log_history", []),
                                                    global_step=data.get("global_step")))


def _write_file(path: Path, data: bytes) -> None:
    """Writes ``data`` to a new ``path`` with os.write (a short write on a full disk raises ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def _overwrite(path: Path, data: bytes) -> None:
    """Writes ``data`` over the start of ``path`` and cuts the rest: blocks already there are reused."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        _write_all(fd, data)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n == 0:
            raise OSError(28, "No space left on device")
        view = view[n:]


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """The state of the run in ``run_dir`` ({} when there is none yet)."""
    return RunFolder(run_dir).read_state()


def write_state(run_dir: str | Path, **updates: Any) -> dict[str, Any]:
    """Merges ``updates`` into the state of the run in ``run_dir``."""
    return RunFolder(run_dir).write_state(**updates)
