"""The families table is data that matches the installed transformers exactly."""

import dataclasses
import importlib

import pytest
from transformers import AutoConfig

from fasttune.model_patches.families import ACTIVATIONS, FAMILIES, family_for, resolve_classes
from helpers.tiny_models import FAMILY_TYPES, MOE_TYPES, tiny_config
from helpers.tiny_vlms import VLM_TYPES

CLASS_FIELDS = ("causal_lm_class", "decoder_layer_class", "attention_class", "mlp_class", "norm_class")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_row_resolves_every_class_and_matches_the_config(model_type):
    spec = FAMILIES[model_type]
    assert spec.model_type == model_type
    classes = resolve_classes(spec)
    expected = {f for f in CLASS_FIELDS if getattr(spec, f) is not None}  # MoE-only families have no mlp_class
    assert set(classes) == expected, f"unresolved: {expected - set(classes)}"
    for name in (spec.moe_block_class, spec.experts_class):  # MoE rows: both or neither, and they resolve
        assert (name is None) == (spec.moe_block_class is None)
        assert name is None or isinstance(getattr(importlib.import_module(spec.modeling_module), name, None), type)
    assert spec.experts_glu in ("act", "clamped_swiglu")
    config = AutoConfig.for_model(model_type)
    assert config.model_type == model_type
    text = config.get_text_config()  # a vision-language model's MLP reads its language tower's config
    assert any(getattr(text, a, None) in ACTIVATIONS for a in spec.activation_attrs)
    module = importlib.import_module(spec.modeling_module)
    assert classes["causal_lm_class"].__module__ == module.__name__
    for attr in (spec.final_softcap_attr, spec.logit_divisor_attr):
        assert attr is None or hasattr(config, attr)
    assert spec.norm_casting in ("llama", "gemma")
    assert spec.qk_norm in (None, "head", "head_after_rope", "head_optional", "full") and len(spec.qk_norm_attrs) == 2
    assert spec.rope_layout in ("halves", "interleaved") and (spec.rope_flag is None or isinstance(spec.rope_flag, str))
    assert spec.rope_flag_when is None or (spec.rope_flag is not None and isinstance(spec.rope_flag_when, str))
    if spec.output_dropout_attr is not None:  # the attribute the row names is on the family's modules (Seed-OSS)
        config = tiny_config(model_type)
        assert hasattr(classes["attention_class"](config, 0), spec.output_dropout_attr)
        assert hasattr(classes["mlp_class"](config), spec.output_dropout_attr)
    assert spec.qkv_layout in ("separate", "fused") and spec.mlp_layout in ("separate", "fused")
    for _, source in spec.attention_kwargs:
        where, attr = source.split(":")
        assert where in ("module", "config") and attr.count("?") <= 1
    assert spec.gguf_arch


def test_every_row_has_a_tiny_model_in_the_parity_tests():
    # test_family_parity.py, test_lora.py and test_attention.py run over FAMILY_TYPES, test_moe.py over
    # MOE_TYPES, test_vision.py over VLM_TYPES: a row missing there would skip its parity test.
    assert sorted(FAMILY_TYPES + MOE_TYPES) == sorted(t for t, spec in FAMILIES.items() if spec.vision is None)
    assert sorted(VLM_TYPES) == sorted(t for t, spec in FAMILIES.items() if spec.vision is not None)


def test_lookup_is_exact():
    assert family_for("llama") is FAMILIES["llama"]
    assert family_for("Llama") is None and family_for("llama2") is None and family_for(None) is None


def test_rows_are_frozen_data():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAMILIES["llama"].norm_offset = 1.0
