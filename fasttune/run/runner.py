"""Train from a run config, and export or push a finished run from its folder.

``train(cfg, run_dir)`` loads the base model (Hub id, local folder or the embedded one) with
``hf_integration.loader.load_model`` (NF4 for QLoRA, LoRA attached, patched), builds TRL's SFT or
DPO trainer on fasttune's kernels (``FastSFTTrainer``/``FastDPOTrainer``, else the TRL trainer
with ``FastPatchCallback``) and runs it; export and push then run from the run folder.
The run folder (``folder.py``: its layout and ``state.json``) then holds everything
``export_run``/``push_run`` (and the Space) need later. SIGTERM or SIGINT stops a run cleanly
(``stop.py``): the current step finishes, the model so far is saved under ``final/``, nothing is
exported or pushed and the status becomes "stopped".
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

from .config import RunConfig
from .folder import RunFolder, is_main_process
from .sources import EMBEDDED, classify_model
from .stop import StopRequested, StopSignal

logger = logging.getLogger("fasttune.runner")


# --- loading ----------------------------------------------------------------------------------

def _dtype(name: str):
    import torch

    if name == "auto":
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return getattr(torch, name)


def _base_path(cfg: RunConfig, folder: RunFolder) -> str:
    """Where the base weights load from; the embedded model is built and saved under ``folder.base``."""
    if classify_model(cfg.model.base) != EMBEDDED:
        return cfg.model.base
    base = folder.base
    if not (base / "config.json").exists():
        from .. import embedded

        tok = embedded.build_tokenizer()
        embedded.build_model(tok, seed=cfg.training.seed).save_pretrained(str(base))
        tok.save_pretrained(str(base))
    return str(base)


def load_model(cfg: RunConfig, folder: RunFolder):
    """(model, tokenizer) to train: ``hf_integration.loader.load_model`` on the base (NF4 for QLoRA,
    LoRA attached for lora/qlora, patched; its errors say what is wrong with the source)."""
    import dataclasses

    from ..hf_integration.loader import LoraSpec
    from ..hf_integration.loader import load_model as load

    lora = None
    if cfg.method != "full":
        targets = cfg.lora.target_modules
        lora = LoraSpec(r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, seed=cfg.training.seed,
                        target_modules=targets if isinstance(targets, str) else tuple(targets))
    embedded = classify_model(cfg.model.base) == EMBEDDED
    return load(_base_path(cfg, folder), load_in_4bit=cfg.method == "qlora", dtype=cfg.model.dtype, lora=lora,
                # the embedded model declares a 64-token context; its rows are far shorter than max_length
                max_seq_length=None if embedded else cfg.training.max_length, revision=cfg.model.revision,
                fast_config=dataclasses.replace(cfg.fast, export_artifacts=(), push_to_hub=False))


def _load_base(cfg: RunConfig, folder: RunFolder):
    """The 16-bit base of a run (also for QLoRA: a clean merge), unpatched, on the CPU."""
    from transformers import AutoModelForCausalLM

    path = _base_path(cfg, folder)
    return AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(cfg.model.dtype), revision=cfg.model.revision)


def training_args(cfg: RunConfig, run_dir: Path):
    """TRL's SFTConfig/DPOConfig from the ``training`` section (CPU and bf16 resolved here)."""
    import dataclasses

    import torch

    t = cfg.training
    cls = _trl("DPOConfig" if cfg.trainer == "dpo" else "SFTConfig")
    cuda = torch.cuda.is_available()
    bf16 = (cuda and torch.cuda.is_bf16_supported()) if t.bf16 == "auto" else bool(t.bf16)
    args = dict(output_dir=str(run_dir), learning_rate=t.learning_rate, num_train_epochs=t.num_train_epochs,
                max_steps=t.max_steps, per_device_train_batch_size=t.per_device_train_batch_size,
                gradient_accumulation_steps=t.gradient_accumulation_steps, weight_decay=t.weight_decay,
                lr_scheduler_type=t.lr_scheduler_type, optim=t.optim, max_grad_norm=t.max_grad_norm, seed=t.seed,
                logging_steps=t.logging_steps, save_strategy=t.save_strategy, save_steps=t.save_steps,
                save_total_limit=t.save_total_limit, bf16=bf16, use_cpu=not cuda, report_to=[],
                disable_tqdm=True, dataloader_num_workers=0, max_length=t.max_length,
                run_name=cfg.run_name or run_dir.name,
                # fasttune checkpoints (fast.checkpointing); the Trainer's own flag would wrap layers twice
                gradient_checkpointing=False)
    names = {f.name for f in dataclasses.fields(cls)}
    if t.warmup < 1 and "warmup_ratio" in names:
        args["warmup_ratio"] = t.warmup
    else:
        args["warmup_steps"] = t.warmup if t.warmup < 1 else int(t.warmup)
    if cfg.trainer == "dpo":
        args["beta"] = t.beta
    return cls(**{k: v for k, v in args.items() if k in names})


