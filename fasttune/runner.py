"""Train from a run config, and export or push a finished run from its folder.

``train(cfg, run_dir)`` loads the base model (Hub id, local folder or the embedded one) with
``hf_integration.loader.load_model`` (NF4 for QLoRA, LoRA attached, patched), builds TRL's SFT or
DPO trainer on fasttune's kernels (``FastSFTTrainer``/``FastDPOTrainer``, else the TRL trainer
with ``FastPatchCallback``) and runs it; export and push then run from the run folder.
The run folder then holds everything ``export_run``/``push_run`` (and the Space) need later::

    run_config.yaml   fast_config.json   state.json        log_history.jsonl   train.log
    trainer_state.json   metrics.json   final/ (adapter or full model + tokenizer)
    base/ (the embedded base model, when used)   adapter/ merged/ gguf/ (exports)

``state.json`` is the live status (written atomically at every log step): status (starting,
running, exporting, completed, failed, stopped), step / max_steps, the loss curve, the error, the
pushed repos' URLs. SIGTERM or SIGINT stops a run cleanly: the current step finishes, the model so
far is saved under ``final/``, nothing is exported or pushed and the status becomes "stopped".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .run_config import EMBEDDED, RunConfig, classify_dataset, classify_model, load_run_config

logger = logging.getLogger("fasttune.runner")

STATE_FILE = "state.json"
TERMINAL = ("completed", "failed", "stopped")


# --- state.json ------------------------------------------------------------------------------

def _is_main_process() -> bool:
    """Rank 0 under torchrun/accelerate (RANK set by the launcher), or a single process."""
    return os.environ.get("RANK", "0") in ("0", "")


def _state_name() -> str:
    # Other ranks of a distributed run keep their own file: state.json is rank 0's alone.
    return STATE_FILE if _is_main_process() else f".state.rank{os.environ['RANK']}.json"


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """The run's state.json ({} when there is none yet)."""
    try:
        return json.loads((Path(run_dir) / _state_name()).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(run_dir: str | Path, **updates: Any) -> dict[str, Any]:
    """Merges ``updates`` into state.json (atomic replace; readers never see half a file)."""
    run_dir = Path(run_dir)
    state = read_state(run_dir)
    state.update(updates, updated_at=time.time())
    name = _state_name()
    tmp = run_dir / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    os.replace(tmp, run_dir / name)
    return state


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived outside the training loop (while loading or exporting)."""


class StopSignal:
    """SIGTERM/SIGINT → stop at the end of the current step (inside the loop) or right away."""

    def __init__(self) -> None:
        self.requested = False
        self.in_loop = False
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.requested = True
        logger.warning("fasttune: signal %d received, stopping the run", signum)
        if not self.in_loop:
            raise StopRequested()


def _state_callback(run_dir: Path, stop: StopSignal):
    from transformers import TrainerCallback

    class RunStateCallback(TrainerCallback):
        """Writes log_history.jsonl and state.json at each log step; honours a stop request."""

        def on_train_begin(self, args, state, control, **kw):
            stop.in_loop = True
            write_state(run_dir, status="running", step=0, max_steps=state.max_steps)

        def on_log(self, args, state, control, logs=None, **kw):
            if not _is_main_process():
                return
            logs = dict(logs or {}, step=state.global_step)
            with open(run_dir / "log_history.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(logs) + "\n")
            curve = read_state(run_dir).get("loss", [])
            if "loss" in logs:
                curve.append([state.global_step, float(logs["loss"])])
            write_state(run_dir, step=state.global_step, max_steps=state.max_steps, epoch=state.epoch,
                        loss=curve, last_log={k: v for k, v in logs.items() if isinstance(v, (int, float))})

        def on_step_end(self, args, state, control, **kw):
            if stop.requested:
                control.should_training_stop = True
            return control

    return RunStateCallback()


# --- loading ----------------------------------------------------------------------------------

def _dtype(name: str):
    import torch

    if name == "auto":
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    return getattr(torch, name)


def _base_path(cfg: RunConfig, run_dir: Path) -> str:
    """Where the base weights load from; the embedded model is built and saved under run_dir/base."""
    if classify_model(cfg.model.base) != EMBEDDED:
        return cfg.model.base
    base = run_dir / "base"
    if not (base / "config.json").exists():
        from . import embedded

        tok = embedded.build_tokenizer()
        embedded.build_model(tok, seed=cfg.training.seed).save_pretrained(str(base))
        tok.save_pretrained(str(base))
    return str(base)


def load_model(cfg: RunConfig, run_dir: Path):
    """(model, tokenizer) to train: ``hf_integration.loader.load_model`` on the base (NF4 for QLoRA,
    LoRA attached for lora/qlora, patched; its errors say what is wrong with the source)."""
    import dataclasses

    from .hf_integration.loader import LoraSpec
    from .hf_integration.loader import load_model as load

    lora = None
    if cfg.method != "full":
        targets = cfg.lora.target_modules
        lora = LoraSpec(r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, seed=cfg.training.seed,
                        target_modules=targets if isinstance(targets, str) else tuple(targets))
    embedded = classify_model(cfg.model.base) == EMBEDDED
    return load(_base_path(cfg, run_dir), load_in_4bit=cfg.method == "qlora", dtype=cfg.model.dtype, lora=lora,
                # the embedded model declares a 64-token context; its rows are far shorter than max_length
                max_seq_length=None if embedded else cfg.training.max_length, revision=cfg.model.revision,
                fast_config=dataclasses.replace(cfg.fast, export_artifacts=(), push_to_hub=False))


def _load_base(cfg: RunConfig, run_dir: Path):
    """The 16-bit base of a run (also for QLoRA: a clean merge), unpatched, on the CPU."""
    from transformers import AutoModelForCausalLM

    path = _base_path(cfg, run_dir)
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
        from .hf_integration import trl as fast_trl

        fast_cls = getattr(fast_trl, name, None)
    except ImportError:
        fast_cls = None
    if fast_cls is not None:
        return fast_cls(**common, callbacks=callbacks, fast_config=fast)
    from .hf_integration.callback import FastPatchCallback

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
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if _is_main_process():
        (run_dir / "run_config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        (run_dir / "fast_config.json").write_text(json.dumps(cfg.fast.to_dict(), indent=2), encoding="utf-8")
        (run_dir / "log_history.jsonl").write_text("", encoding="utf-8")
    write_state(run_dir, status="starting", pid=os.getpid(), started_at=time.time(), finished_at=None, step=0,
                max_steps=cfg.training.max_steps, loss=[], error=None, urls={}, artifacts={}, metrics={},
                run_name=cfg.run_name or run_dir.name, trainer=cfg.trainer, method=cfg.method)
    handler = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    stop = StopSignal().install()
    try:
        _run(cfg, run_dir, stop)
        status = "stopped" if stop.requested else "completed"
        return write_state(run_dir, status=status, finished_at=time.time())
    except StopRequested:
        logger.warning("run stopped before training finished")
        return write_state(run_dir, status="stopped", finished_at=time.time())
    except BaseException as e:  # noqa: BLE001 - recorded for the Space, then re-raised
        logger.error("run failed:\n%s", traceback.format_exc())
        write_state(run_dir, status="failed", finished_at=time.time(), error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        stop.uninstall()
        logging.getLogger().removeHandler(handler)
        handler.close()


def _run(cfg: RunConfig, run_dir: Path, stop: StopSignal):
    from transformers import set_seed

    from .run_data import load_train_dataset

    set_seed(cfg.training.seed)
    dataset = load_train_dataset(cfg)  # before the model: a data problem fails in seconds
    model, tok = load_model(cfg, run_dir)
    logger.info("training %s (%s, %s) on %d rows of %s", cfg.model.base, cfg.trainer, cfg.method, len(dataset),
                cfg.data.dataset)
    trainer = build_trainer(cfg, model, tok, dataset, training_args(cfg, run_dir), [_state_callback(run_dir, stop)])
    result = trainer.train()
    stop.in_loop = False
    trainer.save_model(str(run_dir / "final"))
    tok.save_pretrained(str(run_dir / "final"))
    trainer.state.save_to_json(str(run_dir / "trainer_state.json"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = {"global_step": trainer.state.global_step, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "train_loss": result.metrics.get("train_loss"),
               "train_runtime": result.metrics.get("train_runtime"), "stopped": stop.requested,
               "trainer_class": type(trainer).__name__, **_patch_summary(trainer)}
    if cfg.trainer == "sft" and cfg.data.dataset == EMBEDDED and not stop.requested:
        from .embedded import exact_match, make_task

        metrics["exact_match"] = exact_match(trainer.model, tok, make_task(64, seed=cfg.training.seed + 10_000))
    write_state(run_dir, metrics=metrics, step=trainer.state.global_step)
    if not _is_main_process():
        return  # files, export and Hub work are rank 0's
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    if stop.requested or not (cfg.fast.export_artifacts or cfg.fast.push_to_hub):
        return
    # Export and push from the run folder, as `fasttune export/push` do: the adapter goes onto a
    # freshly loaded 16-bit base, so a QLoRA run merges cleanly instead of from dequantised NF4.
    del trainer, model
    _free_memory()
    write_state(run_dir, status="exporting")
    _export_and_push(cfg, run_dir)


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _export_and_push(cfg: RunConfig, run_dir: Path) -> None:
    from .hf_integration.hub import HubPushError

    fast = cfg.fast
    pushed = set(fast.push_artifacts) if fast.push_to_hub else set()
    local_only = [a for a in fast.export_artifacts if a not in pushed]  # push_run saves its own first
    if local_only:
        export_run(run_dir, local_only)
    if fast.push_to_hub:
        try:
            push_run(run_dir)
        except HubPushError as e:  # the trained model is saved: only the upload needs a retry
            raise HubPushError(f"{e} Retry with: fasttune push {run_dir}", e.status_code, e.output_dir) from None


def _hub_base_id(cfg: RunConfig) -> str | None:
    if cfg.fast.base_model_id:
        return cfg.fast.base_model_id
    return cfg.model.base if classify_model(cfg.model.base) == "hub" else None


# --- a finished run -----------------------------------------------------------------------------

def load_run(run_dir: str | Path):
    """(cfg, model, tokenizer) of a finished run: the full model, or the adapter on its 16-bit base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(run_dir)
    final = run_dir / "final"
    if not (run_dir / "run_config.yaml").is_file() or not final.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a finished fasttune run (needs run_config.yaml and final/)")
    cfg = load_run_config(run_dir / "run_config.yaml")
    tok = AutoTokenizer.from_pretrained(str(final))
    dtype = _dtype(cfg.model.dtype)
    if (final / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(_load_base(cfg, run_dir), str(final))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(final), dtype=dtype)
    return cfg, model, tok


def _run_stats(run_dir: Path) -> dict[str, Any] | None:
    from .hf_integration.hub import run_stats_from_state

    path = run_dir / "trainer_state.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return run_stats_from_state(SimpleNamespace(log_history=data.get("log_history", []),
                                                global_step=data.get("global_step")))


