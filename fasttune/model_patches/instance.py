"""Swapping one module instance's forward, recorded so it can be undone.

The replacement is an object of a ``PatchedForward`` subclass stored as the instance attribute
``forward``: ``nn.Module.__call__`` finds it before the class method, other instances of the class
are untouched, and ``inspect.signature`` still sees the stock signature (the Trainer picks dataset
columns and ``generate`` validates kwargs against it).

Each installed forward counts its calls in its report's ``calls`` (``PatchedForward.count``, one
Counter increment per call): what actually ran, which the patch-time report cannot say (``report.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections import Counter

import torch
from torch import nn

from .report import FUSED, PatchReport


class PatchedForward:
    """Base class of replacement forwards: holds the module and the forward it replaced.

    Attributes:
        op: the report's name of the fast path (class attribute).
        calls: where ``count`` records each call; the report's ``calls`` once installed.
    """

    op = "patched"

    def __init__(self, module: nn.Module, stock):
        self.module = module
        self.stock = stock
        self.calls: Counter = Counter()
        try:
            self.__signature__ = inspect.signature(stock)
        except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
            pass
        self.__doc__ = getattr(stock, "__doc__", None)

    def __repr__(self) -> str:
        return f"<fasttune {type(self).__name__} of {type(self.module).__name__}>"

    def count(self, outcome: str = FUSED) -> None:
        """Count one call: ``FUSED`` when the kernel ran, else why this call took the stock path."""
        self.calls[self.op, outcome] += 1


class _UndoSwap:
    """Restores one module's forward. An object, not a closure, so that ``copy.deepcopy`` of a
    patched model maps module/patched/previous onto the copy (TRL deep-copies reference models)."""

    def __init__(self, module: nn.Module, patched: PatchedForward, previous):
        self.module, self.patched, self.previous = module, patched, previous  # previous None: class forward

    def __call__(self) -> None:
        if self.module.__dict__.get("forward") is not self.patched:
            return  # something replaced our forward since; leave theirs alone
        if self.previous is None:
            del self.module.forward
        else:
            self.module.forward = self.previous


def swap_forward(module: nn.Module, patched: PatchedForward, report: PatchReport) -> None:
    """Install ``patched`` as ``module.forward``, counting its calls in ``report.calls``, and
    register its undo on ``report``."""
    previous = module.__dict__.get("forward")
    patched.calls = report.calls
    report.installed.append((module, patched))
    module.forward = patched
    report.on_undo(_UndoSwap(module, patched, previous))


def stock_forward(module: nn.Module):
    """The forward the module would run now (an instance override, else the class method)."""
    return module.__dict__.get("forward") or type(module).forward.__get__(module)


def single_input(args: tuple, kwargs: dict):
    """The one tensor a stock norm/MLP forward takes (positional, or named hidden_states/x), else None."""
    if len(args) == 1 and not kwargs:
        return args[0]
    if not args and len(kwargs) == 1:
        return next(iter(kwargs.values()))
    return None


def signature_has(fn, *names: str) -> bool:
    """True when ``fn`` accepts each of ``names`` (as a named parameter or through **kwargs)."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return all(n in params or var_kw for n in names)


# Decode steps (a few rows, no autograd) are bound by kernel launches, not bytes: there the stock
# module code (one aten kernel per op) beats a Triton launch plus the Python around it (H200,
# 8B shape: 0.70-0.76x stock generation tokens/s at batch 1 and 8 before this rule). Prefill,
# evaluation on whole sequences and training keep the kernels.
STOCK_INFERENCE_MAX_ROWS = 64
DECODE_STEP = "a decode step (few rows, no autograd: the stock code launches fewer kernels)"  # count() reason


_GRAPHLESS_TRAINING = contextvars.ContextVar("fasttune_graphless_training", default=False)


@contextlib.contextmanager
def graphless_training():
    """Around a checkpointed layer's forward run without autograd (``no_grad_forward.py``): the
    calls inside are training calls, which its recompute in backward repeats with autograd on."""
    token = _GRAPHLESS_TRAINING.set(True)
    try:
        yield
    finally:
        _GRAPHLESS_TRAINING.reset(token)


def autograd_on() -> bool:
    """Autograd records this call, or will record it again (``graphless_training``): the call must
    take the path its recompute takes, whatever grad mode says."""
    return torch.is_grad_enabled() or _GRAPHLESS_TRAINING.get()


def few_rows_without_grad(rows: int) -> bool:
    """True for a call without autograd on at most ``STOCK_INFERENCE_MAX_ROWS`` rows (tokens)."""
    return not autograd_on() and rows <= STOCK_INFERENCE_MAX_ROWS


def stock_is_faster(x) -> bool:
    """``few_rows_without_grad`` for a [..., features] tensor (one row per token)."""
    return (isinstance(x, torch.Tensor) and x.dim() >= 1
            and few_rows_without_grad(x.numel() // max(1, x.shape[-1])))


def find_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside DDP/FSDP-style ``.module`` wrappers and PEFT."""
    m = model
    for _ in range(4):
        if hasattr(m, "get_base_model"):  # PeftModel
            m = m.get_base_model()
        elif type(m).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
                getattr(m, "module", None), nn.Module):
            m = m.module
        else:
            break
    return m
