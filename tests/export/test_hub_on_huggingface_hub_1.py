"""The Hub tests again on huggingface_hub 1.x, the version the GPU image ships (pyproject allows >= 1.0; the
pinned set is 2.x). Under 1.x, ``export/hub_http.py`` once imported ``httpx2`` and every push failed, which no
test on the pinned set could see.

Real parts: huggingface_hub 1.33 (httpx) from .venv/hub1-site (scripts/setup_test_tools.sh), first on the path
of a subprocess that runs tests/export/test_hub*.py with pytest (``httpx2``, 2.x's client, unimportable there as
on the image): the same local Hub server, pushes and retries.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.fresh_process import run_script

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".venv" / "hub1-site"
FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "export").glob("test_hub*.py")
               if p.name != Path(__file__).name)

SCRIPT = r"""
import sys
import huggingface_hub, pytest
from helpers.fresh_process import result_line

version = huggingface_hub.__version__
if not version.startswith("1."):
    sys.exit(f"expected huggingface_hub 1.x first on the path, got {version} from {huggingface_hub.__file__}")
sys.modules["httpx2"] = None  # as on the image: 1.x neither needs nor brings it (the venv has it, for 2.x)
code = int(pytest.main(["-q", *sys.argv[1:]]))
print(result_line(dict(version=version, exit=code)))
sys.exit(code)
"""


@pytest.mark.slow
def test_hub_tests_pass_on_huggingface_hub_1():
    if not (SITE / "huggingface_hub").is_dir():
        pytest.skip(f"huggingface_hub 1.x is not installed in {SITE} (bash scripts/setup_test_tools.sh)")
    assert len(FILES) >= 5, FILES  # hub, client, http, preflight, upload
    out = run_script(SCRIPT, *FILES, paths=[SITE], timeout=900)
    assert out["version"].startswith("1.") and out["exit"] == 0, out
