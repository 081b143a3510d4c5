"""What a run's cards say, from its folder: base and data in words when they have no Hub id, the
base's license, hyperparameters from the run config, the held-out results."""

from __future__ import annotations

import json

from fasttune.run.config import RunConfig
from fasttune.run.folder import RunFolder
from fasttune.run.run_card import EMBEDDED_BASE, EMBEDDED_DATA, hyperparameter_rows, run_card_facts


def _folder(tmp_path, metrics=None, history=None):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir(parents=True)
    if metrics is not None:
        folder.write_metrics(metrics)
    if history is not None:
        folder.trainer_state.write_text(json.dumps({"global_step": 9, "log_history": history}))
    return folder


def test_embedded_run(tmp_path):
    folder = _folder(tmp_path, {"exact_match": 0.90625}, [{"loss": 2.0, "step": 1}, {"loss": 1.0, "step": 9}])
    facts = run_card_facts(folder, RunConfig.from_dict({}))
    assert facts.base_model_id is None and facts.base_note == EMBEDDED_BASE and "no Hub id" in EMBEDDED_BASE
    assert facts.license.license == "apache-2.0" and facts.datasets == [] and facts.dataset_note == EMBEDDED_DATA
    assert facts.method == "LoRA, SFT with TRL"
    assert facts.evaluation == [{"metric": "exact match", "value": "90.6%", "detail": facts.evaluation[0]["detail"]}]
    assert "held-out" in facts.evaluation[0]["detail"] and facts.stats["global_step"] == 9


def test_local_base_and_data_are_named_without_their_paths(tmp_path):
    base = tmp_path / "checkpoints" / "my-base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: my-terms\n---\n")
    data = tmp_path / "private" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = RunConfig.from_dict({"model": {"base": str(base)}, "data": {"dataset": str(data)}, "method": "qlora"})
    facts = run_card_facts(_folder(tmp_path, history=[{"eval_loss": 0.75, "step": 9}]), cfg)
    assert facts.base_model_id is None and "a local folder (my-base)" in facts.base_note
    assert str(tmp_path) not in facts.base_note + (facts.dataset_note or "")
    assert facts.license.front_matter() == {"license": "other", "license_name": "my-terms"}
    assert facts.dataset_note == "a local file, train.jsonl" and facts.method.startswith("QLoRA")
    assert facts.evaluation[0]["metric"] == "eval loss" and facts.evaluation[0]["value"] == "0.75"
    named = RunConfig.from_dict({"model": {"base": str(base)}, "fast": {"base_model_id": "org/my-base"}})
    assert run_card_facts(_folder(tmp_path / "b"), named).base_model_id == "org/my-base"


def test_hub_base_and_dataset(tmp_path):
    cfg = RunConfig.from_dict({"model": {"base": "org/base-1b"}, "data": {"dataset": "org/chat", "split": "sft"},
                               "trainer": "dpo", "method": "full"})
    facts = run_card_facts(_folder(tmp_path), cfg)
    assert facts.base_model_id == "org/base-1b" and facts.base_note is None
    assert facts.license.license is None  # offline here, nothing cached: unknown, never guessed
    assert facts.datasets == ["org/chat"] and facts.dataset_note == "(split sft)"
    rows = dict(hyperparameter_rows(cfg))
    assert rows["trainer"] == "DPO" and rows["DPO beta"] == "0.1" and "LoRA rank (r)" not in rows
    assert rows["learning rate"] == "0.0002" and rows["epochs"] == "1"
    assert facts.evaluation == [] and facts.stats == {}
