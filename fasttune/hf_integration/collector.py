"""``FastConfig.gc_freeze``: Python's cyclic collector leaves training's long-lived objects alone.

A full (generation-2) collection walks every tracked object: the model's modules and parameters, the
optimizer, transformers' and torch's own, ~0.5 million for an 8B LoRA setup. The training loop makes
enough surviving objects to run one every few dozen steps, and its 0.1-0.3 s hold the host while the GPU
waits. After the first optimizer step (optimizer states and kernel caches exist by then) the young
generations' garbage is collected and every object alive is frozen (``gc.freeze``): later collections walk
only what the loop makes. ``train()``'s end unfreezes them, so cycles among them that died meanwhile are
freed at the next collection. Runs shorter than ``FrozenCollector.MIN_STEPS``, a collector that is
disabled, or objects someone else froze, are left as they are.
"""

from __future__ import annotations

import gc
import logging

from transformers import TrainerCallback

logger = logging.getLogger("fasttune")


class FrozenCollector(TrainerCallback):
    """Freezes the collector's objects after the first optimizer step of each ``train()`` of at least
    ``MIN_STEPS`` steps, thaws at its end.

    The thaw costs one full collection soon after (the collector's count of long-lived objects was taken
    while they were frozen), and a full collection comes every few dozen steps: a shorter run would pay
    about what it saves (a test suite of many 3-step runs paid minutes).

    Attributes:
        froze: objects this callback froze are frozen now.
    """

    MIN_STEPS = 100

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.froze = False
        self._waiting = False  # a train() began and its first step has not ended yet

    def on_train_begin(self, args, state, control, **kwargs):
        self._waiting = self.enabled and (state.max_steps or 0) - state.global_step >= self.MIN_STEPS
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self._waiting:
            self._waiting = False
            self.freeze()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.thaw()
        return control

    def freeze(self) -> None:
        if self.froze:
            return
        if not gc.isenabled() or gc.get_freeze_count():
            logger.info("fasttune: Python's collector left as it is (%s; FastConfig.gc_freeze)",
                        "disabled" if not gc.isenabled() else f"{gc.get_freeze_count():,} objects frozen already")
            return
        # The young generations only: the Trainer ran a full collection as train() began (accelerate's
        # free_memory), and another here would cost as much (~0.4 s on the CPU machine) as the freeze saves
        # in a short run.
        gc.collect(1)
        gc.freeze()
        self.froze = True
        logger.info("fasttune: %s objects frozen for Python's collector until train() ends (FastConfig.gc_freeze)",
                    f"{gc.get_freeze_count():,}")

    def thaw(self) -> None:
        """Unfreeze what this callback froze (the end of ``train()``, or a ``train()`` that raised)."""
        self._waiting = False
        if self.froze:
            self.froze = False
            gc.unfreeze()


__all__ = ["FrozenCollector"]
