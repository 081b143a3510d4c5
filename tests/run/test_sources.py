"""Where a run's model and data come from, classified without loading anything; the Hub ids cards name."""

from __future__ import annotations

import pytest

from fasttune.run.config import RunConfig
from fasttune.run.sources import classify_dataset, classify_model, is_hub_id


def test_sources_classified_without_loading(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert classify_model("embedded") == "embedded" and classify_model(str(model_dir)) == "local"
    assert classify_model("Qwen/Qwen2.5-0.5B") == "hub" and classify_model("gpt2") == "hub"
    with pytest.raises(ValueError, match="neither an existing local folder nor a Hub id"):
        classify_model("./no/such/model")
    with pytest.raises(ValueError, match="has no config.json"):
        classify_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        classify_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="is not one of .json, .jsonl, .csv, .parquet"):
        classify_dataset(str(tmp_path / "notes.txt"))
    assert classify_dataset("trl-lib/Capybara") == "hub"


def test_hub_ids_for_cards_come_from_the_config_or_a_hub_source(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    local = RunConfig.from_dict({"data": {"dataset": str(data)}})
    assert local.hub_base_id() is None and local.hub_datasets() == []  # embedded base, local data
    hub = RunConfig.from_dict({"model": {"base": "org/base"}, "data": {"dataset": "org/data"}})
    assert hub.hub_base_id() == "org/base" and hub.hub_datasets() == ["org/data"]
    named = RunConfig.from_dict({"fast": {"base_model_id": "org/original"}})
    assert named.hub_base_id() == "org/original"
    assert is_hub_id("org/name") and not is_hub_id("../x") and not is_hub_id("rows.jsonl")
