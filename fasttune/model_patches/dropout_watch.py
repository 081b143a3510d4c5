"""Does a module draw random numbers (dropout) below it in training? Asked on every stashed core's call.

A stash skips a core in the recompute; a core that draws random numbers (PEFT's ``lora_dropout``
inside a projection, attention dropout) must run again instead, or what follows it in the recompute
would get other random numbers than in the forward. Walking a LoRA attention's ~45 submodules costs
~45 µs a call, so the watch keeps the modules that could draw (``forward_graphs.draws_dropout``'s
kinds, whatever their p now) and rescans only when a ``ModuleDict`` below (PEFT's per-adapter
``lora_A``/``lora_dropout``) changes size, as when an adapter is added or deleted.
"""

from __future__ import annotations

import numbers

from torch import nn

from .forward_graphs import draws_dropout


def _could_draw(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout) or any("dropout" in name and isinstance(p, numbers.Real)
                                            and not isinstance(p, bool) for name, p in m.__dict__.items())


class DropoutWatch:
    """``draws(module)``: does ``module`` or a module below it apply dropout with p > 0 when training? For one
    module (the first one asked about); ``skip_self``: its own dropout attributes do not count (they act after
    the core)."""

    def __init__(self, skip_self: bool = False):
        self.skip_self = skip_self
        self._candidates: tuple[nn.Module, ...] = ()
        self._dicts: tuple[nn.ModuleDict, ...] = ()
        self._stamp: tuple[int, ...] | None = None

    def draws(self, module: nn.Module) -> bool:
        if not module.training:
            return False
        if self._stamp is None or self._stamp != tuple(len(d) for d in self._dicts):
            self._scan(module)
        return any(m.training and draws_dropout(m) for m in self._candidates)

    def _scan(self, module: nn.Module) -> None:
        below = [m for m in module.modules() if not (self.skip_self and m is module)]
        self._candidates = tuple(m for m in below if _could_draw(m))
        self._dicts = tuple(m for m in module.modules() if isinstance(m, nn.ModuleDict))
        self._stamp = tuple(len(d) for d in self._dicts)


__all__ = ["DropoutWatch"]
