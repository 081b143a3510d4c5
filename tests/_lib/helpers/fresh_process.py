"""Run a test's script in a fresh Python process and read back what it printed as its result.

For state a test process cannot isolate: the CUDA caching allocator (process-wide), or a package kept
off the test venv's path. The script prints one line ``RESULT <json>``; ``run_script`` returns that
object, and fails the test with the process's output when it exits non-zero or prints no result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PREFIX = "RESULT "


def result_line(obj) -> str:
    """The line a script prints for ``run_script`` to read."""
    return PREFIX + json.dumps(obj)


def run_script(script: str, *args: str, paths=(), timeout: int = 300, **env) -> dict:
    """``python -c script *args`` with ``paths``, the repository and tests/_lib first on PYTHONPATH and
    ``env`` added to the environment; the object of its ``RESULT`` line."""
    path = [*map(str, paths), str(REPO_ROOT), str(REPO_ROOT / "tests" / "_lib"), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env=dict(os.environ, **env, PYTHONPATH=os.pathsep.join(p for p in path if p)))
    line = next((x for x in proc.stdout.splitlines() if x.startswith(PREFIX)), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len(PREFIX):])
