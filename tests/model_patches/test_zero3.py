"""model_patches/zero3.py: when a fused path may read DeepSpeed ZeRO-3 parameters (their attributes
stood in for; the real engine runs in tests/test_distributed.py)."""

from types import SimpleNamespace

import torch
from torch import nn

from fasttune.model_patches.zero3 import is_zero3_param, only_zero3_hooks, zero3_ready


def _zero3(p: nn.Parameter, status: str, persist: bool = False) -> nn.Parameter:
    p.ds_id, p.ds_status, p.ds_persist = id(p), SimpleNamespace(name=status), persist
    return p


def test_is_zero3_param():
    p = nn.Parameter(torch.zeros(2))
    assert not is_zero3_param(p) and not is_zero3_param(None)
    assert is_zero3_param(_zero3(p, "AVAILABLE"))


def test_ready_only_when_gathered_and_kept_for_the_module():
    owner = nn.Linear(2, 2)
    registered = []
    owner.ds_external_parameters = lambda: [(str(i), p) for i, p in enumerate(registered)]
    w = _zero3(nn.Parameter(torch.ones(3, 2)), "NOT_AVAILABLE")
    plain = nn.Parameter(torch.ones(2))
    assert zero3_ready(owner, plain, None)  # nothing of ZeRO-3's: nothing to wait for
    assert not zero3_ready(owner, w)  # partitioned
    w.ds_status = SimpleNamespace(name="AVAILABLE")
    assert not zero3_ready(owner, w)  # gathered for someone else's forward: released before our backward
    registered.append(w)
    assert zero3_ready(owner, w, plain)
    empty = _zero3(nn.Parameter(torch.ones(0)), "AVAILABLE")
    registered.append(empty)
    assert not zero3_ready(owner, empty)  # an empty partition is never whole
    persistent = _zero3(nn.Parameter(torch.ones(2)), "AVAILABLE", persist=True)
    assert zero3_ready(nn.Linear(2, 2), persistent)  # persistent parameters stay gathered


def test_only_zero3_hooks():
    def deepspeed_hook(module, *args):
        return None

    def user_hook(module, *args):
        return None

    deepspeed_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    m = nn.Linear(2, 2)
    assert only_zero3_hooks(m)  # no hooks at all
    m.register_forward_pre_hook(deepspeed_hook)
    m.register_forward_hook(deepspeed_hook)
    assert only_zero3_hooks(m)
    m.register_forward_hook(user_hook)
    assert not only_zero3_hooks(m)
