"""Every module fasttune/<pkg>/<stem>.py has its test file tests/<pkg>/test_<stem>.py (DESIGN.md)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stems():
    for path in sorted((ROOT / "fasttune").rglob("*.py")):
        if path.name == "__init__.py" or path.name.startswith("_"):
            continue
        yield path.relative_to(ROOT / "fasttune")


def test_every_module_has_a_test_file():
    missing = []
    for rel in _stems():
        test = ROOT / "tests" / rel.parent / f"test_{rel.stem}.py"
        if not test.exists():
            missing.append(f"fasttune/{rel} -> tests/{rel.parent / ('test_' + rel.stem + '.py')}")
    assert not missing, "modules without a test file:\n" + "\n".join(missing)


def test_files_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "fasttune").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 600]
    assert not big, f"files over 600 lines: {big}"
