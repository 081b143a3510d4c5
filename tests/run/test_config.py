"""The YAML run config: schema, error messages, overrides (no model is ever loaded here)."""

from __future__ import annotations

import dataclasses

import pytest

from fasttune.config import FastConfig
from fasttune.run.config import (KNOWN_KEYS, OPTIMIZERS, SCHEDULERS, RunConfig, RunConfigError, apply_overrides,
                                 field_help, load_run_config, parse_run_config)


def _errors(data) -> list[str]:
    with pytest.raises(RunConfigError) as info:
        RunConfig.from_dict(data)
    return info.value.errors


def test_defaults_round_trip_through_yaml():
    cfg = RunConfig.from_dict({"trainer": "dpo", "method": "qlora", "lora": {"target_modules": ["q_proj", "v_proj"]},
                               "training": {"learning_rate": "2e-4", "max_steps": 7, "bf16": False},
                               "data": {"columns": {"prompt": "q", "chosen": "a", "rejected": "b"}},
                               "fast": {"checkpointing": "offload", "gguf_quantizations": "Q4_0"}})
    assert cfg.training.learning_rate == 2e-4  # YAML 1.1 reads 2e-4 as a string
    assert cfg.fast.gguf_quantizations == ("q4_0",) and isinstance(cfg.fast, FastConfig)
    again = parse_run_config(cfg.to_yaml())
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert set(cfg.to_dict()) == set(KNOWN_KEYS)


def test_every_fast_config_field_is_in_the_fast_section():
    fast = RunConfig().to_dict()["fast"]
    assert set(fast) == {f.name for f in dataclasses.fields(FastConfig)}
    helps = field_help()
    assert all(helps[f"fast.{name}"] for name in fast)
    assert all(text.strip() for text in helps.values())


@pytest.mark.parametrize("data, expected", [
    ({"trainer": "ppo"}, "trainer: 'ppo' is not one of sft, dpo"),
    ({"method": "dora"}, "method: 'dora' is not one of lora, qlora, full"),
    ({"training": {"lr_scheduler_type": "fancy"}}, "training.lr_scheduler_type: 'fancy' is not one of linear, cosine"),
    ({"training": {"bf16": "yes"}}, "training.bf16: 'yes' is not one of auto, true, false"),
    ({"training": {"max_steps": 2.5}}, "training.max_steps: expected an integer, got 2.5"),
    ({"training": {"learning_rate": "fast"}}, "training.learning_rate: expected a number, got 'fast'"),
    ({"training": {"learning_rate": 0}}, "training.learning_rate: must be > 0"),
    ({"training": {"per_device_train_batch_size": 0}}, "training.per_device_train_batch_size: must be >= 1"),
    ({"lora": {"alpha": 0}}, "lora.alpha: must be > 0"),
    ({"lora": {"target_modules": []}}, "lora.target_modules: expected 'all-linear' or a non-empty list"),
    ({"model": "gpt2"}, "model: expected a mapping of base, revision, dtype"),
    ({"lora": {"dropout": 1}}, "lora.dropout: must be < 1"),
    ({"fast": {"checkpointing": "sometimes"}},
     "fast.checkpointing: 'sometimes' is not one of recompute, offload, auto"),
    ({"fast": {"export_artifacts": ["onnx"]}}, "fast.export_artifacts: 'onnx' is not one of adapter, merged, gguf"),
    ({"fast": {"push_to_hub": True}}, "fast.push_to_hub=True needs hub_model_id"),
    ({"fast": {"rms_norm": "off"}}, "fast.rms_norm: expected true or false"),
    ({"data": {"columns": {"prompt": "q"}}}, "data.columns: roles prompt are not a sft format; give "
                                             "prompt+completion or messages or text"),
    ({"data": {"columns": {"question": "q"}}}, "data.columns: 'question' is not a sft role"),
    ({"trainer": "dpo", "data": {"columns": {"prompt": "p", "completion": "c"}}},
     "data.columns: 'completion' is not a dpo role; one of chosen, prompt, rejected"),
    ({"method": "full", "fast": {"export_artifacts": ["adapter"]}}, "'adapter' needs method lora or qlora"),
])
def test_errors_name_the_field_and_the_allowed_values(data, expected):
    errors = _errors(data)
    assert any(expected in e for e in errors), errors


