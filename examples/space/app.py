"""fasttune Space: fine-tune an LLM from the browser, AutoTrain-style.

Pick a base model and a dataset (Hub ids, an uploaded file, or the embedded defaults that run
offline on a CPU), map the dataset's columns for the trainer (SFT or DPO), set LoRA/QLoRA and the
hyperparameters, choose what to export and push, and start. Training runs as a ``fasttune train``
subprocess (stoppable); logs, progress and the loss curve stream in; runs are kept on disk, so a
restarted Space shows the last run and its result. The form round-trips to the CLI's YAML run
config ("Export YAML" / "Import YAML"), so a run set up here reruns with ``fasttune train``.

Environment: FASTTUNE_SPACE_RUNS (runs folder; default /data/fasttune-runs on a Space with
persistent storage, else ./runs), HF_TOKEN (pushes; a token typed in the form is passed to the
run's process only), HF_HUB_OFFLINE (Hub ids are refused with a clear message),
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gradio as gr
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # jobs.py beside this file

from form import build_config, dict_to_form, form_to_dict, problems_md  # noqa: E402,F401 - the tests use them here
from jobs import Jobs  # noqa: E402
from results import Downloads, result_md  # noqa: E402

from fasttune.run import data as run_data  # noqa: E402
from fasttune.config import ARTIFACTS, GGUF_QUANTIZATIONS, MERGED_DTYPES  # noqa: E402
from fasttune.export.artifacts import hub_id_or_none  # noqa: E402
from fasttune.hub_cards import render_card  # noqa: E402
from fasttune.run.checks import check_sources  # noqa: E402
from fasttune.run.config import (DTYPES, FORMATS, METHODS, OPTIMIZERS, SCHEDULERS, TRAINERS, RunConfig,  # noqa: E402
                                 RunConfigError, field_help, parse_run_config)
from fasttune.run.generate import RunGenerator  # noqa: E402
from fasttune.run.sources import EMBEDDED, classify_dataset, classify_model, hub_offline  # noqa: E402

ROLES = ("prompt", "completion", "messages", "text", "chosen", "rejected")
HELP = field_help()
# On Hugging Face Spaces with persistent storage, /data survives restarts; elsewhere ./runs.
JOBS = Jobs(os.environ.get("FASTTUNE_SPACE_RUNS") or ("/data/fasttune-runs" if os.path.isdir("/data") else "runs"))
DOWNLOADS = Downloads(JOBS.root / "downloads")  # the one folder the app lets Gradio serve
GENERATE = RunGenerator(max_new_tokens=32)


# --- dataset preview ------------------------------------------------------------------------------

def preview(dataset: str, trainer: str, *current_roles):
    """(preview table, message, role dropdown updates) for the dataset field."""
    dataset = (dataset or "").strip()
    roles = {r for fmt in FORMATS[trainer] for r in fmt}
    try:
        kind = classify_dataset(dataset)
        if kind == "hub":
            note = ("HF_HUB_OFFLINE is set: Hub datasets cannot be loaded here; upload a file or use 'embedded'."
                    if hub_offline() else "Hub dataset: its columns are checked when the run loads it.")
            return pd.DataFrame(), note, *[gr.update(visible=r in roles) for r in ROLES]
        rows = run_data.preview_rows(dataset, trainer, 5)
        columns = run_data.available_columns(dataset, trainer)
    except (ValueError, OSError) as e:
        return pd.DataFrame(), f"❌ {e}", *[gr.update(visible=r in roles) for r in ROLES]
    mapping = dict(zip(ROLES, current_roles, strict=True))
    if not any(mapping.get(r) in columns for r in roles):  # nothing mapped yet: detect a format
        try:
            mapping = run_data.resolve_columns(trainer, {}, columns)
        except ValueError:
            mapping = {}
    errors = run_data.column_errors(trainer, {r: c for r, c in mapping.items() if r in roles and c}, columns)
    table = pd.DataFrame([{k: str(v)[:200] for k, v in row.items()} for row in rows])
    msg = problems_md(errors, f"{len(columns)} columns: {', '.join(columns)}")
    updates = [gr.update(choices=[""] + columns, value=mapping.get(r, "") if mapping.get(r) in columns else "",
                         visible=r in roles) for r in ROLES]
    return table, msg, *updates


def model_message(base: str) -> str:
    base = (base or "").strip()
    try:
        kind = classify_model(base)
    except ValueError as e:
        return f"❌ {e}"
    if kind == EMBEDDED:
        return "✅ the embedded model: a small Llama built in-process (no download, trains on a CPU)."
    if kind == "local":
        return f"✅ local folder {base}"
    if hub_offline():
        return (f"❌ `{base}` is a Hub id, but HF_HUB_OFFLINE is set on this machine: it can only be used if it "
                "is already in the local cache. Use a local folder or `embedded`.")
    return f"✅ Hub model `{base}` (downloaded when the run starts)"


# --- model card preview -----------------------------------------------------------------------------

def card_preview(kind: str, paths, values) -> str:
    cfg, problems = build_config(paths, values)
    if cfg is None:
        return problems_md(problems, "")
    repo = cfg.fast.hub_model_id or "your-name/your-model"
    repo = repo if "/" in repo else f"your-name/{repo}"
    repos = {"adapter": f"{repo}-lora", "merged": repo, "gguf": f"{repo}-GGUF"}
    if cfg.method == "full":
        repos.pop("adapter")
    if kind not in repos:
        return f"No {kind} artifact for method {cfg.method}."
    files = [{"file": f"{repo.split('/')[-1]}-{q.upper()}.gguf", "quant": q.upper(), "size": "…"}
             for q in cfg.fast.gguf_quantizations]
    text = render_card(kind, repo_id=repos[kind], repos=repos, base_model_id=hub_id_or_none(cfg.model.base),
                       datasets=[cfg.data.dataset] if classify_dataset(cfg.data.dataset) == "hub" else [],
                       stats={}, fast_config=cfg.fast.to_dict(), gguf_files=files,
                       loss_curve_note="The loss curve and training statistics are filled in after the run.")
    if text.startswith("---\n"):  # show the Hub metadata as YAML, not as Markdown rules and headings
        front, body = text[4:].split("\n---\n", 1)
        text = f"```yaml\n{front}\n```\n{body}"
    return text


# --- run panel ------------------------------------------------------------------------------------

def run_view():
    """(status, progress, loss plot, log, result) of the latest run."""
    state = JOBS.state()
    if not state:
        empty = pd.DataFrame({"step": [], "loss": []})
        return "No run yet.", _progress_html(0, 0, ""), empty, "", ""
    status, step, total = state.get("status", "?"), state.get("step") or 0, state.get("max_steps") or 0
    loss = state.get("loss") or []
    last = f" · loss {loss[-1][1]:.4f}" if loss else ""
    head = f"**{state.get('run_name', Path(state['run_dir']).name)}** · {status}" + (
        f" · step {step}/{total}" if total and total > 0 else f" · step {step}") + last
    plot = pd.DataFrame(loss, columns=["step", "loss"]) if loss else pd.DataFrame({"step": [], "loss": []})
    return head, _progress_html(step, total, status), plot, JOBS.log_tail(), result_md(state, DOWNLOADS)


def try_it(prompt: str) -> str:
    """The latest finished run's greedy answer to ``prompt``."""
    state = JOBS.state()
    if state.get("status") not in ("completed", "stopped"):
        return "Train a model first: the latest run has not finished." if state else "No run yet."
    try:
        answer = GENERATE(state["run_dir"], prompt)
    except (ValueError, FileNotFoundError) as e:
        return f"❌ {e}"
    return answer if answer.strip() else f"(only whitespace: {answer!r}; the model has not learned much yet)"


