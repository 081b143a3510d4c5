"""The runner: trainer arguments, a failed and a stopped run, export from a run folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fasttune.run import runner
from fasttune.run.config import RunConfig, load_run_config
from fasttune.run.folder import read_state

ROOT = Path(__file__).resolve().parents[2]


def test_training_args_map_the_training_section(tmp_path):
    from trl import DPOConfig, SFTConfig

    cfg = RunConfig.from_dict({"training": {"warmup": 0.1, "max_steps": 9, "bf16": "auto", "optim": "adamw_torch",
                                            "lr_scheduler_type": "cosine", "save_strategy": "steps", "save_steps": 3}})
    args = runner.training_args(cfg, tmp_path)
    assert isinstance(args, SFTConfig) and args.max_steps == 9 and args.save_steps == 3
    assert args.output_dir == str(tmp_path) and args.report_to == [] and args.max_length == 1024
    assert args.bf16 == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert args.use_cpu == (not torch.cuda.is_available()) and not args.gradient_checkpointing
    assert args.get_warmup_steps(100) == 10  # a fraction of the run
    cfg = RunConfig.from_dict({"trainer": "dpo", "training": {"warmup": 5, "beta": 0.3, "bf16": False}})
    args = runner.training_args(cfg, tmp_path)
    assert isinstance(args, DPOConfig) and args.beta == 0.3 and args.get_warmup_steps(100) == 5 and not args.bf16


def test_a_data_problem_fails_the_run_before_the_model_loads(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    cfg = RunConfig.from_dict({"data": {"dataset": str(data), "columns": {"prompt": "q", "completion": "answer"}}})
    with pytest.raises(ValueError, match="column 'answer' is not in the dataset"):
        runner.train(cfg, tmp_path / "run")
    state = read_state(tmp_path / "run")
    assert state["status"] == "failed" and "column 'answer'" in state["error"]
    assert not (tmp_path / "run" / "base").exists()  # the model was never built
    assert "column 'answer'" in (tmp_path / "run" / "train.log").read_text()
    assert load_run_config(tmp_path / "run" / "run_config.yaml") == cfg


@pytest.fixture(scope="module")
def stopped_dpo_run(tmp_path_factory):
    """examples/configs/dpo_embedded.yaml in a `fasttune train` process, stopped by SIGTERM mid-run."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU reference path
    cmd = [sys.executable, "-m", "fasttune.cli", "train", str(ROOT / "examples" / "configs" / "dpo_embedded.yaml"),
           "--run-dir", str(run_dir), "--set", "training.max_steps=500", "--set", "training.logging_steps=1",
           "--set", "training.per_device_train_batch_size=4"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if read_state(run_dir).get("step", 0) >= 2:
                break
            time.sleep(0.3)
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir, proc.returncode, out


@pytest.mark.slow
def test_sigterm_stops_a_dpo_run_cleanly(stopped_dpo_run):
    run_dir, code, out = stopped_dpo_run
    assert code == 3, out[-4000:]
    state = read_state(run_dir)
    assert state["status"] == "stopped" and 2 <= state["step"] < 500
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stopped"] is True and metrics["trainer_class"] in ("FastDPOTrainer", "DPOTrainer")
    assert metrics["patched"].get("cross_entropy", 0) >= 1
    assert (run_dir / "final" / "adapter_config.json").is_file()
    assert not (run_dir / "adapter").exists()  # a stopped run exports nothing
    logs = [json.loads(x) for x in (run_dir / "log_history.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in x for x in logs)
    assert "run stopped" in out


@pytest.mark.slow
def test_export_from_a_run_folder_matches_the_adapter(stopped_dpo_run):
    run_dir = stopped_dpo_run[0]
    folders = runner.export_run(run_dir, ["merged"], merged_dtype="float32")
    assert folders == {"merged": str(run_dir / "merged")}
    assert read_state(run_dir)["artifacts"]["merged"] == str(run_dir / "merged")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, model, tok = runner.load_run(run_dir)
    assert isinstance(model, PeftModel)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)
    ids = tok(["shift: abc = bcd", "shift: xyz = yza"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)  # the adapter did train: the check is not vacuous


def test_training_args_carry_eval_packing_assistant_loss_trackers_and_a_progress_bar(tmp_path):
    cfg = RunConfig.from_dict({"data": {"eval_size": 0.1}, "training": {
        "eval_steps": 7, "packing": True, "packing_strategy": "wrapped", "report_to": "tensorboard",
        "per_device_train_batch_size": 3}})
    args = runner.training_args(cfg, tmp_path)
    assert args.eval_strategy == "steps" and args.eval_steps == 7 and args.per_device_eval_batch_size == 3
    assert args.packing and args.packing_strategy == "wrapped" and args.report_to == ["tensorboard"]
    assert not args.disable_tqdm  # a progress bar with an ETA
    cfg = RunConfig.from_dict({"trainer": "dpo", "training": {"eval_steps": 5}})
    args = runner.training_args(cfg, tmp_path)
    assert args.eval_strategy == "no" and args.report_to == [] and not hasattr(args, "assistant_only_loss")


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_fails_in_one_line_and_resume_skips_the_cut_checkpoint(tmp_path, monkeypatch):
    """The issue's trial: the disk fills while the Trainer writes checkpoint-4's optimizer.pt. The
    run must end "failed" with a one-line error naming the checkpoint and the space needed (not
    "running" with no error), and --resume must continue from checkpoint-2, never the cut one."""
    from helpers.full_disk import FullDisk

    from fasttune.run.checkpoints import incomplete_reason
    from fasttune.run.os_errors import RunIOError
    from fasttune.run.rerun import RunFolderError

    cfg = RunConfig.from_dict({"data": {"max_samples": 32}, "lora": {"r": 4, "alpha": 8}, "training": {
        "max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 5e-3, "logging_steps": 1,
        "max_length": 32, "seed": 1, "save_strategy": "steps", "save_steps": 2, "bf16": False}})
    run = tmp_path / "run"
    real_save = torch.save

    def save_until_the_disk_fills(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if str(f).endswith(os.path.join("checkpoint-4", "optimizer.pt")):
            os.truncate(f, os.path.getsize(f) // 2)  # what torch's zip writer leaves on a full disk
            FullDisk(run, free=0).install(monkeypatch)  # and the disk stays full
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    with pytest.raises(RunIOError) as info:
        runner.train(cfg, run)
    line = str(info.value)
    assert line.startswith(f"disk full writing {run / 'checkpoint-4'}: ") and "\n" not in line
    assert "a checkpoint needs about" in line and "`fasttune train --resume`" in line
    state = read_state(run)
    assert state["status"] == "failed" and state["error"] == line and state["phase"] == "training"
    assert not (run / ".state.reserve").exists()  # spent on the failure write
    assert incomplete_reason(run / "checkpoint-4") and incomplete_reason(run / "checkpoint-2") is None
    assert "Traceback" in (run / "train.log").read_text()  # the traceback is kept, off the console
    losses_before = dict(map(tuple, state["loss"]))
    monkeypatch.undo()  # space freed

    with pytest.raises(RunFolderError, match="--resume continues from checkpoint-2"):
        runner.train(cfg, run)  # never silently at step 0 over the checkpoints
    resumed = runner.train(cfg, run, resume=True)
    assert resumed["status"] == "completed" and resumed["resumed_from"] == "checkpoint-2" and resumed["step"] == 4
    assert [s for s, _ in resumed["loss"]] == [1, 2, 3, 4]
    assert dict(map(tuple, resumed["loss"]))[4] == pytest.approx(losses_before[4], rel=1e-6)  # resume is exact
    assert incomplete_reason(run / "checkpoint-4") is None  # saved again, whole


def test_packing_and_assistant_only_loss_reach_trl(tmp_path):
    from fasttune.run.data import load_train_dataset
    from fasttune.run.folder import RunFolder

    def trainer_for(cfg, name):
        folder = RunFolder(tmp_path / name)
        model, tok = runner.load_model(cfg, folder)
        ds = load_train_dataset(cfg)
        return runner.build_trainer(cfg, model, tok, ds, runner.training_args(cfg, folder.path), []), ds, tok

    cfg = RunConfig.from_dict({"data": {"max_samples": 64}, "lora": {"r": 4, "alpha": 8},
                               "training": {"max_length": 64, "packing": True, "bf16": False}})
    trainer, ds, _ = trainer_for(cfg, "pack")
    assert len(trainer.train_dataset) < len(ds) / 2  # 12-22-token rows: several per 64-token sequence
    assert "seq_lengths" in trainer.train_dataset.column_names or "position_ids" in trainer.train_dataset.column_names
    # "attention stays within each row": a packed batch through the patched model, as TRL's compute_loss
    # calls it (use_cache=False), gives each row the logits it has alone
    batch = trainer.data_collator([trainer.train_dataset[0]])
    lengths = trainer.train_dataset[0]["seq_lengths"]
    first, second = lengths[0], lengths[1]
    model = trainer.model.eval()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone = model(input_ids=batch["input_ids"][:, first:first + second], use_cache=False).logits
    assert torch.allclose(packed[:, first:first + second], alone, atol=1e-5)
    words = ["abc", "xyz", "hello", "cab"] * 4
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"shift: {w} ="},
                                                     {"role": "assistant", "content": f" {w[::-1]}"}]}) + "\n"
                            for w in words))
    cfg = RunConfig.from_dict({"data": {"dataset": str(chat)}, "lora": {"r": 4, "alpha": 8},
                               "training": {"max_length": 64, "assistant_only_loss": True, "bf16": False}})
    trainer, _, tok = trainer_for(cfg, "chat")
    row = trainer.train_dataset[0]
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert tok.decode(trained, skip_special_tokens=True) == " cba"  # the answer alone carries the loss
