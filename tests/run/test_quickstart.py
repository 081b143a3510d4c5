"""The README's main job, end to end, on the CPU path users get (no Triton interpreter)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_trains_and_saves(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "80", "--eval-size", "40",
         "--output-dir", str(tmp_path / "qs")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "qs" / "metrics.json").read_text())
    assert metrics["last_loss"] < 0.6 * metrics["first_loss"]
    assert metrics["exact_match_after"] >= metrics["exact_match_before"]
    assert metrics["patched"]["cross_entropy"] == 1
    assert (tmp_path / "qs" / "final" / "config.json").exists()
    assert "held-out exact match" in out.stdout and "the share of 40 unseen words" in out.stdout
