"""The GPU benchmark scripts still run: their --smoke modes on a tiny model (CPU, Triton interpreter).

They run on the H200 only a few times per session, where a broken script costs device time; these
catch the breakage here first (a stack that errors, a model that outlives its worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_bench_step_smoke_every_fasttune_stack(tmp_path):
    out = tmp_path / "step.json"
    stdout = _run(["benchmarks/bench_step.py", "--smoke", "--stacks", "hf,fasttune,fasttune-recompute,fasttune-auto",
                   "--weights", "bf16", "--shapes", "1x32", "--steps", "1", "--warmup", "1", "--out", str(out)], 600)
    rows = json.loads(out.read_text())["rows"]
    assert {r["stack"] for r in rows} == {"hf", "fasttune", "fasttune-recompute", "fasttune-auto"}
    assert all("tokens_per_s" in r for r in rows), rows
    assert len({r["loss_step1"] for r in rows}) == 1, rows  # B = 0: every stack computes the same function
    assert "LEAK" not in stdout, stdout


def test_gpu_suite_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_suite.sh")], check=True)
