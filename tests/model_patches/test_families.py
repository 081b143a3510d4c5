"""The families table is data that matches the installed transformers exactly."""

import dataclasses
import importlib

import pytest
from transformers import AutoConfig

from fasttune.model_patches.families import ACTIVATIONS, FAMILIES, family_for, resolve_classes
from helpers.tiny_models import FAMILY_TYPES
from helpers.tiny_vlms import VLM_TYPES

CLASS_FIELDS = ("causal_lm_class", "decoder_layer_class", "attention_class", "mlp_class", "norm_class")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_row_resolves_every_class_and_matches_the_config(model_type):
    spec = FAMILIES[model_type]
    assert spec.model_type == model_type
    classes = resolve_classes(spec)
    assert set(classes) == set(CLASS_FIELDS), f"unresolved: {set(CLASS_FIELDS) - set(classes)}"
    config = AutoConfig.for_model(model_type)
    assert config.model_type == model_type
    text = config.get_text_config()  # a vision-language model's MLP reads its language tower's config
    assert any(getattr(text, a, None) in ACTIVATIONS for a in spec.activation_attrs)
    module = importlib.import_module(spec.modeling_module)
    assert classes["causal_lm_class"].__module__ == module.__name__
    for attr in (spec.final_softcap_attr, spec.logit_divisor_attr):
        assert attr is None or hasattr(config, attr)
    assert spec.norm_casting in ("llama", "gemma") and spec.qk_norm in (None, "head", "full")
    assert spec.qkv_layout in ("separate", "fused") and spec.mlp_layout in ("separate", "fused")
    for _, source in spec.attention_kwargs:
        assert source.split(":")[0] in ("module", "config")
    assert spec.gguf_arch


def test_every_row_has_a_tiny_model_in_the_parity_tests():
    # test_family_parity.py, test_lora.py and test_attention.py run over FAMILY_TYPES, and
    # test_vision.py over the vision-language rows (VLM_TYPES): a row missing there would skip its parity test.
    assert sorted(FAMILY_TYPES) == sorted(t for t, spec in FAMILIES.items() if spec.vision is None)
    assert sorted(VLM_TYPES) == sorted(t for t, spec in FAMILIES.items() if spec.vision is not None)


def test_lookup_is_exact():
    assert family_for("llama") is FAMILIES["llama"]
    assert family_for("Llama") is None and family_for("llama2") is None and family_for(None) is None


def test_rows_are_frozen_data():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAMILIES["llama"].norm_offset = 1.0
