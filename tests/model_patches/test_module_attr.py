"""module_attr reads what getattr reads, in the same order, for every kind of nn.Module attribute."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from fasttune.model_patches.module_attr import base_layer_of, module_attr


class _WithProperty(nn.Linear):
    @property
    def shadow(self):  # a class attribute wins over the stores
        return "property"


class _OwnGetattr(nn.Module):
    def __getattr__(self, name):
        if name == "virtual":
            return "from __getattr__"
        return super().__getattr__(name)


def _cases():
    lin = _WithProperty(3, 2)
    lin.register_buffer("scale", torch.ones(2))
    lin.inner = nn.Linear(1, 1)
    lin.plain = 7
    lin.register_module("empty", None)
    own = _OwnGetattr()
    own.register_buffer("b", torch.zeros(1))
    names = ("weight", "bias", "scale", "inner", "plain", "empty", "shadow", "forward", "training", "missing",
             "virtual", "b", "__class__")
    return [(m, n) for m in (lin, own, None, 3) for n in names]


@pytest.mark.parametrize("module,name", _cases())
def test_same_value_as_getattr(module, name):
    sentinel = object()
    expected = getattr(module, name, sentinel)
    got = module_attr(module, name, sentinel)
    assert got is expected or (callable(got) and got == expected)  # bound methods are new objects per read


def test_base_layer_of_is_peft_get_base_layer():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["0"]))
    lora_layer = peft_model.base_model.model[0]
    assert base_layer_of(lora_layer) is lora_layer.get_base_layer()
    plain = peft_model.base_model.model[1]
    assert base_layer_of(plain) is plain


def test_parameters_swapped_later_are_read_fresh():
    lin = nn.Linear(2, 2)
    assert module_attr(lin, "weight") is lin.weight
    lin.weight = nn.Parameter(torch.zeros(2, 2))
    assert module_attr(lin, "weight") is lin.weight
    del lin.bias
    assert module_attr(lin, "bias", "gone") == "gone"
