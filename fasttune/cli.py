"""The ``fasttune`` command line.

    fasttune train CONFIG.yaml [--run-dir DIR] [--set training.max_steps=20 ...] [--dry-run]
    fasttune train [CONFIG.yaml] --run-dir DIR --resume | --overwrite     continue / redo a run there
    fasttune status RUN_DIR [--json]      a run's state (a killed run shows as interrupted)
    fasttune export RUN_DIR [--artifacts adapter merged gguf] [--gguf q8_0 q4_0]
    fasttune push RUN_DIR --repo-id me/my-model [--token ...]      (token: --token or HF_TOKEN)
    fasttune config [--trainer dpo]       a documented run config to start from
    fasttune doctor [--json]              versions, GPU, kernels, families, a dry patch
    fasttune quickstart [...]             the embedded-default demo (fasttune.quickstart)

Exit codes: 0 done, 1 failed, 2 bad config or arguments, 3 training stopped (SIGTERM/SIGINT).
Configs are validated before any model or dataset is loaded; each error names its field and the
allowed values. Heavy libraries are imported only by the command that needs them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_STOPPED = 0, 1, 2, 3
ARTIFACTS = ("adapter", "merged", "gguf")


def _config_epilog() -> str:
    from .run.config import field_help

    lines = ["run config fields (YAML sections; `fasttune config` prints a full example):"]
    lines += [f"  {key}: {text}" for key, text in field_help().items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .config import GGUF_QUANTIZATIONS, MERGED_DTYPES
    from .run.config import TRAINERS

    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="fasttune", description="Faster, leaner fine-tuning of open LLMs: train from a "
                                "YAML run config, export, push to the Hub, check this machine.",
                                epilog="`fasttune COMMAND --help` describes each command.", formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"fasttune {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="fine-tune from a YAML run config", formatter_class=fmt,
                       description="Fine-tune a model as a YAML run config says; the run folder keeps the config, "
                                   "logs, state.json, metrics and the final model.", epilog=_config_epilog())
    t.add_argument("config", nargs="?", help="the YAML run config (with --resume: default, the run's own)")
    t.add_argument("--run-dir", help="where the run writes its files (default: runs/<name>-<date>-<time>)")
    again = t.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest "
                       "complete checkpoint (checkpoints cut short by a full disk or a kill are skipped)")
    again.add_argument("--overwrite", action="store_true", help="delete the run already in --run-dir and start "
                       "over (without --resume or --overwrite, a folder holding a run is refused)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set training.max_steps=20 (repeatable)")
    t.add_argument("--dry-run", action="store_true", help="validate the config, print it resolved, and exit")

    e = sub.add_parser("export", help="save adapter / merged / GGUF files of a finished run",
                       description="Write the adapter, merged 16-bit weights and GGUF files of a finished run into "
                                   "RUN_DIR/{adapter,merged,gguf}.")
    e.add_argument("run_dir", help="folder of a finished `fasttune train` run")
    e.add_argument("--artifacts", nargs="+", choices=ARTIFACTS,
                   help="what to write (default: fast.export_artifacts, else all that apply)")
    e.add_argument("--gguf", nargs="+", choices=GGUF_QUANTIZATIONS, metavar="QUANT",
                   help=f"GGUF types (default: fast.gguf_quantizations): {', '.join(GGUF_QUANTIZATIONS)}")
    e.add_argument("--merged-dtype", choices=MERGED_DTYPES, help="dtype of the merged weights")

    h = sub.add_parser("push", help="push a finished run to the Hugging Face Hub",
                       description="Upload a finished run: merged → REPO_ID, adapter → REPO_ID-lora, GGUF → "
                                   "REPO_ID-GGUF, each with its model card. What `fasttune export` wrote is uploaded "
                                   "as it is; only what is missing is exported. The repo id, the token and the Hub "
                                   "are checked first. The token comes from --token or HF_TOKEN (or `hf auth "
                                   "login`) and is never printed.")
    h.add_argument("run_dir", help="folder of a finished `fasttune train` run")
    h.add_argument("--repo-id", help="'name' or 'namespace/name' (default: fast.hub_model_id of the run)")
    h.add_argument("--artifacts", nargs="+", choices=ARTIFACTS, help="what to push (default: fast.push_artifacts)")
    h.add_argument("--gguf", nargs="+", choices=GGUF_QUANTIZATIONS, metavar="QUANT",
                   help="GGUF types to push: exported when not there yet (GGUF files export made are pushed too)")
    vis = h.add_mutually_exclusive_group()
    vis.add_argument("--private", dest="private", action="store_true", default=None, help="create private repos")
    vis.add_argument("--public", dest="private", action="store_false", help="create public repos")
    h.add_argument("--token", help="Hub token (default: HF_TOKEN or the stored login; prefer those: "
                                   "a command-line argument is visible to other users of the machine)")

    c = sub.add_parser("config", help="print a documented run config to start from",
                       description="Print a complete run config (defaults, one comment per field) for the "
                                   "embedded model and data; edit it and pass it to `fasttune train`.")
    c.add_argument("--trainer", choices=TRAINERS, default="sft")

    d = sub.add_parser("doctor", help="check versions, GPU, kernels and supported families",
                       description="Report library versions, the GPU, where each kernel runs on this machine, the "
                                   "supported model families and a dry patch of a tiny model of each family.")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-dry-patch", action="store_true", help="skip building and patching tiny models")

    st = sub.add_parser("status", help="show the state of a run folder",
                        description="Status, step, loss and checkpoints of a run; a run whose process is gone "
                                    "(killed, crashed) shows as interrupted.")
    st.add_argument("run_dir", help="folder of a `fasttune train` run")
    st.add_argument("--json", action="store_true", help="the state as JSON, status resolved")

    sub.add_parser("quickstart", add_help=False, help="the embedded-default demo (`fasttune quickstart --help`)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fasttune`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["quickstart"]:  # its own parser, its own --help
        from .run.quickstart import main as quickstart_main

        return quickstart_main(argv[1:]) or EXIT_OK
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig: leave a host's own logging set-up alone
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(_Console())
        root.addHandler(console)
        root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Hub request otherwise
    command = {"train": cmd_train, "export": cmd_export, "push": cmd_push, "config": cmd_config,
               "doctor": cmd_doctor, "status": cmd_status}[args.command]
    return command(args)


class _Console(logging.Formatter):
    """fasttune's own messages as they are; other libraries' records name their level and logger
    (so a reader, or the Space's log panel, can tell them apart)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.name.startswith("fasttune") else f"{record.levelname} {record.name}: {text}"


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"fasttune: {message}", file=sys.stderr)
    return code