def _progress_html(step: int, total: int, status: str) -> str:
    frac = min(step / total, 1.0) if total and total > 0 else (1.0 if status == "completed" else 0.0)
    return (f'<div id="run-progress" data-status="{status}" data-step="{step}" data-total="{total}">'
            f'<progress max="1" value="{frac:.3f}" style="width:100%"></progress> {frac:.0%}</div>')


def start_run(paths, values, token: str | None = None) -> str:
    cfg, problems = build_config(paths, values)
    if problems:
        return problems_md(problems, "")
    try:
        run_dir = JOBS.start(cfg, (token or "").strip() or None)
    except RuntimeError as e:
        return f"❌ {e}"
    return f"🚀 started `{run_dir.name}`"


# --- API for scripts and tests (gradio_client) -----------------------------------------------------

def api_validate(config_yaml: str) -> dict:
    """Validate a YAML run config: {"ok": bool, "errors": [...]}."""
    try:
        cfg = parse_run_config(config_yaml)
    except RunConfigError as e:
        return {"ok": False, "errors": e.errors}
    errors = check_sources(cfg)
    return {"ok": not errors, "errors": errors}


def api_start(config_yaml: str) -> dict:
    """Start a run from a YAML run config (uses HF_TOKEN of the app); returns its state."""
    result = api_validate(config_yaml)
    if not result["ok"]:
        return {"status": "invalid", "errors": result["errors"]}
    try:
        run_dir = JOBS.start(parse_run_config(config_yaml))
    except RuntimeError as e:
        return {"status": "busy", "errors": [str(e)]}
    return JOBS.state(run_dir)