def usable_artifacts(wanted, model) -> tuple[str, ...]:
    """``wanted`` without "adapter" when the model has no LoRA adapter (a full fine-tune)."""
    from peft import PeftModel

    return tuple(a for a in wanted if a != "adapter" or isinstance(model, PeftModel))


def export_run(run_dir: str | Path, artifacts=None, gguf_quantizations=None, merged_dtype=None) -> dict[str, str]:
    """Saves adapter / merged / GGUF files of a finished run under ``run_dir``; returns kind → folder."""
    from .hf_integration.hub import export_artifacts, write_cards

    run_dir = Path(run_dir)
    cfg, model, tok = load_run(run_dir)
    artifacts = tuple(artifacts or usable_artifacts(cfg.fast.export_artifacts or ("adapter", "merged", "gguf"),
                                                    model))
    repo = cfg.fast.hub_model_id
    name = (repo or cfg.run_name or run_dir.resolve().name).split("/")[-1]
    folders = export_artifacts(model, tok, run_dir, artifacts, name=name,
                               gguf_quantizations=gguf_quantizations or cfg.fast.gguf_quantizations,
                               merged_dtype=merged_dtype or cfg.fast.merged_dtype, base_model_id=_hub_base_id(cfg))
    if repo and "/" in repo:
        repos = {"adapter": f"{repo}-lora", "merged": repo, "gguf": f"{repo}-GGUF"}
        write_cards(folders, {k: repos[k] for k in folders}, tokenizer=tok, run_stats=_run_stats(run_dir),
                    fast_config=cfg.fast, base_model_id=_hub_base_id(cfg), datasets=_datasets(cfg),
                    lora=hasattr(model, "peft_config"))
    out = {k: str(v) for k, v in folders.items()}
    write_state(run_dir, artifacts={**read_state(run_dir).get("artifacts", {}), **out})
    return out


