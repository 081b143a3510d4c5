"""FastConfig: types checked and contradictions rejected with the field named, dict round trip,
``coerce`` for the places that take a config (trainers, callback, patch_model)."""

import dataclasses

import pytest

from fasttune.config import FastConfig


def test_defaults_round_trip():
    cfg = FastConfig()
    assert FastConfig.from_dict(cfg.to_dict()) == cfg


def test_round_trip_with_values():
    cfg = FastConfig(checkpointing="auto", memory_budget_gb=40.0, export_artifacts=["adapter", "gguf"],
                     gguf_quantizations=("Q8_0", "q4_k_m"), push_to_hub=True, hub_model_id="me/run")
    assert cfg.gguf_quantizations == ("q8_0", "q4_k_m")
    assert cfg.export_artifacts == ("adapter", "gguf")
    data = cfg.to_dict()
    assert data["export_artifacts"] == ["adapter", "gguf"]
    assert FastConfig.from_dict(data) == cfg


@pytest.mark.parametrize("kwargs, field", [
    (dict(checkpointing="sometimes"), "checkpointing"),
    (dict(memory_budget_gb=10.0), "memory_budget_gb"),
    (dict(checkpointing="auto", memory_budget_gb=-1.0), "memory_budget_gb"),
    (dict(export_artifacts=("weights",)), "export_artifacts"),
    (dict(gguf_quantizations=("q9_9",)), "gguf_quantizations"),
    (dict(push_to_hub=True), "hub_model_id"),
    (dict(push_to_hub=True, hub_model_id="a/b", push_artifacts=()), "push_artifacts"),
    (dict(hub_model_id="a/b/c"), "hub_model_id"),
    (dict(loss_workspace_mib=0), "loss_workspace_mib"),
    (dict(merged_dtype="int8"), "merged_dtype"),
    (dict(base_dtype="float8"), "base_dtype"),
    (dict(checkpointing="auto", memory_budget_gb=float("inf")), "memory_budget_gb"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FastConfig(**kwargs)


def test_base_dtype_defaults_to_the_exact_path_and_round_trips():
    assert FastConfig().base_dtype == "auto"
    cfg = FastConfig(base_dtype="fp8")
    assert FastConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_key_lists_known_fields():
    with pytest.raises(ValueError, match="unknown FastConfig field.*checkpointing"):
        FastConfig.from_dict({"checkpointin": "offload"})


def test_every_field_has_help():
    helps = FastConfig.field_help()
    assert helps and all(text.strip() for text in helps.values())


BOOL_FIELDS = [f.name for f in dataclasses.fields(FastConfig) if str(f.type) in ("bool", "bool | None")]


def test_every_bool_field_is_known():
    assert {"rms_norm", "cross_entropy", "lora_widen", "push_to_hub", "fsdp_reshard_after_forward"} <= set(BOOL_FIELDS)


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["no", "false", "True", 1, 0, None])
def test_bool_fields_reject_non_bools(name, value):
    # bool("no") is True: a string accepted here would leave the kernel on.
    if value is None and getattr(FastConfig(), name) is None:
        pytest.skip("None is this field's default")
    with pytest.raises(TypeError, match=f"^{name} must be True(, False)? or (False|None), got {value!r}"):
        FastConfig(**{name: value})


@pytest.mark.parametrize("kwargs, name", [
    (dict(loss_workspace_mib="big"), "loss_workspace_mib"),
    (dict(loss_workspace_mib=1.5), "loss_workspace_mib"),
    (dict(loss_workspace_mib=True), "loss_workspace_mib"),
    (dict(checkpointing="auto", memory_budget_gb="40"), "memory_budget_gb"),
    (dict(checkpointing="auto", memory_budget_gb=False), "memory_budget_gb"),
    (dict(checkpointing=True), "checkpointing"),
    (dict(hub_model_id=123), "hub_model_id"),
    (dict(merged_dtype=None), "merged_dtype"),
    (dict(base_dtype=8), "base_dtype"),
    (dict(export_artifacts=5), "export_artifacts"),
    (dict(gguf_quantizations=["q8_0", 4]), "gguf_quantizations"),
])
def test_wrong_types_name_the_field(kwargs, name):
    with pytest.raises(TypeError, match=f"^{name} must be"):
        FastConfig(**kwargs)


def test_numbers_are_normalised():
    cfg = FastConfig(checkpointing="auto", memory_budget_gb=40, loss_workspace_mib=256)
    assert type(cfg.memory_budget_gb) is float and cfg.memory_budget_gb == 40.0
    assert type(cfg.loss_workspace_mib) is int
    assert dataclasses.replace(cfg, loss_workspace_mib=512).loss_workspace_mib == 512  # replace re-checks


def test_coerce():
    cfg = FastConfig(rope=False)
    assert FastConfig.coerce(cfg) is cfg
    assert FastConfig.coerce(None) == FastConfig()
    assert FastConfig.coerce({"rope": False, "export_artifacts": ["adapter"]}) == FastConfig(
        rope=False, export_artifacts=("adapter",))
    with pytest.raises(TypeError, match="fast_config must be a FastConfig, a dict of FastConfig fields or None, got str"):
        FastConfig.coerce("offload")
    with pytest.raises(ValueError, match=r"config: unknown FastConfig field\(s\) \['ropee'\]"):
        FastConfig.coerce({"ropee": False}, "config")
    with pytest.raises(TypeError, match="fast_config: rope must be True or False"):
        FastConfig.coerce({"rope": "no"})
    with pytest.raises(TypeError, match="from_dict expects a dict"):
        FastConfig.from_dict([("rope", False)])