def api_stop() -> dict:
    """Stop the active run; returns its state."""
    return JOBS.stop()


def api_state() -> dict:
    """The latest run's state (status, step, loss curve, metrics, urls, run_dir)."""
    return JOBS.state()


# --- layout ---------------------------------------------------------------------------------------

def _num(path: str, label: str, value, **kw):
    return gr.Number(value=value, label=label, info=HELP.get(path), elem_id=path.replace(".", "-"), **kw)


# The form's defaults: the embedded model fully fine-tuned on the embedded task, the recipe of
# examples/configs/sft_embedded.yaml (a random base has nothing for LoRA to adapt). About 200 steps
# take held-out exact match from 0% to above 90% in a minute or two on a 2-core CPU.
DEFAULT_RUN = {"run_name": "shift-sft", "method": "full", "model": {"dtype": "float32"}, "training": {
    "max_steps": 200, "learning_rate": 3e-3, "per_device_train_batch_size": 32, "max_length": 64,
    "logging_steps": 2, "lr_scheduler_type": "cosine", "warmup": 0.05, "seed": 0}}


def build_app() -> gr.Blocks:
    defaults = RunConfig.from_dict(DEFAULT_RUN)
    fields: list[tuple[str, gr.components.Component]] = []

    def add(path, comp):
        fields.append((path, comp))
        return comp

    with gr.Blocks(title="fasttune: fine-tune an LLM") as demo:
        add("*", gr.State({}))
        gr.Markdown("# fasttune · fine-tune an LLM\nSFT or DPO with LoRA, QLoRA or full fine-tuning on fasttune's "
                    "kernels; export adapter / merged / GGUF and push to the Hub. The defaults train the embedded "
                    "model on the embedded task offline, on a CPU, in a minute or two.")
        if hub_offline():
            gr.Markdown("⚠️ **HF_HUB_OFFLINE is set**: Hub models and datasets that are not cached cannot be used.")
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Group():
                    base = add("model.base", gr.Textbox(defaults.model.base, label="Base model",
                                                        info=HELP["model.base"], elem_id="base-model"))
                    model_msg = gr.Markdown(model_message(defaults.model.base), elem_id="model-msg")
                with gr.Group():
                    with gr.Row():
                        dataset = add("data.dataset", gr.Textbox(defaults.data.dataset, label="Dataset", scale=3,
                                                                 info=HELP["data.dataset"], elem_id="dataset"))
                        upload = gr.File(label="…or upload .json/.jsonl/.csv/.parquet", scale=2,
                                         file_types=[".json", ".jsonl", ".csv", ".parquet"], type="filepath",
                                         elem_id="upload")
                    trainer = add("trainer", gr.Radio(list(TRAINERS), value=defaults.trainer, label="Trainer",
                                                      info=HELP["trainer"], elem_id="trainer"))
                    with gr.Row():
                        role_boxes = [add(f"data.columns.{r}", gr.Dropdown(
                            [""], value="", label=f"{r} column", allow_custom_value=True, elem_id=f"col-{r}",
                            visible=r in FORMATS[defaults.trainer][0] or r in ("messages", "text")))
                            for r in ROLES]
                    data_msg = gr.Markdown(elem_id="data-msg")
                    table = gr.Dataframe(label="Preview (first rows)", interactive=False, max_height=220,
                                         elem_id="preview")
                    with gr.Row():  # held-out data: an eval loss during and after training
                        add("data.eval_dataset", gr.Textbox("", label="Eval dataset", info=HELP["data.eval_dataset"],
                                                            elem_id="eval-dataset", scale=2))
                        add("data.eval_split", gr.Textbox("", label="Eval split", info=HELP["data.eval_split"],
                                                          elem_id="eval-split"))
                        add("data.eval_size", _num("data.eval_size", "Hold out for eval", 0))
                        add("training.eval_steps", _num("training.eval_steps", "Eval every (0: logging steps)", 0,
                                                        precision=0))
                with gr.Group():
                    with gr.Row():
                        add("method", gr.Radio(list(METHODS), value=defaults.method, label="Method",
                                               info=HELP["method"], elem_id="method"))
                        add("run_name", gr.Textbox(defaults.run_name, label="Run name", elem_id="run-name"))
                    with gr.Row():
                        add("lora.r", _num("lora.r", "LoRA r", defaults.lora.r, precision=0))
                        add("lora.alpha", _num("lora.alpha", "LoRA alpha", defaults.lora.alpha))
                        add("lora.dropout", _num("lora.dropout", "LoRA dropout", defaults.lora.dropout))
                        add("lora.target_modules", gr.Textbox(defaults.lora.target_modules, label="Target modules",
                                                              info=HELP["lora.target_modules"]))
                with gr.Group():
                    t = defaults.training
                    with gr.Row():
                        add("training.learning_rate", _num("training.learning_rate", "Learning rate", t.learning_rate))
                        add("training.max_steps", _num("training.max_steps", "Max steps", t.max_steps, precision=0))
                        add("training.num_train_epochs", _num("training.num_train_epochs", "Epochs",
                                                              t.num_train_epochs))
                    with gr.Row():
                        add("training.per_device_train_batch_size", _num("training.per_device_train_batch_size",
                                                                         "Batch size", t.per_device_train_batch_size,
                                                                         precision=0))
                        add("training.gradient_accumulation_steps", _num("training.gradient_accumulation_steps",
                                                                         "Gradient accumulation",
                                                                         t.gradient_accumulation_steps, precision=0))
                        add("training.max_length", _num("training.max_length", "Max length", t.max_length,
                                                        precision=0))
                with gr.Accordion("Advanced", open=False):
                    with gr.Row():
                        add("training.warmup", _num("training.warmup", "Warm-up", t.warmup))
                        add("training.weight_decay", _num("training.weight_decay", "Weight decay", t.weight_decay))
                        add("training.max_grad_norm", _num("training.max_grad_norm", "Max grad norm",
                                                           t.max_grad_norm))
                    with gr.Row():
                        add("training.lr_scheduler_type", gr.Dropdown(list(SCHEDULERS), value=t.lr_scheduler_type,
                                                                      label="LR schedule"))
                        add("training.optim", gr.Dropdown(list(OPTIMIZERS), value=t.optim, label="Optimizer"))
                        add("training.bf16", gr.Dropdown(["auto", "true", "false"], value="auto", label="bf16"))
                    with gr.Row():
                        add("training.seed", _num("training.seed", "Seed", t.seed, precision=0))
                        add("training.logging_steps", _num("training.logging_steps", "Logging steps",
                                                           t.logging_steps, precision=0))
                        add("training.beta", _num("training.beta", "DPO beta", t.beta))
                        add("data.max_samples", _num("data.max_samples", "Max samples (0: all)", 0, precision=0))
                        add("fast.checkpointing", gr.Dropdown(["none", "recompute", "offload", "auto"], value="none",
                                                              label="Activation checkpointing",
                                                              info=HELP["fast.checkpointing"]))
                    with gr.Row():
                        add("model.revision", gr.Textbox("", label="Model revision", info=HELP["model.revision"]))
                        add("model.dtype", gr.Dropdown(list(DTYPES), value="auto", label="Model dtype"))
                    with gr.Row():
                        add("data.config_name", gr.Textbox("", label="Dataset config", info=HELP["data.config_name"]))
                        add("data.split", gr.Textbox("train", label="Dataset split"))
                    with gr.Row():
                        add("training.packing", gr.Checkbox(False, label="Packing", info=HELP["training.packing"]))
                        add("training.assistant_only_loss", gr.Checkbox(False, label="Assistant-only loss",
                                                                        info=HELP["training.assistant_only_loss"]))
                with gr.Accordion("Export and push", open=True):
                    with gr.Row():
                        add("fast.export_artifacts", gr.CheckboxGroup(list(ARTIFACTS), value=[], label="Export",
                                                                      elem_id="export-artifacts"))
                        add("fast.gguf_quantizations", gr.Dropdown(list(GGUF_QUANTIZATIONS), value=["q8_0"],
                                                                   multiselect=True, label="GGUF types"))
                        add("fast.merged_dtype", gr.Dropdown(list(MERGED_DTYPES), value="bfloat16",
                                                             label="Merged dtype"))
                    with gr.Row():
                        add("fast.push_to_hub", gr.Checkbox(False, label="Push to the Hub", elem_id="push"))
                        add("fast.hub_model_id", gr.Textbox("", label="Hub repo id", placeholder="me/my-model",
                                                            info=HELP["fast.hub_model_id"], elem_id="hub-id"))
                        add("fast.push_artifacts", gr.CheckboxGroup(list(ARTIFACTS), value=list(ARTIFACTS),
                                                                    label="Push"))
                        add("fast.hub_private", gr.Checkbox(True, label="Private repos"))
                    token = gr.Textbox("", type="password", label="Hub token (optional; default: HF_TOKEN)")
                    with gr.Row():
                        card_kind = gr.Radio(["merged", "adapter", "gguf"], value="merged", label="Model card")
                        card_btn = gr.Button("Preview model card")
                    card = gr.Markdown(elem_id="card-preview")
                with gr.Accordion("YAML (same format as `fasttune train`)", open=False):
                    yaml_box = gr.Code(language="yaml", label="Run config", elem_id="yaml-box")
                    with gr.Row():
                        to_yaml = gr.Button("Export YAML", elem_id="export-yaml")
                        from_yaml = gr.Button("Import YAML", elem_id="import-yaml")
                    yaml_msg = gr.Markdown()
            with gr.Column(scale=2):
                with gr.Row():
                    validate_btn = gr.Button("Validate", elem_id="validate")
                    start_btn = gr.Button("Start training", variant="primary", elem_id="start")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                action_msg = gr.Markdown(elem_id="action-msg")
                status = gr.Markdown(elem_id="run-status")
                progress = gr.HTML(elem_id="progress-box")
                plot = gr.LinePlot(pd.DataFrame({"step": [], "loss": []}), x="step", y="loss", label="Training loss",
                                   elem_id="loss-plot", height=260)
                result = gr.Markdown(elem_id="run-result")
                with gr.Group():
                    gr.Markdown("**Try it**: the latest finished run's model answers (greedy)")
                    with gr.Row():
                        try_prompt = gr.Textbox("", label="Prompt", placeholder="cab =", elem_id="try-prompt",
                                                scale=3)
                        try_btn = gr.Button("Generate", elem_id="try-generate", scale=1)
                    try_out = gr.Textbox(label="Answer", interactive=False, elem_id="try-output")
                logs = gr.Textbox(label="Log", lines=14, max_lines=14, autoscroll=True, elem_id="run-log")

        paths = [p for p, _ in fields]
        comps = [c for _, c in fields]
        with_paths = lambda fn: (lambda *vals: fn(paths, list(vals)))  # noqa: E731
        view = [status, progress, plot, logs, result]

        base.change(model_message, base, model_msg)
        for trigger in (dataset.change, trainer.change):
            trigger(preview, [dataset, trainer, *role_boxes], [table, data_msg, *role_boxes])
        upload.upload(JOBS.save_upload, upload, dataset)
        validate_btn.click(with_paths(lambda p, v: problems_md(build_config(p, v)[1], "Ready to start.")),
                           comps, action_msg)
        card_btn.click(lambda kind, *vals: card_preview(kind, paths, list(vals)), [card_kind, *comps], card)
        to_yaml.click(with_paths(_export_yaml), comps, [yaml_box, yaml_msg])
        from_yaml.click(lambda text: _import_yaml(paths, text), yaml_box, [*comps, yaml_msg])
        start_btn.click(lambda tok, *vals: start_run(paths, list(vals), tok), [token, *comps], action_msg).then(
            run_view, None, view)
        stop_btn.click(lambda: _stopped_msg(JOBS.stop()), None, action_msg).then(run_view, None, view)
        try_btn.click(try_it, try_prompt, try_out, api_name="generate")
        try_prompt.submit(try_it, try_prompt, try_out, api_visibility="private")
        # Polls files only: cheap, so no concurrency limit (several open tabs never queue behind each other).
        gr.Timer(1.0).tick(run_view, None, view, show_progress="hidden", concurrency_limit=None,
                           api_visibility="private")
        demo.load(run_view, None, view, api_visibility="private")
        demo.load(preview, [dataset, trainer, *role_boxes], [table, data_msg, *role_boxes], api_visibility="private")
        gr.api(api_validate, api_name="validate")
        gr.api(api_start, api_name="start")
        gr.api(api_stop, api_name="stop")
        gr.api(api_state, api_name="state")
    demo.form_paths = paths  # for tests: the config path of each form input, in order
    return demo


def _export_yaml(paths, values):
    cfg, problems = build_config(paths, values)
    if cfg is None:
        return gr.update(), problems_md(problems, "")
    note = problems_md(problems, "Valid; run it with `fasttune train config.yaml`.")
    return cfg.to_yaml(), note


def _import_yaml(paths, text: str):
    try:
        cfg = parse_run_config(text or "")
    except RunConfigError as e:
        return *[gr.update() for _ in paths], problems_md(e.errors, "")
    return *dict_to_form(paths, cfg), "✅ imported into the form"


def _stopped_msg(state: dict) -> str:
    return f"⏹ {state.get('status', 'no run')}" if state else "No run to stop."


demo = build_app()

if __name__ == "__main__":
    DOWNLOADS.root.mkdir(parents=True, exist_ok=True)
    demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"), show_error=True,
                ssr_mode=False, footer_links=["api"], allowed_paths=[str(DOWNLOADS.root.resolve())])