def _trl(name: str):
    import trl

    return getattr(trl, name)


def build_trainer(cfg: RunConfig, model, tok, dataset, args, callbacks: list):
    """The TRL trainer on fasttune's kernels: FastSFTTrainer / FastDPOTrainer where
    ``hf_integration.trl`` provides them, else TRL's trainer with ``FastPatchCallback``. Export and
    push stay with ``train`` (after the loop, skipped when the run is stopped)."""
    import dataclasses

    fast = dataclasses.replace(cfg.fast, export_artifacts=(), push_to_hub=False)
    common = dict(model=model, args=args, train_dataset=dataset, processing_class=tok)
    name = "FastDPOTrainer" if cfg.trainer == "dpo" else "FastSFTTrainer"
    try:
        from ..hf_integration import trl as fast_trl

        fast_cls = getattr(fast_trl, name, None)
    except ImportError:
        fast_cls = None
    if fast_cls is not None:
        return fast_cls(**common, callbacks=callbacks, fast_config=fast)
    from ..hf_integration.callback import FastPatchCallback

    cls = _trl("DPOTrainer" if cfg.trainer == "dpo" else "SFTTrainer")
    return cls(**common, callbacks=[FastPatchCallback(fast), *callbacks])


def _patch_summary(trainer) -> dict[str, Any]:
    report = getattr(trainer, "patch_report", None)
    if report is None:
        cb = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "FastPatchCallback"), None)
        report = getattr(cb, "report", None)
    if report is None:
        return {"patched": {}, "fallbacks": []}
    return {"patched": dict(report.patched),
            "fallbacks": [f"{f.op} ({f.where}): {f.reason}" for f in report.fallbacks][:20]}


# --- train ------------------------------------------------------------------------------------