def default_run_dir(cfg, config_path: str) -> Path:
    name = cfg.run_name or Path(config_path).stem
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args) -> int:
    from .run.checks import validate
    from .run.config import RunConfigError, load_run_config

    if args.resume and not args.run_dir:
        return _fail("--resume needs --run-dir: the folder of the run to continue", EXIT_CONFIG)
    config = args.config
    if config is None:
        if not args.resume:
            return _fail("train: give a run config (CONFIG.yaml); `fasttune config` prints one", EXIT_CONFIG)
        config = str(Path(args.run_dir) / "run_config.yaml")  # the run's own config
    try:
        cfg = load_run_config(config, args.overrides)
        validate(cfg, config)
    except RunConfigError as e:
        return _fail(str(e), EXIT_CONFIG)
    if args.dry_run:
        print(cfg.to_yaml(), end="")
        print("config OK", file=sys.stderr)
        return EXIT_OK
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg, config)
    print(f"fasttune: run folder {run_dir}", file=sys.stderr)
    from .run.data_checks import DataError
    from .run.os_errors import RunIOError, explain
    from .run.rerun import RunFolderError
    from .run.runner import train

    try:
        state = train(cfg, run_dir, overwrite=args.overwrite, resume=args.resume)
    except RunFolderError as e:
        return _fail(str(e), EXIT_CONFIG)
    except (DataError, RunIOError) as e:  # one line that says what and where; the traceback is in train.log
        return _fail(f"training failed: {e}")
    except OSError as e:  # before the run's own handler was in place (creating the folder, say)
        return _fail(f"training failed: {explain(e, run_dir) or e}")
    except Exception as e:  # noqa: BLE001 - the traceback is in train.log and was logged
        return _fail(f"training failed: {type(e).__name__}: {e} (see {run_dir / 'train.log'})")
    metrics = state.get("metrics", {})
    summary = {k: metrics.get(k) for k in ("global_step", "first_loss", "last_loss", "eval_loss", "exact_match")
               if k in metrics}
    print(f"fasttune: run {state['status']}: {json.dumps(summary)}")
    if metrics.get("exact_match") is not None:
        from .embedded import describe_exact_match

        print(f"fasttune: {describe_exact_match(metrics['exact_match'], metrics.get('exact_match_rows'))}")
    for kind, url in (state.get("urls") or {}).items():
        print(f"fasttune: pushed {kind}: {url}")
    return EXIT_STOPPED if state["status"] == "stopped" else EXIT_OK


