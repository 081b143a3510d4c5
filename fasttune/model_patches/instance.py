"""Swapping one module instance's forward, recorded so it can be undone.

The replacement is an object of a ``PatchedForward`` subclass stored as the instance attribute
``forward``: ``nn.Module.__call__`` finds it before the class method, other instances of the class
are untouched, and ``inspect.signature`` still sees the stock signature (the Trainer picks dataset
columns and ``generate`` validates kwargs against it).
"""

from __future__ import annotations

import inspect

from torch import nn

from .report import PatchReport

_MISSING = object()


class PatchedForward:
    """Base class of replacement forwards: holds the module and the forward it replaced."""

    op = "patched"

    def __init__(self, module: nn.Module, stock):
        self.module = module
        self.stock = stock
        try:
            self.__signature__ = inspect.signature(stock)
        except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
            pass
        self.__doc__ = getattr(stock, "__doc__", None)

    def __repr__(self) -> str:
        return f"<fasttune {type(self).__name__} of {type(self.module).__name__}>"


def swap_forward(module: nn.Module, patched: PatchedForward, report: PatchReport) -> None:
    """Install ``patched`` as ``module.forward`` and register its undo on ``report``."""
    previous = module.__dict__.get("forward", _MISSING)
    module.forward = patched

    def undo() -> None:
        if module.__dict__.get("forward") is not patched:
            return  # something replaced our forward since; leave theirs alone
        if previous is _MISSING:
            del module.forward
        else:
            module.forward = previous

    report.on_undo(undo)


def stock_forward(module: nn.Module):
    """The forward the module would run now (an instance override, else the class method)."""
    return module.__dict__.get("forward") or type(module).forward.__get__(module)


def signature_has(fn, *names: str) -> bool:
    """True when ``fn`` accepts each of ``names`` (as a named parameter or through **kwargs)."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return all(n in params or var_kw for n in names)
