"""PatchReport: what patch_model changed on one model, what stayed stock and why, and how to undo it.

Patch time says what was installed; it does not say what runs: something installed over a patched
forward later (TRL's fused LM head, accelerate's mixed-precision wrapper) can answer the calls in
its place. So the installed forwards also count their calls at run time in ``calls``, one Counter
increment per call: ``(op, FUSED)`` when the kernel ran, ``(op, reason)`` when the call took the
stock path. ``call_summary`` turns the counts into log lines and warnings (an op that ran no call
fused, and why).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger("fasttune")

FUSED = "fused"  # the outcome of a call that ran fasttune's kernel; any other outcome says why it ran stock


@dataclass(frozen=True)
class Fallback:
    """One place that stayed on the stock path.

    Attributes:
        op: the fast path that was not taken ("rms_norm", "lora_mlp", "*" for the whole model).
        where: module name (or model type) it concerns.
        reason: why, in words a user can act on.
    """

    op: str
    where: str
    reason: str


@dataclass
class PatchReport:
    """Result of ``patch_model``.

    Attributes:
        model_type: the model's ``config.model_type``.
        patched: op name → number of places that took the fast path.
        fallbacks: places that stayed stock, with the reason.
        calls: (op, outcome) → calls counted at run time; outcome ``FUSED`` or why the call ran stock.
        counted: the ops whose installed forwards count their calls in ``calls``.
        installed: (module, forward) per forward installed on a module (``instance.swap_forward``).
    """

    model_type: str | None = None
    patched: Counter = field(default_factory=Counter)
    fallbacks: list[Fallback] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)
    counted: set[str] = field(default_factory=set)
    installed: list[tuple[object, object]] = field(default_factory=list, repr=False)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def add(self, op: str, n: int = 1, counted: bool = False) -> None:
        """Record ``n`` places patched with ``op``; ``counted``: their calls are counted in ``calls``."""
        self.patched[op] += n
        if counted:
            self.counted.add(op)

    def fallback(self, op: str, where: str, reason: str) -> None:
        self.fallbacks.append(Fallback(op, where, reason))

    def on_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def take_undo(self, wanted: Callable[[Callable[[], None]], bool]) -> list[Callable[[], None]]:
        """Remove and return the undo steps ``wanted`` picks (in the order they were registered)."""
        taken = [fn for fn in self._undo if wanted(fn)]
        self._undo[:] = [fn for fn in self._undo if not wanted(fn)]
        return taken

    def undo(self) -> None:
        """Restore every patched module, last patch first. Idempotent."""
        while self._undo:
            self._undo.pop()()

    def __str__(self) -> str:
        lines = [f"fasttune patch report ({self.model_type})"]
        if self.patched:
            width = max(len(op) for op in self.patched)
            lines += [f"  {op:<{width}}  {n:>4} patched" for op, n in sorted(self.patched.items())]
        else:
            lines.append("  nothing patched")
        if self.fallbacks:
            # Group identical reasons so a 32-layer model gives one line per cause, not 32.
            grouped: dict[tuple[str, str], list[str]] = {}
            for fb in self.fallbacks:
                grouped.setdefault((fb.op, fb.reason), []).append(fb.where)
            lines.append("  stock (fallbacks):")
            for (op, reason), wheres in grouped.items():
                shown = ", ".join(wheres[:3]) + (f" (+{len(wheres) - 3} more)" if len(wheres) > 3 else "")
                lines.append(f"    {op}: {reason} [{shown}]")
        return "\n".join(lines)

    def call_summary(self) -> tuple[list[str], list[str]]:
        """The calls counted so far: (one line per counted op, one warning per op that ran no call fused).

        A line reads ``cross_entropy: 2/2 calls fused``, with the stock calls and their reasons
        after it; a warning names the reason (every call stock, or none reached fasttune's forward
        and what replaced it).
        """
        lines, warnings = [], []
        for op in sorted(self.counted):
            outcomes = {why: n for (o, why), n in self.calls.items() if o == op}
            fused = outcomes.pop(FUSED, 0)
            total = fused + sum(outcomes.values())
            stock = "; ".join(f"{n} stock: {why}" for why, n in sorted(outcomes.items(), key=lambda kv: -kv[1]))
            lines.append(f"{op}: {fused}/{total} calls fused" + (f" ({stock})" if stock else ""))
            if fused == 0:
                why = f"every call ran stock ({stock})" if total else self._why_no_call(op)
                warnings.append(f"{op} is patched but ran no call fused: {why}")
        return lines, warnings

    def _why_no_call(self, op: str) -> str:
        """Why no call of ``op`` was counted: a forward of ours replaced since (by what), or not reached."""
        for module, fwd in self.installed:
            current = getattr(module, "__dict__", {}).get("forward")
            if getattr(fwd, "op", None) == op and current is not fwd:
                return (f"{type(module).__name__}.forward was replaced after patching by "
                        f"{describe_forward(current)}, which answers the calls without reaching fasttune's forward")
        return "no call reached fasttune's forward (the model's forward never ran through it)"


def describe_forward(fn) -> str:
    """A readable name for a forward: where its code is defined."""
    if fn is None:
        return "the class's own forward"
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is not None:  # not __qualname__: functools.wraps copies the wrapped function's (TRL's head does)
        module = getattr(fn, "__globals__", {}).get("__name__", "?")
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
    return f"{type(fn).__module__}.{type(fn).__qualname__}"


LOGGED_ATTR = "_fasttune_logged_report"  # on the model instance: the text of the report last logged for it


def log_report(report: PatchReport, model: object | None = None) -> bool:
    """Log the report: at WARNING when something stayed stock, else at INFO; returns whether it logged.

    With ``model``, once per model instance: a model patched again with the same outcome (the
    loader patches, then the Trainer re-patches with the same config) is not logged again; a
    different outcome is. Ranks other than 0 of a launched job (``RANK`` set by torchrun/accelerate)
    log nothing: rank 0 speaks for them.
    """
    if os.environ.get("RANK", "0") not in ("0", ""):
        return False
    text = str(report)
    if model is not None:
        if getattr(model, "__dict__", {}).get(LOGGED_ATTR) == text:
            return False
        model.__dict__[LOGGED_ATTR] = text
    logger.log(logging.WARNING if report.fallbacks else logging.INFO, "%s", text)
    return True


def log_calls(report: PatchReport, label: str = "model") -> None:
    """Log the run-time call counts of ``report`` at INFO, and a WARNING per op that ran no call fused."""
    lines, warnings = report.call_summary()
    if lines:
        logger.info("fasttune: run-time calls of the %s (%s):\n  %s", label, report.model_type, "\n  ".join(lines))
    for text in warnings:
        logger.warning("fasttune: %s: %s", label, text)