def cmd_status(args) -> int:
    from .run.checkpoints import checkpoints, incomplete_reason
    from .run.folder import RunFolder
    from .run.liveness import describe, effective_status

    folder = RunFolder(args.run_dir)
    state = folder.read_state()
    if not state:
        return _fail(f"{args.run_dir} holds no fasttune run (no state.json)", EXIT_CONFIG)
    if args.json:
        print(json.dumps({**state, "status": effective_status(state), "recorded_status": state.get("status")},
                         indent=1))
        return EXIT_OK
    loss = state.get("loss") or []
    print(f"{state.get('run_name', folder.path.name)}: {describe(state)}"
          + (f", loss {loss[-1][1]:.4f}" if loss else ""))
    if state.get("error"):
        print(f"  error: {state['error']}")
    for step, path in checkpoints(folder.path):
        why = incomplete_reason(path)
        print(f"  {path.name}: " + ("complete" if why is None else f"incomplete ({why})"))
    return EXIT_OK


def _check_run_dir(run_dir: str) -> str | None:
    from .run.folder import RunFolder

    if not RunFolder(run_dir).is_finished():
        return f"{run_dir} is not a finished fasttune run (no run_config.yaml and final/ there)"
    return None


def cmd_export(args) -> int:
    from .run.config import RunConfigError

    problem = _check_run_dir(args.run_dir)
    if problem:
        return _fail(problem, EXIT_CONFIG)
    from .export.leftovers import ExportBusyError
    from .run.publish import export_run

    try:
        folders = export_run(args.run_dir, args.artifacts, args.gguf, args.merged_dtype)
    except (RunConfigError, ValueError, TypeError, OSError, ExportBusyError) as e:  # a full disk: one line
        return _fail(f"export failed: {e}")
    for kind, folder in folders.items():
        print(f"fasttune: {kind}: {folder}")
    return EXIT_OK


def cmd_push(args) -> int:
    problem = _check_run_dir(args.run_dir)
    if problem:
        return _fail(problem, EXIT_CONFIG)
    from .export.hub import HubPushError
    from .export.leftovers import ExportBusyError
    from .run.publish import push_run

    try:
        urls = push_run(args.run_dir, args.repo_id, args.artifacts, args.private, args.token, args.gguf)
    except HubPushError as e:  # scrubbed of the token by export/hub_client.py
        return _fail(f"push failed: {e}")
    except ValueError as e:
        return _fail(str(e), EXIT_CONFIG)
    except (OSError, ExportBusyError) as e:  # exporting what was missing: a full disk, a busy folder
        return _fail(f"push failed: {e}")
    for kind, url in urls.items():
        print(f"fasttune: pushed {kind}: {url}")
    return EXIT_OK


def cmd_config(args) -> int:
    from .run.config import RunConfig, field_help

    cfg = RunConfig.from_dict({"trainer": args.trainer, "run_name": f"embedded-{args.trainer}",
                               "training": {"max_steps": 60, "learning_rate": 3e-3, "logging_steps": 5,
                                            "max_length": 64}})
    print(annotate_yaml(cfg.to_yaml(), field_help()), end="")
    return EXIT_OK


def annotate_yaml(text: str, helps: dict[str, str]) -> str:
    """Puts each field's help as a comment above its line (top-level and one section deep)."""
    out, section = [], None
    for line in text.splitlines():
        key = line.strip().split(":", 1)[0]
        if line and not line.startswith((" ", "-")):
            section = key
            path = key
        elif line.startswith("  ") and not line.startswith("   ") and not line.strip().startswith("-"):
            path = f"{section}.{key}"
        else:
            path = None
        if path in helps:
            indent = line[:len(line) - len(line.lstrip())]
            out.append(f"{indent}# {helps[path]}")
        out.append(line)
    return "\n".join(out) + "\n"


def cmd_doctor(args) -> int:
    from . import doctor

    info = doctor.collect(dry=not args.no_dry_patch)
    print(json.dumps(info, indent=2) if args.json else doctor.format_report(info))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
