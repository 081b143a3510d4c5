"""PatchReport: what patch_model changed on one model, what stayed stock and why, and how to undo it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable


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
    """

    model_type: str | None = None
    patched: Counter = field(default_factory=Counter)
    fallbacks: list[Fallback] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def add(self, op: str, n: int = 1) -> None:
        self.patched[op] += n

    def fallback(self, op: str, where: str, reason: str) -> None:
        self.fallbacks.append(Fallback(op, where, reason))

    def on_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

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
