"""``DropoutWatch``: does a module draw dropout below it, asked cheaply on every call, rescanned when adapters
change."""

from __future__ import annotations

from torch import nn

from fasttune.model_patches.dropout_watch import DropoutWatch


class _Proj(nn.Module):
    """PEFT's layout: per-adapter dropouts in a ModuleDict."""

    def __init__(self, p: float):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(p) if p else nn.Identity()})


class _Block(nn.Module):
    def __init__(self, p: float = 0.0, own: float = 0.0):
        super().__init__()
        self.q = _Proj(p)
        self.k = _Proj(0.0)
        self.residual_dropout = own  # acts after the core: not counted with skip_self


def test_lora_dropout_below_counts_in_training_only():
    block = _Block(p=0.1).train()
    watch = DropoutWatch(skip_self=True)
    assert watch.draws(block)
    block.eval()
    assert not watch.draws(block)
    block.train()
    block.q.lora_dropout["default"].eval()  # a submodule left in eval mode draws nothing
    assert not watch.draws(block)


def test_p_changed_in_place_is_seen_and_own_attributes_follow_skip_self():
    block = _Block(p=0.0, own=0.2).train()
    watch, with_self = DropoutWatch(skip_self=True), DropoutWatch()
    assert not watch.draws(block) and with_self.draws(block)
    block.residual_dropout = 0.0
    assert not with_self.draws(block)
    block.k.lora_dropout["default"] = nn.Dropout(0.0)
    watch.draws(block)  # same sizes: no rescan, so the new module is not seen yet ...
    block.k.lora_dropout["extra"] = nn.Dropout(0.5)  # ... an added adapter changes a ModuleDict's size: rescan
    assert watch.draws(block)
    del block.k.lora_dropout["extra"]
    assert not watch.draws(block)
