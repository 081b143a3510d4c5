"""FastConfig: normalisation, contradictions rejected with the field named, dict round trip."""

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
    (dict(fsdp_reshard_after_forward="no"), "fsdp_reshard_after_forward"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FastConfig(**kwargs)


def test_unknown_key_lists_known_fields():
    with pytest.raises(ValueError, match="unknown FastConfig field.*checkpointing"):
        FastConfig.from_dict({"checkpointin": "offload"})


def test_every_field_has_help():
    helps = FastConfig.field_help()
    assert helps and all(text.strip() for text in helps.values())
