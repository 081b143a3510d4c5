"""Run a test's Hub scenarios in a subprocess, where huggingface_hub can be imported online.

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_DISABLE_XET once, at import, and the
test process runs offline (tests/conftest.py). ``run_scenarios(test_file, tmp_path)`` runs
``python test_file <tmp_path>``; the file's ``__main__`` starts its loopback servers, calls
``online_env(server_url, tmp_path)`` and only then imports huggingface_hub, runs its scenarios and
writes ``report.json`` into ``tmp_path``. The parent gets that report plus the subprocess's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
TOKEN = "hf_fasttuneTestToken0123456789abcdef"


def run_scenarios(test_file: str | Path, tmp_path: Path, *args: str, timeout: int = 300) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests" / "_lib")])
    proc = subprocess.run([sys.executable, str(test_file), str(tmp_path), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    report["log"] = log
    return report


def online_env(endpoint: str, tmp_path: Path) -> None:
    """Points huggingface_hub (not imported yet) at ``endpoint``, online, Xet off, a fresh HF_HOME."""
    assert "huggingface_hub" not in sys.modules, "set the environment before importing huggingface_hub"
    os.environ.update(HF_ENDPOINT=endpoint, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf_home"),
                      HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")


def write_report(tmp_path: Path, report: dict) -> None:
    (Path(tmp_path) / "report.json").write_text(json.dumps(report, indent=1, default=str))