def _datasets(cfg: RunConfig) -> list[str]:
    return [cfg.data.dataset] if classify_dataset(cfg.data.dataset) == "hub" else []


def push_run(run_dir: str | Path, repo_id: str | None = None, artifacts=None, private: bool | None = None,
             token: str | None = None, gguf_quantizations=None) -> dict[str, str]:
    """Exports and uploads a finished run (``hub.push_to_hub``); returns kind → repo URL."""
    from .hf_integration.hub import push_to_hub

    run_dir = Path(run_dir)
    cfg, model, tok = load_run(run_dir)
    repo_id = repo_id or cfg.fast.hub_model_id
    if not repo_id:
        raise ValueError("repo_id: give --repo-id (the run config has no fast.hub_model_id)")
    artifacts = tuple(artifacts or usable_artifacts(cfg.fast.push_artifacts, model))
    urls = push_to_hub(model, tok, repo_id, artifacts=artifacts,
                       gguf_quantizations=gguf_quantizations or cfg.fast.gguf_quantizations,
                       private=cfg.fast.hub_private if private is None else private,
                       base_model_id=_hub_base_id(cfg), token=token, run_stats=_run_stats(run_dir),
                       output_dir=run_dir, fast_config=cfg.fast, datasets=_datasets(cfg),
                       merged_dtype=cfg.fast.merged_dtype)
    state = read_state(run_dir)
    write_state(run_dir, urls={**state.get("urls", {}), **urls},
                artifacts={**state.get("artifacts", {}), **{k: str(run_dir / k) for k in urls}})
    return urls
