"""The house: each module has its test file, files stay small, and imports only run down the floors.

Floors, bottom to top (a module imports only from its own floor or the ones below; within a floor
the imports form no circle):

    config, embedded          one dataclass of options; the embedded demo model and task
    hub_cards                 model-card templates (jinja2 only)
    kernels                   Triton kernels + plain-PyTorch twins (torch, triton only)
    model_patches             the only place that knows transformers' modeling internals
    export                    adapter, merged weights, GGUF, cards, Hub push (no Trainer)
    hf_integration            Trainer, TRL, accelerate glue
    run                       YAML runs behind the CLI and the Space
    doctor, cli               the command line; the package root (its public API) stands beside them

Read from the AST, function-level imports included (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fasttune"
MAX_LINES = 500  # DESIGN.md: ~500 lines at most
FLOORS = (("config", "embedded"), ("hub_cards",), ("kernels",), ("model_patches",), ("export",),
          ("hf_integration",), ("run",), ("doctor", "cli"))
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
FLOOR["__init__"] = len(FLOORS) - 1  # fasttune/__init__.py resolves its names from every floor, lazily


def _modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the package (packages by their ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from . import x` names a submodule when x is one, else something the package defines.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_test_file():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(PACKAGE)
        test = ROOT / "tests" / rel.parent / f"test_{rel.stem.lstrip('_')}.py"
        if not test.exists():
            missing.append(f"fasttune/{rel} -> {test.relative_to(ROOT)}")
    assert not missing, "modules without a test file:\n" + "\n".join(missing)


def test_files_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not big, f"files over {MAX_LINES} lines: {big}"


def test_every_room_has_a_floor():
    rooms = {_room(name) for name in _modules()}
    assert rooms == set(FLOOR), f"rooms without a floor: {rooms - set(FLOOR)}; floors without a room: " \
                                f"{set(FLOOR) - rooms}"


def test_imports_never_run_up_the_floors():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            if FLOOR[_room(target)] > FLOOR[_room(name)]:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports running up the floors:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ and its own modules: the __init__ re-exports them, which is no circle.
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_see_what_they_should():
    """The graph reader finds a lazy, relative, function-level import (so the tests above can fail)."""
    modules = _modules()
    assert "fasttune.hf_integration.trl" in _imports("fasttune.hf_integration.callback",
                                                      modules["fasttune.hf_integration.callback"], modules)
    assert "fasttune.kernels.reference" in _imports("fasttune.kernels.rms_norm",
                                                     modules["fasttune.kernels.rms_norm"], modules)
