"""Card facts from a finished Trainer: method, hyperparameters as rows, held-out loss."""

from types import SimpleNamespace

from peft import LoraConfig
from transformers import TrainingArguments

from fasttune.export.base_license import BaseLicense
from fasttune.export.card_facts import CardFacts, eval_from_history, facts_from_trainer, fmt, lora_rows, training_rows


def test_rows_from_lora_and_training_arguments(tmp_path):
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["v_proj", "q_proj"])
    assert lora_rows({"default": lora}) == [("LoRA rank (r)", "8"), ("LoRA alpha", "16"), ("LoRA dropout", "0.05"),
                                            ("LoRA target modules", "q_proj, v_proj")]
    assert lora_rows(None) == [] and lora_rows({}) == []
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, max_steps=50, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, report_to=[], use_cpu=True, seed=7)
    rows = dict(training_rows(args))
    assert rows["learning rate"] == "0.0003" and rows["max steps"] == "50" and "epochs" not in rows
    assert rows["effective batch size"] == "8" and rows["scheduler"] == "linear" and rows["seed"] == "7"
    assert fmt(0.1) == "0.1" and fmt(("a", "b")) == "a, b" and fmt({"b", "a"}) == "a, b"


def test_held_out_loss_is_the_last_one_logged():
    history = [{"loss": 2.0, "step": 5}, {"eval_loss": 1.91234, "step": 5}, {"eval_loss": 1.5, "step": 10},
               {"train_loss": 1.7, "step": 10}]
    assert eval_from_history(history) == [{"metric": "eval loss", "value": "1.5",
                                           "detail": "mean loss on the evaluation split, step 10"}]
    assert eval_from_history([{"loss": 1.0}]) == [] and eval_from_history(None) == []


def test_facts_of_a_trainer():
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    trainer = SimpleNamespace(model=SimpleNamespace(peft_config={"default": lora}),
                              args=SimpleNamespace(learning_rate=1e-3, max_steps=3, per_device_train_batch_size=2,
                                                   dataset_name="org/data"),
                              state=SimpleNamespace(log_history=[{"eval_loss": 0.5, "step": 3}]))
    facts = facts_from_trainer(trainer, "org/base", license=BaseLicense("mit", source="s"), stats={"global_step": 3})
    assert facts.method == "LoRA, SimpleNamespace" and facts.datasets == ["org/data"] and facts.dataset_note is None
    assert ("LoRA rank (r)", "4") in facts.hyperparameters and ("learning rate", "0.001") in facts.hyperparameters
    ctx = facts.context()
    assert ctx["license"] == "mit (s)" and ctx["license_meta"] == {"license": "mit"}
    assert ctx["evaluation"][0]["value"] == "0.5" and ctx["base_model_id"] == "org/base"
    full = facts_from_trainer(SimpleNamespace(model=SimpleNamespace(), args=SimpleNamespace(),
                                              state=SimpleNamespace(log_history=[])), None, "a local folder")
    assert full.method.startswith("full fine-tuning") and full.dataset_note == "not recorded by the trainer"
    assert CardFacts().context()["license"].startswith("unknown")
