"""transformers' Hub kernels (``use_kernels``) step aside on a patched instance, so its mode switches
cannot undo the patch.

A model kernelized by transformers (``from_pretrained(..., use_kernels=True)``; the default from
transformers 5.25 on, which also requires the ``kernels`` package) is kernelized again by
``PreTrainedModel.train()``/``eval()`` whenever the mode changes: ``kernels.kernelize`` sets, or
pops, the instance ``forward`` of every module whose class is decorated
``use_kernel_forward_from_hub`` (RMSNorm, the rotary embedding). The Trainer calls ``model.train()``
after fasttune has patched, so the norms' patches were replaced there and ran no call fused
(measured: transformers 5.24 with kernels 0.18.3, tests/model_patches/test_hub_kernels.py).

So the first patcher turns the instance's kernelization off (``set_use_kernels(False)``: transformers
5.25 restores the class forwards, 5.24 keeps the kernels' forwards and stops re-kernelizing), logs
it, and ``unpatch_model`` turns it on again in the mode it had. Modules fasttune does not patch keep
the classes' forwards from then on (5.25) or the kernels' (5.24). A re-patch (``patch_model`` on a
patched model) hands the switch from the old report to the new one instead of kernelizing in between
(on CUDA that would fetch the kernels from the Hub again, only to turn them off once more).
"""

from __future__ import annotations

import logging

from torch import nn

from .report import PatchReport

logger = logging.getLogger("fasttune")

OP = "hub_kernels_off"


def suspend_hub_kernels(base: nn.Module, spec, classes, config, report: PatchReport) -> None:
    """Turn transformers' kernelization off on every kernelized model inside ``base`` (module docstring)."""
    for module in base.modules():
        # _use_kernels sits in the instance dict of the model that from_pretrained kernelized (the top one)
        if not module.__dict__.get("_use_kernels") or not callable(getattr(module, "set_use_kernels", None)):
            continue
        mode = module.__dict__.get("_kernels_mode")
        module.set_use_kernels(False)
        report.on_undo(_Rekernelize(module, mode))
        report.add(OP)
        logger.info("fasttune: transformers' Hub kernels (use_kernels) turned off on %s while it is patched: "
                    "its train()/eval() would kernelize again over fasttune's patched layers; unpatch_model "
                    "turns them back on", type(module).__name__)


def hand_over(old: PatchReport, new: PatchReport) -> None:
    """Move the kernelization's undo from ``old`` (about to be undone by a re-patch) to ``new``: the
    models stay unkernelized through the re-patch, and ``new``'s undo turns them back on."""
    for fn in old.take_undo(lambda fn: isinstance(fn, _Rekernelize)):
        new.on_undo(fn)
        new.add(OP)


class _Rekernelize:
    """Kernelizes the model again, in the mode it had. An object, not a closure, so that
    ``copy.deepcopy`` of a patched model restores the copy, not the original."""

    def __init__(self, module: nn.Module, mode):
        self.module, self.mode = module, mode

    def __call__(self) -> None:
        try:
            if self.mode is None:
                self.module.set_use_kernels(True)
            else:
                self.module.set_use_kernels(True, mode=self.mode)
        except (ValueError, ImportError) as err:  # the kernels package gone since, or switched off by env
            logger.warning("fasttune: could not turn transformers' Hub kernels back on for %s after "
                           "unpatching: %s", type(self.module).__name__, err)


__all__ = ["OP", "hand_over", "suspend_hub_kernels"]
