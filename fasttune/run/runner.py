"""Train from a run config, and export or push a finished run from its folder.

``train(cfg, run_dir)`` loads the base model (Hub id, local folder or the embedded one) with
``hf_integration.loader.load_model`` (NF4 for QLoRA, LoRA attached, patched), builds TRL's SFT or
DPO trainer on fasttune's kernels (``FastSFTTrainer``/``FastDPOTrainer``, else the TRL trainer
with ``FastPatchCallback``) and runs it; export and push then run from the run folder.
The run folder (``folder.py``: its layout and ``state.json``) then holds everything
``export_run``/``push_run`` (and the Space) need later. SIGTERM or SIGINT stops a run cleanly
(``stop.py``): the current step finishes, the model so far is saved under ``final/``, nothing is
exported or pushed and the status becomes "stopped". A folder that already holds a run is refused
unless the call says ``overwrite`` or ``resume`` (``rerun.py``: resume continues from the newest
complete checkpoint). A failure is recorded in ``state.json`` even on a full disk; OS errors
become one line naming the path and the space needed (``os_errors.py``).
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path
from typing import Any

from .config import RunConfig, eval_strategy
from .data_checks import DataError
from .failure import LogFile, checkpoint_bytes, explain_failure, trace
from .finished import base_path as _base_path
from .finished import load_run, usable_artifacts  # noqa: F401 - the runner's API
from .folder import RunFolder, is_main_process
from .os_errors import RunIOError
from .publish import export_run, push_run  # noqa: F401 - the runner's API
from .sources import EMBEDDED, classify_model
from .stop import StopRequested, StopSignal

logger = logging.getLogger("fasttune.runner")


# --- loading ----------------------------------------------------------------------------------

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
                save_total_limit=t.save_total_limit, bf16=bf16, use_cpu=not cuda,
                report_to=[] if t.report_to == "none" else t.report_to,  # a list, or one name
                disable_tqdm=False, dataloader_num_workers=0, max_length=t.max_length,
                run_name=cfg.run_name or run_dir.name, eval_strategy=eval_strategy(cfg),
                eval_steps=t.eval_steps or t.logging_steps, per_device_eval_batch_size=t.per_device_train_batch_size,
                packing=t.packing, packing_strategy=t.packing_strategy, assistant_only_loss=t.assistant_only_loss,
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


def build_trainer(cfg: RunConfig, model, tok, dataset, args, callbacks: list, eval_dataset=None):
    """The TRL trainer on fasttune's kernels: FastSFTTrainer / FastDPOTrainer where
    ``hf_integration.trl`` provides them, else TRL's trainer with ``FastPatchCallback``. Export and
    push stay with ``train`` (after the loop, skipped when the run is stopped)."""
    import dataclasses

    fast = dataclasses.replace(cfg.fast, export_artifacts=(), push_to_hub=False)
    common = dict(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tok)
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


# --- train ---------------------------------------------------------------------------------------

def train(cfg: RunConfig, run_dir: str | Path, overwrite: bool = False, resume: bool = False) -> dict[str, Any]:
    """Runs a training job into ``run_dir``; returns the final state (status, metrics, urls).

    Args:
        cfg: the run config.
        run_dir: the run folder; one that already holds a run needs ``overwrite`` or ``resume``.
        overwrite: remove the previous run there and start over.
        resume: continue the previous run from its newest complete checkpoint.

    Raises:
        rerun.RunFolderError: the folder cannot be used as asked (nothing was changed).
        os_errors.RunIOError: disk full or another OS error, in one line (the traceback is in train.log).
    """
    from .checkpoints import step_of
    from .liveness import identity
    from .rerun import config_changes, prepare

    folder = RunFolder(run_dir)
    resume_from = prepare(folder, overwrite=overwrite, resume=resume)
    at = step_of(resume_from) if resume_from is not None else 0
    before = folder.read_state() if resume_from is not None else {}
    if resume_from is not None and folder.config_file.is_file():
        changed = config_changes(folder.load_config().to_dict(), cfg.to_dict())
        if changed:
            logger.warning("fasttune: resuming with a changed config: %s", "; ".join(changed))
    folder.start(cfg, resume_step=at if resume_from is not None else None)
    folder.write_state(status="starting", phase="loading data", **identity(), started_at=time.time(),
                       finished_at=None, step=at, max_steps=cfg.training.max_steps, error=None, urls={}, artifacts={},
                       metrics={}, loss=[p for p in before.get("loss", []) if p[0] <= at],
                       eval_loss=[p for p in before.get("eval_loss", []) if p[0] <= at],
                       resumed_from=resume_from.name if resume_from is not None else None,
                       run_name=cfg.run_name or folder.path.name, trainer=cfg.trainer, method=cfg.method)
    handler = LogFile(folder.train_log, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    trace.addHandler(handler)
    stop = StopSignal().install()
    try:
        _run(cfg, folder, stop, resume_from)
        status = "stopped" if stop.requested else "completed"
        return folder.write_state(status=status, phase=None, finished_at=time.time())
    except StopRequested:
        logger.warning("run stopped before training finished")
        return folder.write_state(status="stopped", finished_at=time.time())
    except BaseException as e:  # noqa: BLE001 - recorded for the Space, then re-raised
        line = explain_failure(e, folder)
        if line is None and not isinstance(e, DataError):
            logger.error("run failed:\n%s", traceback.format_exc())
        else:  # a known error: one line on the console, the traceback in train.log only
            trace.error("run failed:\n%s", traceback.format_exc())
            logger.error("run failed: %s", line or e)
        problem = folder.write_state_robustly(status="failed", finished_at=time.time(),
                                              error=(line or f"{type(e).__name__}: {e}")[:2000])
        if problem:
            logger.error("fasttune: %s", problem)
        if line is not None:
            raise RunIOError(line) from e
        raise
    finally:
        stop.uninstall()
        folder.release_reserve()
        logging.getLogger().removeHandler(handler)
        trace.removeHandler(handler)
        handler.close()


def _run(cfg: RunConfig, folder: RunFolder, stop: StopSignal, resume_from: Path | None = None):
    from transformers import set_seed

    from .data import load_eval_dataset, load_train_dataset
    from .state_callback import RunStateCallback

    set_seed(cfg.training.seed)
    # the data before the model: a data problem fails in seconds
    dataset, eval_dataset = load_eval_dataset(cfg, load_train_dataset(cfg))
    folder.write_state(phase="loading model", data_columns=list(dataset.column_names))
    model, tok = load_model(cfg, folder)
    folder.write_state(checkpoint_bytes=checkpoint_bytes(model))
    held_out = f", {len(eval_dataset)} held out for evaluation" if eval_dataset is not None else ""
    logger.info("training %s (%s, %s) on %d rows of %s%s", cfg.model.base, cfg.trainer, cfg.method, len(dataset),
                cfg.data.dataset, held_out)
    trainer = build_trainer(cfg, model, tok, dataset, training_args(cfg, folder.path),
                            [RunStateCallback(folder, stop)], eval_dataset=eval_dataset)
    result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    stop.in_loop = False
    folder.write_state(phase="saving")
    trainer.save_model(str(folder.final))
    tok.save_pretrained(str(folder.final))
    trainer.state.save_to_json(str(folder.trainer_state))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = {"global_step": trainer.state.global_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "train_loss": result.metrics.get("train_loss"),
               "train_runtime": result.metrics.get("train_runtime"), "stopped": stop.requested,
               "trainer_class": type(trainer).__name__, **_patch_summary(trainer)}
    if eval_dataset is not None and not stop.requested:
        metrics["eval_loss"] = _final_eval_loss(trainer)
    if cfg.trainer == "sft" and cfg.data.dataset == EMBEDDED and not stop.requested:
        metrics.update(_held_out_exact_match(trainer.model, tok, dataset))
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
    folder.write_state(status="exporting", phase="exporting")
    _export_and_push(cfg, folder)


def _held_out_exact_match(model, tok, dataset) -> dict[str, Any]:
    """The embedded task's held-out metric: greedy answers to words the run never trained on."""
    from ..embedded import exact_match, held_out_task

    rows = held_out_task([{"prompt": p} for p in dataset["prompt"]])
    return {"exact_match": exact_match(model, tok, rows), "exact_match_rows": len(rows)}


def _final_eval_loss(trainer) -> float | None:
    """The eval loss at the last step: the Trainer's own when it evaluated there, else evaluated now."""
    last = [h for h in trainer.state.log_history if "eval_loss" in h]
    if last and last[-1].get("step") == trainer.state.global_step:
        return last[-1]["eval_loss"]
    return trainer.evaluate().get("eval_loss")


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _export_and_push(cfg: RunConfig, folder: RunFolder) -> None:
    from ..export.hub import HubPushError

    fast = cfg.fast
    wanted = list(fast.export_artifacts)
    if fast.push_to_hub:
        wanted += [a for a in fast.push_artifacts if a not in wanted]
    export_run(folder.path, usable_artifacts(wanted, folder))  # one export; the push uploads it
    if fast.push_to_hub:
        try:
            push_run(folder.path)
        except HubPushError as e:  # the trained model is saved: only the upload needs a retry
            raise HubPushError(f"{e} Retry with: fasttune push {folder.path}", e.status_code,
                               e.output_dir) from None
