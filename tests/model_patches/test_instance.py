"""Per-instance forward swaps: signature kept, undo exact, other instances untouched, deepcopy-safe."""

import copy
import inspect

import torch
from torch import nn

from fasttune.model_patches.instance import (
    STOCK_INFERENCE_MAX_ROWS, PatchedForward, signature_has, stock_forward, stock_is_faster, swap_forward)
from fasttune.model_patches.report import PatchReport


class Doubled(PatchedForward):
    def __call__(self, x):
        return 2 * self.stock(x)


def test_swap_changes_one_instance_and_undo_restores_it():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    report = PatchReport()
    swap_forward(a, Doubled(a, stock_forward(a)), report)
    x = torch.randn(2, 3)
    assert torch.equal(a(x), 2 * b(x))
    assert "forward" not in b.__dict__ and nn.Linear.forward is type(b).forward
    assert inspect.signature(a.forward) == inspect.signature(b.forward)
    report.undo()
    assert "forward" not in a.__dict__ and torch.equal(a(x), b(x))
    report.undo()  # idempotent


def test_undo_restores_a_previous_instance_forward_and_respects_later_swaps():
    m = nn.Linear(3, 3)
    mine = lambda x: x  # noqa: E731 - a user's own instance override
    m.forward = mine
    report = PatchReport()
    swap_forward(m, Doubled(m, stock_forward(m)), report)
    report.undo()
    assert m.forward is mine
    report2 = PatchReport()
    swap_forward(m, Doubled(m, stock_forward(m)), report2)
    theirs = lambda x: -x  # noqa: E731 - something replaced ours afterwards
    m.forward = theirs
    report2.undo()
    assert m.forward is theirs


def test_deepcopy_of_a_patched_module_undoes_itself_only():
    m = nn.Linear(3, 3)
    report = PatchReport()
    swap_forward(m, Doubled(m, stock_forward(m)), report)
    holder = nn.Module()
    holder.m = m
    holder.report = report
    twin = copy.deepcopy(holder)
    twin.report.undo()
    assert "forward" not in twin.m.__dict__ and isinstance(m.__dict__["forward"], Doubled)
    assert twin.m.__dict__.get("forward") is None


def test_signature_has():
    def f(a, b=1):
        return a

    def g(a, **kw):
        return a

    assert signature_has(f, "a", "b") and not signature_has(f, "c")
    assert signature_has(g, "anything")


def test_single_input():
    from fasttune.model_patches.instance import single_input

    t = torch.zeros(1)
    assert single_input((t,), {}) is t and single_input((), {"hidden_states": t}) is t
    assert single_input((t, t), {}) is None and single_input((t,), {"x": t}) is None and single_input((), {}) is None


def test_stock_is_faster_only_for_few_rows_without_autograd():
    rows = STOCK_INFERENCE_MAX_ROWS
    decode, prefill = torch.zeros(8, 1, 16), torch.zeros(2, rows, 16)
    with torch.no_grad():
        assert stock_is_faster(decode) and stock_is_faster(torch.zeros(rows, 16))
        assert not stock_is_faster(prefill)
        assert not stock_is_faster("not a tensor") and not stock_is_faster(torch.tensor(1.0))
    assert not stock_is_faster(decode)  # training and anything else with autograd: the kernels


def test_decode_steps_run_stock_code_and_prefill_the_kernels(monkeypatch):
    """A patched model in no-grad mode: a one-token step launches no fasttune kernel, a prompt does."""
    from fasttune import FastConfig, patch_model
    from fasttune.kernels import rms_norm as rms_mod, rope as rope_mod, swiglu as swiglu_mod
    from helpers.tiny_models import tiny_model

    calls = []
    for mod, name in ((rms_mod, "rms_norm"), (rope_mod, "apply_rope"), (swiglu_mod, "swiglu")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    model = tiny_model("llama", vocab_size=1000).eval()
    patch_model(model, FastConfig())
    with torch.no_grad():
        model(input_ids=torch.randint(0, 1000, (2, 1)))
        assert calls == []
        model(input_ids=torch.randint(0, 1000, (2, STOCK_INFERENCE_MAX_ROWS)))
        assert {"rms_norm", "apply_rope", "swiglu"} <= set(calls)