def test_unknown_keys_are_rejected_with_the_known_ones_listed():
    errors = _errors({"lr": 1e-4, "training": {"lr": 1e-4}, "fast": {"fused_rope": True}})
    assert "unknown key 'lr'; known keys: model, data, trainer, method, lora, training, fast, run_name" in errors
    assert any(e.startswith("training: unknown key 'lr'; known keys: learning_rate, num_train_epochs") for e in errors)
    assert any(e.startswith("fast: unknown key 'fused_rope'; known keys: cross_entropy, rms_norm") for e in errors)
    assert len(errors) == 3  # every problem at once, not one per attempt


def test_error_message_lists_every_problem_with_its_source(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: ppo\ntraining: {max_steps: many}\n")
    with pytest.raises(RunConfigError) as info:
        load_run_config(path)
    text = str(info.value)
    assert text.startswith(f"invalid run config in {path}:")
    assert "  - trainer: 'ppo' is not one of sft, dpo" in text and "training.max_steps: expected an integer" in text
    path.write_text("trainer: [unclosed\n")
    with pytest.raises(RunConfigError, match="not valid YAML"):
        load_run_config(path)
    with pytest.raises(RunConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml")


def test_overrides_set_nested_fields_as_yaml_values():
    data = apply_overrides({"training": {"max_steps": 5}}, ["training.max_steps=9", "fast.export_artifacts=[merged]",
                                                           "trainer=dpo", "training.bf16=false"])
    assert data == {"training": {"max_steps": 9, "bf16": False}, "fast": {"export_artifacts": ["merged"]},
                    "trainer": "dpo"}
    with pytest.raises(RunConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["training.max_steps"])
    with pytest.raises(RunConfigError, match="'trainer' is not a section"):
        apply_overrides({"trainer": "sft"}, ["trainer.x=1"])


def test_allowed_values_exist_in_the_installed_transformers():
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    assert set(SCHEDULERS) <= {s.value for s in SchedulerType}
    assert set(OPTIMIZERS) <= {o.value for o in OptimizerNames}


@pytest.mark.parametrize("value, expected", [
    ("all-linear", "all-linear"), ("q_proj", ["q_proj"]), (r".*\.(q|v)_proj", r".*\.(q|v)_proj"),
    (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
])
def test_target_modules_bare_name_becomes_a_list(value, expected):
    # PEFT full-matches a string against whole module paths, so "q_proj" alone would match nothing.
    assert RunConfig.from_dict({"lora": {"target_modules": value}}).lora.target_modules == expected


def test_eval_packing_assistant_loss_and_trackers_are_validated():
    from fasttune.run.config import eval_strategy

    cfg = RunConfig.from_dict({"data": {"eval_size": 0.1}, "training": {"report_to": ["tensorboard", "wandb"],
                                                                        "packing": True, "eval_steps": 5}})
    assert eval_strategy(cfg) == "steps" and cfg.training.report_to == ["tensorboard", "wandb"]
    assert RunConfig.from_dict(cfg.to_dict()) == cfg and eval_strategy(RunConfig()) == "no"
    assert RunConfig().training.report_to == "none"
    bad = {
        "training.report_to: expected none, or one or a list of tensorboard, wandb; got 'mlflow'":
            {"training": {"report_to": "mlflow"}},
        "training.report_to: expected none, or one or a list of tensorboard, wandb; got ['none', 'wandb']":
            {"training": {"report_to": ["none", "wandb"]}},
        "training.packing: SFT only (trainer is dpo)": {"trainer": "dpo", "training": {"packing": True}},
        "training.eval_strategy: 'steps' needs eval data (data.eval_dataset, data.eval_split or data.eval_size)":
            {"training": {"eval_strategy": "steps"}},
        "data.eval_size: a share must be < 1 and a row count whole, got 2.5": {"data": {"eval_size": 2.5}},
        "data.eval_size: give eval_dataset or eval_size, not both": {"data": {"eval_dataset": "embedded",
                                                                                "eval_size": 3}},
        "training.assistant_only_loss: needs chat data (data.columns.messages); prompt/completion data already "
        "trains on the completion only": {"training": {"assistant_only_loss": True},
                                          "data": {"columns": {"prompt": "p", "completion": "c"}}},
        "training.packing_strategy: 'best' is not one of bfd, bfd_split, wrapped":
            {"training": {"packing_strategy": "best"}},
    }
    for message, data in bad.items():
        with pytest.raises(RunConfigError) as info:
            RunConfig.from_dict(data)
        assert info.value.errors == [message]