def train(cfg: RunConfig, run_dir: str | Path) -> dict[str, Any]:
    """Runs a training job into ``run_dir``; returns the final state (status, metrics, urls)."""
    folder = RunFolder(run_dir)
    folder.start(cfg)
    folder.write_state(status="starting", pid=os.getpid(), started_at=time.time(), finished_at=None, step=0,
                       max_steps=cfg.training.max_steps, loss=[], error=None, urls={}, artifacts={}, metrics={},
                       run_name=cfg.run_name or folder.path.name, trainer=cfg.trainer, method=cfg.method)
    handler = logging.FileHandler(folder.train_log, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    stop = StopSignal().install()
    try:
        _run(cfg, folder, stop)
        status = "stopped" if stop.requested else "completed"
        return folder.write_state(status=status, finished_at=time.time())
    except StopRequested:
        logger.warning("run stopped before training finished")
        return folder.write_state(status="stopped", finished_at=time.time())
    except BaseException as e:  # noqa: BLE001 - recorded for the Space, then re-raised
        logger.error("run failed:\n%s", traceback.format_exc())
        folder.write_state(status="failed", finished_at=time.time(), error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        stop.uninstall()
        logging.getLogger().removeHandler(handler)
        handler.close()


def _run(cfg: RunConfig, folder: RunFolder, stop: StopSignal):
    from transformers import set_seed

    from .data import load_train_dataset
    from .state_callback import RunStateCallback

    set_seed(cfg.training.seed)
    dataset = load_train_dataset(cfg)  # before the model: a data problem fails in seconds
    model, tok = load_model(cfg, folder)
    logger.info("training %s (%s, %s) on %d rows of %s", cfg.model.base, cfg.trainer, cfg.method, len(dataset),
                cfg.data.dataset)
    trainer = build_trainer(cfg, model, tok, dataset, training_args(cfg, folder.path),
                            [RunStateCallback(folder, stop)])
    result = trainer.train()
    stop.in_loop = False
    trainer.save_model(str(folder.final))
    tok.save_pretrained(str(folder.final))
    trainer.state.save_to_json(str(folder.trainer_state))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = {"global_step": trainer.state.global_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "train_loss": result.metrics.get("train_loss"),
               "train_runtime": result.metrics.get("train_runtime"), "stopped": stop.requested,
               "trainer_class": type(trainer).__name__, **_patch_summary(trainer)}
    if cfg.trainer == "sft" and cfg.data.dataset == EMBEDDED and not stop.requested:
        from ..embedded import exact_match, make_task

        metrics["exact_match"] = exact_match(trainer.model, tok, make_task(64, seed=cfg.training.seed + 10_000))
    folder.write_state(metrics=metrics, step=trainer.state.global_step)
    if not is_main_process():
        return  # files, export and Hub work are rank 0's
    folder.write_metrics(metrics)
    if stop.requested or not (cfg.fast.export_artifacts or cfg.fast.push_to_hub):
        return
    # Export and push from the run folder, as `fasttune export/push` do: the adapter goes onto a
    # freshly loaded 16-bit base, so a QLoRA run merges cleanly instead of from dequantised NF4.
    del trainer, model
    _free_memory()
    folder.write_state(status="exporting")
    _export_and_push(cfg, folder)


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _export_and_push(cfg: RunConfig, folder: RunFolder) -> None:
    from ..export.hub import HubPushError

    fast = cfg.fast
    pushed = set(fast.push_artifacts) if fast.push_to_hub else set()
    local_only = [a for a in fast.export_artifacts if a not in pushed]  # push_run saves its own first
    if local_only:
        export_run(folder.path, local_only)
    if fast.push_to_hub:
        try:
            push_run(folder.path)
        except HubPushError as e:  # the trained model is saved: only the upload needs a retry
            raise HubPushError(f"{e} Retry with: fasttune push {folder.path}", e.status_code,
                               e.output_dir) from None


# --- a finished run -----------------------------------------------------------------------------

def load_run(run_dir: str | Path):
    """(cfg, model, tokenizer) of a finished run: the full model, or the adapter on its 16-bit base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = RunFolder(run_dir)
    folder.require_finished()
    cfg = folder.load_config()
    tok = AutoTokenizer.from_pretrained(str(folder.final))
    if (folder.final / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(_load_base(cfg, folder), str(folder.final))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder.final), dtype=_dtype(cfg.model.dtype))
    return cfg, model, tok


def usable_artifacts(wanted, model) -> tuple[str, ...]:
    """``wanted`` without "adapter" when the model has no LoRA adapter (a full fine-tune)."""
    from peft import PeftModel

    return tuple(a for a in wanted if a != "adapter" or isinstance(model, PeftModel))


def export_run(run_dir: str | Path, artifacts=None, gguf_quantizations=None, merged_dtype=None) -> dict[str, str]:
    """Saves adapter / merged / GGUF files of a finished run under ``run_dir``; returns kind → folder."""
    from ..export.artifacts import export_artifacts, hub_repos
    from ..export.cards import write_cards

    folder = RunFolder(run_dir)
    cfg, model, tok = load_run(folder.path)
    artifacts = tuple(artifacts or usable_artifacts(cfg.fast.export_artifacts or ("adapter", "merged", "gguf"),
                                                    model))
    repo = cfg.fast.hub_model_id
    name = (repo or cfg.run_name or folder.path.resolve().name).split("/")[-1]
    folders = export_artifacts(model, tok, folder.path, artifacts, name=name,
                               gguf_quantizations=gguf_quantizations or cfg.fast.gguf_quantizations,
                               merged_dtype=merged_dtype or cfg.fast.merged_dtype, base_model_id=cfg.hub_base_id())
    if repo and "/" in repo:
        write_cards(folders, hub_repos(repo, folders), tokenizer=tok, run_stats=folder.run_stats(),
                    fast_config=cfg.fast, base_model_id=cfg.hub_base_id(), datasets=cfg.hub_datasets(),
                    lora=hasattr(model, "peft_config"))
    out = {k: str(v) for k, v in folders.items()}
    folder.record("artifacts", out)
    return out


def push_run(run_dir: str | Path, repo_id: str | None = None, artifacts=None, private: bool | None = None,
             token: str | None = None, gguf_quantizations=None) -> dict[str, str]:
    """Exports and uploads a finished run (``export.hub.push_to_hub``); returns kind → repo URL."""
    from ..export.hub import push_to_hub

    folder = RunFolder(run_dir)
    cfg, model, tok = load_run(folder.path)
    repo_id = repo_id or cfg.fast.hub_model_id
    if not repo_id:
        raise ValueError("repo_id: give --repo-id (the run config has no fast.hub_model_id)")
    artifacts = tuple(artifacts or usable_artifacts(cfg.fast.push_artifacts, model))
    urls = push_to_hub(model, tok, repo_id, artifacts=artifacts,
                       gguf_quantizations=gguf_quantizations or cfg.fast.gguf_quantizations,
                       private=cfg.fast.hub_private if private is None else private,
                       base_model_id=cfg.hub_base_id(), token=token, run_stats=folder.run_stats(),
                       output_dir=folder.path, fast_config=cfg.fast, datasets=cfg.hub_datasets(),
                       merged_dtype=cfg.fast.merged_dtype)
    folder.record("urls", urls)
    folder.record("artifacts", {k: str(folder.path / k) for k in urls})
    return urls
