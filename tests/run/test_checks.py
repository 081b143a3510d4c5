"""Checks of a run config's sources before anything loads: paths, offline Hub ids, columns, packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fasttune.run.checks import check_sources, validate
from fasttune.run.config import FORMATS, RunConfig, RunConfigError, load_run_config

ROOT = Path(__file__).resolve().parents[2]


def test_check_sources_reports_paths_offline_hub_ids_and_columns(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"q": f"q{i}", "a": f"a{i}"}) for i in range(3)))
    cfg = RunConfig.from_dict({"model": {"base": "org/tiny"}, "data": {"dataset": str(data)}})
    errors = check_sources(cfg)
    assert any(e.startswith("model.base: 'org/tiny' is a Hub id but HF_HUB_OFFLINE is set") for e in errors)
    assert any(e.startswith("data.columns: the dataset's columns (q, a) hold no sft format") for e in errors)
    cfg = RunConfig.from_dict({"data": {"dataset": str(data), "columns": {"prompt": "q", "completion": "answer"}}})
    assert check_sources(cfg) == ["data.columns.completion: column 'answer' is not in the dataset; columns: q, a"]
    cfg = RunConfig.from_dict({"data": {"dataset": str(data), "columns": {"prompt": "q", "completion": "a"}}})
    assert check_sources(cfg) == []
    cfg = RunConfig.from_dict({"data": {"dataset": "org/data"}})
    assert check_sources(cfg)[0].startswith("data.dataset: 'org/data' is a Hub id but HF_HUB_OFFLINE is set")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert check_sources(cfg) == []


def test_check_sources_needs_the_optional_packages_a_run_uses(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llama_cpp", "bitsandbytes") else real(name, *a))
    cfg = RunConfig.from_dict({"method": "qlora", "fast": {"export_artifacts": ["gguf"],
                                                           "gguf_quantizations": ["q8_0", "q4_k_m"]}})
    assert check_sources(cfg) == [
        "method: 'qlora' needs bitsandbytes (pip install 'fasttune[qlora]')",
        "fast.gguf_quantizations: q4_k_m need llama-cpp-python (pip install 'fasttune[gguf-kquants]'; see the "
        "README for its build flags)"]
    cfg = RunConfig.from_dict({"fast": {"gguf_quantizations": ["q4_k_m"]}})  # no gguf artifact: no need
    assert check_sources(cfg) == []


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(path):
    cfg = load_run_config(path)
    assert check_sources(cfg) == []
    assert cfg.trainer in FORMATS


def test_validation_imports_no_ml_library():
    code = ("import sys; from fasttune.run.config import RunConfig; from fasttune.run.checks import check_sources; "
            "c = RunConfig.from_dict({'trainer': 'dpo'}); check_sources(c); "
            "print(sorted(m for m in ('torch', 'transformers', 'trl', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_validate_raises_every_problem_with_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = RunConfig.from_dict({"model": {"base": "org/tiny"}, "data": {"dataset": "org/data"}})
    with pytest.raises(RunConfigError) as info:
        validate(cfg, "run.yaml")
    assert len(info.value.errors) == 2 and "in run.yaml" in str(info.value)
    validate(RunConfig())  # the embedded defaults: nothing to report


def test_check_sources_refuses_a_bad_hub_repo_id_and_checks_eval_data(tmp_path):
    cfg = RunConfig.from_dict({"fast": {"hub_model_id": "me/bad repo!"}})
    [error] = check_sources(cfg)
    assert error.startswith("fast.hub_model_id: Repo id must use alphanumeric chars") and "'me/bad repo!'" in error
    assert check_sources(RunConfig.from_dict({"fast": {"hub_model_id": "me/good-repo"}})) == []
    cfg = RunConfig.from_dict({"data": {"eval_dataset": str(tmp_path / "missing.jsonl")}})
    assert check_sources(cfg) == [f"data.eval_dataset: local file '{tmp_path / 'missing.jsonl'}' does not exist"]
    cfg = RunConfig.from_dict({"training": {"assistant_only_loss": True}})  # embedded: prompt/completion
    assert check_sources(cfg)[0].startswith("training.assistant_only_loss: needs chat data (a messages column); "
                                            "the dataset has prompt, completion")


def test_a_tracker_needs_its_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard", "tensorboardX") else real(name, *a))
    cfg = RunConfig.from_dict({"training": {"report_to": ["tensorboard", "wandb"]}})
    assert check_sources(cfg) == ["training.report_to: 'tensorboard' needs the tensorboard package "
                                  "(pip install 'fasttune[tensorboard]')",
                                  "training.report_to: 'wandb' needs the wandb package (pip install 'fasttune[wandb]')"]
