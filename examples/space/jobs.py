"""Training jobs of the Space: one ``fasttune train`` subprocess at a time, state on disk.

Each run gets a folder under the runs directory (``runs/<name>-<date>-<time>/``) holding its
``run_config.yaml``, the subprocess's ``console.log`` and the ``state.json`` that ``fasttune train``
keeps up to date (fasttune.run.folder). The app only reads those files, so a restarted app shows the
last run and its result, and a run started before a restart keeps going (the subprocess has its
own session) and can still be stopped through the pid in its state.

Stop = SIGTERM to the subprocess's process group: fasttune finishes the current step, saves the
model so far, skips export/push and marks the run "stopped". A process that does not exit within
``grace`` seconds is killed and the run is marked stopped here. A run whose process died without
a final status (killed, out of memory, the machine restarted) is marked "interrupted"
(``fasttune.run.liveness``: the pid and its start time are in the state).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fasttune.run.config import RunConfig
from fasttune.run.folder import TERMINAL, read_state, write_state
from fasttune.run.liveness import identity, is_alive


def _alive(state: dict) -> bool:
    """The run's recorded process still runs (the same process: a reused pid has another start time)."""
    return is_alive(state.get("pid"), state.get("pid_start"))


# Library warnings, not the run's own messages: Python's warnings (their source line follows,
# indented), DeepSpeed/accelerate's bracketed "[WARNING]" lines, and other libraries' log records
# at WARNING ("WARNING transformers.trainer: ...", as the fasttune CLI formats them).
_WARNING_LINE = re.compile(r"^(\S+\.py:\d+: \w*Warning: |\[[\d\- :,.]+\] \[WARNING\] |WARNING (?!fasttune)[\w.]+: )")


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # terminal escapes (tqdm's nested bars move the cursor up)


def filter_log(text: str) -> str:
    """``text`` without library warnings (each with its indented continuation lines)."""
    out, skipping = [], False
    for line in text.split("\n"):
        if _WARNING_LINE.match(line):
            skipping = True
            continue
        if skipping and line.startswith((" ", "\t")) and line.strip():
            continue
        skipping = False
        out.append(line)
    return "\n".join(out)


class Jobs:
    """Starts, stops and reads training runs under ``root``."""

    def __init__(self, root: str | Path, grace: float = 30.0) -> None:
        self.root = Path(root)  # created by the first start or upload, not at import
        self.grace = grace
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    # --- runs on disk ---------------------------------------------------------------------

    def runs(self) -> list[Path]:
        """Run folders, oldest first."""
        found = [p for p in self.root.iterdir() if (p / "state.json").is_file()] if self.root.is_dir() else []
        return sorted(found, key=lambda p: (read_state(p).get("created_at") or p.stat().st_mtime, p.name))

    def latest(self) -> Path | None:
        runs = self.runs()
        return runs[-1] if runs else None

    def save_upload(self, path: str) -> str:
        """Copies an uploaded data file under the runs folder (gradio's temp files do not survive)."""
        dest = self.root / "uploads" / Path(path).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        return str(dest.resolve())

    def state(self, run_dir: Path | None = None) -> dict:
        """The state of ``run_dir`` (default: the latest run), reconciled with its process: a run
        whose process is gone without a final status is marked interrupted (killed by a signal, or
        gone while the app was down), failed (another exit code) or stopped (exit code 3)."""
        run_dir = run_dir or self.latest()
        if run_dir is None:
            return {}
        state = read_state(run_dir)
        if state.get("status") in TERMINAL or not state:
            return {**state, "run_dir": str(run_dir)}
        proc = self._proc if self._proc is not None and self._proc.pid == state.get("pid") else None
        running = proc.poll() is None if proc is not None else _alive(state)
        if not running:
            code = proc.returncode if proc is not None else None
            if code == 3:
                state = write_state(run_dir, status="stopped", finished_at=time.time())
            elif code is not None and code >= 0:
                state = write_state(run_dir, status="failed", finished_at=time.time(), error=state.get("error")
                                    or f"the training process exited with code {code}; see the log")
            else:
                why = (f"killed by signal {-code}" if code is not None
                       else "gone: killed, crashed, or the app or machine restarted")
                state = write_state(run_dir, status="interrupted", finished_at=time.time(),
                                    error=state.get("error") or f"the training process was {why}; see the log")
        return {**state, "run_dir": str(run_dir)}

    def active(self) -> Path | None:
        run = self.latest()
        return run if run is not None and self.state(run).get("status") not in TERMINAL else None

    def log_tail(self, run_dir: Path | None = None, max_bytes: int = 12_000) -> str:
        run_dir = run_dir or self.latest()
        if run_dir is None or not (run_dir / "console.log").is_file():
            return ""
        with open(run_dir / "console.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
        # Progress bars redraw with carriage returns: keep the last state of each line (split on
        # newlines only: str.splitlines splits at carriage returns too); drop their cursor moves.
        text = _ANSI.sub("", text)
        return filter_log("\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n")))

    # --- start / stop -----------------------------------------------------------------------

    def start(self, cfg: RunConfig, token: str | None = None) -> Path:
        """Launches ``fasttune train`` on ``cfg`` in a subprocess; returns the run folder."""
        with self._lock:
            if self.active() is not None:
                raise RuntimeError("a run is already in progress; stop it first")
            name = cfg.run_name or f"{cfg.trainer}-{cfg.method}"
            run_dir = self.root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
            while run_dir.exists():
                run_dir = run_dir.with_name(run_dir.name + "-1")
            run_dir.mkdir(parents=True)
            config_path = run_dir / "run_config.yaml"
            config_path.write_text(cfg.to_yaml(), encoding="utf-8")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if token:
                env["HF_TOKEN"] = token  # only in the child's environment; never written to disk
            with open(run_dir / "console.log", "wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "fasttune.cli", "train", str(config_path), "--run-dir", str(run_dir)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True)
            write_state(run_dir, status="starting", **identity(self._proc.pid), created_at=time.time(),
                        run_name=name, trainer=cfg.trainer, method=cfg.method, loss=[], step=0,
                        max_steps=cfg.training.max_steps)
            return run_dir

    def stop(self) -> dict:
        """Stops the active run (SIGTERM, then SIGKILL after ``grace`` s); returns its state."""
        run = self.active()
        if run is None:
            return self.state()
        recorded = read_state(run)
        pid = recorded.get("pid")
        proc = self._proc if self._proc is not None and self._proc.pid == pid else None
        if pid and (proc is not None or _alive(recorded)):
            self._signal(pid, signal.SIGTERM)
            deadline = time.time() + self.grace
            while time.time() < deadline and (proc.poll() is None if proc is not None else _alive(recorded)):
                time.sleep(0.2)
            if proc.poll() is None if proc is not None else _alive(recorded):
                self._signal(pid, signal.SIGKILL)
                if proc is not None:
                    proc.wait(10)
        if read_state(run).get("status") not in TERMINAL:
            write_state(run, status="stopped", finished_at=time.time())
        return self.state(run)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)  # the child leads its own session: its workers get it too
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
