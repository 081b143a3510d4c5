"""Bad input at the Python API gets an error that names the argument, as the CLI's does.

FastConfig's own field checks are in test_config.py; the head's token-id error and all-ignored
warning in model_patches/test_head.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from fasttune import FastConfig, FastTrainer, patch_model, unpatch_model
from fasttune.embedded import PadCollator
from helpers.tiny_models import tiny_model
from helpers.train_data import random_lm_rows

VOCAB = 1000


def _args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


# -- fast_config= of the trainers ----------------------------------------------------------------
def test_fast_trainer_takes_a_dict_of_fields(tmp_path):
    trainer = FastTrainer(model=tiny_model("llama", vocab_size=VOCAB), args=_args(tmp_path),
                          train_dataset=random_lm_rows(VOCAB, n=4), data_collator=PadCollator(0),
                          fast_config={"rope": False, "log_throughput": False})
    assert trainer.fast_config == FastConfig(rope=False, log_throughput=False)
    assert trainer.patch_report.patched["rope"] == 0 and trainer.patch_report.patched["cross_entropy"] == 1


@pytest.mark.parametrize("value, error, match", [
    ({"checkpointin": "offload"}, ValueError, r"fast_config: unknown FastConfig field\(s\) \['checkpointin'\]"),
    ({"rms_norm": "no"}, TypeError, "fast_config: rms_norm must be True or False, got 'no'"),
    ("offload", TypeError, "fast_config must be a FastConfig, a dict of FastConfig fields or None, got str"),
])
def test_fast_trainer_rejects_bad_fast_config(tmp_path, value, error, match):
    with pytest.raises(error, match=match):
        FastTrainer(model=tiny_model("llama", vocab_size=VOCAB), args=_args(tmp_path), fast_config=value)


def test_trl_trainers_take_a_dict_and_reject_other_types(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from fasttune.embedded import build_model, build_tokenizer, make_task
    from fasttune.hf_integration.trl import FastDPOTrainer, FastSFTTrainer

    tok = build_tokenizer()
    # HF's checkpointing off: ``activation_checkpointing`` in transformers 5.24, ``gradient_checkpointing`` in 5.17.
    names = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    no_hf_checkpointing = {"activation_checkpointing" if "activation_checkpointing" in names
                           else "gradient_checkpointing": False}
    cfg = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=32,
                        disable_tqdm=True, dataloader_num_workers=0, **no_hf_checkpointing)
    trainer = FastSFTTrainer(model=build_model(tok, hidden_size=64), args=cfg, processing_class=tok,
                             train_dataset=Dataset.from_list(make_task(4)), fast_config={"mlp": False})
    assert trainer.fast_config == FastConfig(mlp=False)
    # Checked before TRL's __init__ runs: nothing else is needed to see the error.
    with pytest.raises(TypeError, match="fast_config must be a FastConfig"):
        FastSFTTrainer(model=None, args=cfg, fast_config=["mlp"])
    with pytest.raises(ValueError, match=r"fast_config: unknown FastConfig field\(s\) \['mpl'\]"):
        FastDPOTrainer(model=None, args=trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                       bf16=False), fast_config={"mpl": False})


# -- patch_model / unpatch_model -----------------------------------------------------------------
@pytest.mark.parametrize("fn", [patch_model, unpatch_model])
def test_patch_model_names_model(fn):
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module .* got str .*from_pretrained\('llama'\)"):
        fn("llama")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fn({"model_type": "llama"})


def test_patch_model_config_dict_or_error():
    model = tiny_model("llama", vocab_size=VOCAB)
    assert patch_model(model, {"rope": False}).patched["rope"] == 0
    with pytest.raises(TypeError, match="config must be a FastConfig"):
        patch_model(model, "offload")
    with pytest.raises(ValueError, match=r"config: unknown FastConfig field\(s\) \['rop'\]"):
        patch_model(model, {"rop": False})


def test_callback_takes_a_dict_and_rejects_other_types():
    from fasttune import FastPatchCallback

    assert FastPatchCallback({"rope": False}).config.rope is False
    with pytest.raises(TypeError, match="config must be a FastConfig"):
        FastPatchCallback("offload")
    with pytest.raises(ValueError, match=r"config: unknown FastConfig field\(s\) \['rop'\]"):
        FastPatchCallback({"rop": False})


# -- save_merged's output path -------------------------------------------------------------------
@pytest.fixture
def no_merge(monkeypatch):
    """Any merge work at all fails the test: a bad path must be refused before it."""
    from fasttune.export import merged

    def refuse(*_a, **_k):
        raise AssertionError("merge work started before the output path was checked")

    monkeypatch.setattr(merged, "model_weights", refuse)


def test_save_merged_onto_an_existing_file(tmp_path, no_merge):
    from fasttune import save_merged

    target = tmp_path / "merged.safetensors"
    target.write_bytes(b"keep me")
    with pytest.raises(ValueError, match=f"out_dir: {target} is an existing file, not a folder"):
        save_merged(tiny_model("llama", vocab_size=VOCAB), target)
    assert target.read_bytes() == b"keep me"


def _unwritable_dirs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = [(blocker / "merged", "Not a directory")]
    if Path("/proc/self").is_dir():
        cases.append((Path("/proc/fasttune-test/merged"), "No such file or directory"))
    if os.geteuid() != 0:  # root writes into read-only folders
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        cases.append((ro / "merged", "Permission denied"))
    return cases


def test_save_merged_into_an_unwritable_folder(tmp_path, no_merge):
    from fasttune import save_merged

    model = tiny_model("llama", vocab_size=VOCAB)
    for out, reason in _unwritable_dirs(tmp_path):
        with pytest.raises(ValueError, match=f"out_dir: cannot write to the folder {out}: {reason}.*nothing was written"):
            save_merged(model, out)
        assert not out.exists()


def test_save_merged_still_writes_into_a_fresh_or_existing_folder(tmp_path):
    from fasttune import save_merged

    model = tiny_model("llama", vocab_size=VOCAB)
    for out in (tmp_path / "new" / "merged", tmp_path):
        save_merged(model, out, dtype=torch.float32)
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no probe or staging left
