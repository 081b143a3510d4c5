"""One kernel style across fasttune/kernels (DESIGN, "Kernel signatures"), read from the source.

Every ``@triton.jit`` function takes its pointers first, each named ``<name>_ptr`` on its own line
with a comment saying what it points to; then sizes and other runtime values; then strides
(``stride_*``, or ``s_*`` in rope.py); then the ``UPPER_CASE`` constexprs, and only those are
upper case. Modules of the package import each other relatively (``from . import reference``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "fasttune" / "kernels"
MODULES = sorted(KERNELS.glob("*.py"))
_STRIDE = re.compile(r"^(stride|s)_[a-z0-9]+$")


def _jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _style_errors(source: str) -> list[str]:
    """What breaks the style in one module's source; empty when it follows it."""
    tree = ast.parse(source)
    lines = source.splitlines()
    errors = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fasttune"):
            errors.append(f"line {node.lineno}: absolute import of {node.module} (use a relative import)")
        if isinstance(node, ast.Import) and any(a.name.startswith("fasttune") for a in node.names):
            errors.append(f"line {node.lineno}: absolute import (use a relative import)")
    for fn in _jit_functions(tree):
        kinds = []
        for arg in fn.args.args:
            name, const = arg.arg, arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)
            where = f"{fn.name}({name})"
            if const != (name.upper() == name and name.lower() != name):
                errors.append(f"{where}: UPPER_CASE names are for tl.constexpr parameters, and only those")
            if name.endswith("_ptr"):
                kinds.append(0)
                line = lines[arg.lineno - 1]
                code, _, comment = line.partition("#")
                if not comment.strip():
                    errors.append(f"{where}: a pointer needs a comment on its line (what, shape, dtype)")
                if sum(p.endswith("_ptr") for p in re.findall(r"\w+", code)) != 1:
                    errors.append(f"{where}: one pointer per line")
            else:
                kinds.append(3 if const else 2 if _STRIDE.match(name) else 1)
        if kinds != sorted(kinds):
            errors.append(f"{fn.name}: parameters must run pointers, sizes, strides, constexprs")
    return errors


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_kernel_module_follows_the_style(path):
    errors = _style_errors(path.read_text())
    assert not errors, f"{path.name}:\n" + "\n".join(errors)


def test_the_style_check_catches_the_old_style():
    old = '''
from fasttune.kernels import reference

@triton.jit
def _k(X, y_ptr, n, stride_y, eps, BLOCK: tl.constexpr):
    pass
'''
    errors = "\n".join(_style_errors(old))
    for expected in ("absolute import", "_k(X): UPPER_CASE", "_k(y_ptr): a pointer needs a comment",
                     "_k: parameters must run"):
        assert expected in errors, errors
    assert _style_errors('''
from . import reference

@triton.jit
def _k(x_ptr,  # x [n], fp32
       n, stride_x, BLOCK: tl.constexpr):
    pass
''') == []


def test_some_module_has_kernels():
    assert sum(1 for p in MODULES for _ in _jit_functions(ast.parse(p.read_text()))) >= 10
