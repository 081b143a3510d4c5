"""A run folder: the files ``fasttune train`` writes, their layout, and the live state of the run.

::

    run_config.yaml   fast_config.json   state.json        log_history.jsonl   train.log
    trainer_state.json   metrics.json   final/ (adapter or full model + tokenizer)
    base/ (the embedded base model, when used)   adapter/ merged/ gguf/ (exports)

``state.json`` is the live status (written atomically at every log step): status (starting,
running, exporting, completed, failed, stopped), step / max_steps, the loss curve, the error, the
exported folders and the pushed repos' URLs. Other ranks of a distributed run keep their own
state file: ``state.json`` is rank 0's alone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .config import RunConfig, load_run_config

STATE_FILE = "state.json"
TERMINAL = ("completed", "failed", "stopped")


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

    def require_finished(self) -> None:
        """FileNotFoundError naming the folder and what it lacks, unless ``is_finished``."""
        if not self.is_finished():
            raise FileNotFoundError(f"{self.path} is not a finished fasttune run (needs run_config.yaml and final/)")

    def load_config(self) -> RunConfig:
        return load_run_config(self.config_file)

    # --- starting a run --------------------------------------------------------------------------
    def start(self, cfg: RunConfig) -> None:
        """Creates the folder and writes the config files and an empty log (rank 0)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if is_main_process():
            self.config_file.write_text(cfg.to_yaml(), encoding="utf-8")
            self.fast_config_file.write_text(json.dumps(cfg.fast.to_dict(), indent=2), encoding="utf-8")
            self.log_history.write_text("", encoding="utf-8")

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
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
        os.replace(tmp, final)
        return state

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


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """The state of the run in ``run_dir`` ({} when there is none yet)."""
    return RunFolder(run_dir).read_state()


def write_state(run_dir: str | Path, **updates: Any) -> dict[str, Any]:
    """Merges ``updates`` into the state of the run in ``run_dir``."""
    return RunFolder(run_dir).write_state(**updates)
