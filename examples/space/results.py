"""What a run shows in the Space once it ends: its result, a download link per artifact, and the
model to try.

Downloads live under ``<runs>/downloads/<run name>/`` (the only folder the app lets Gradio serve):
each GGUF file is hard-linked there (copied across file systems), the adapter and merged folders
are zipped there (stored, not compressed: weights do not compress), in a background thread so a
large merged model never blocks the page. Links point at Gradio's file route.
"""

from __future__ import annotations

import os
import shutil
import threading
import zipfile
from pathlib import Path
from urllib.parse import quote

FOLDER_ARTIFACTS = ("adapter", "merged", "final")


class Downloads:
    """Download files of finished runs under ``root`` (``<runs>/downloads``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._building: dict[str, threading.Thread] = {}
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()

    def wanted(self, state: dict) -> list[tuple[str, Path]]:
        """(label, source) per artifact of a run; the trained model itself when nothing was exported."""
        artifacts = dict(state.get("artifacts") or {})
        if not artifacts and state.get("run_dir") and (Path(state["run_dir"]) / "final").is_dir():
            artifacts = {"final": str(Path(state["run_dir"]) / "final")}
        out = []
        for kind, folder in artifacts.items():
            folder = Path(folder)
            if kind == "gguf":
                out += [(f"gguf {p.stem.rsplit('-', 1)[-1]}", p) for p in sorted(folder.glob("*.gguf"))]
            elif folder.is_dir():
                out.append((kind, folder))
        return out

    def _target(self, run: str, source: Path) -> Path:
        name = f"{run}-{source.name}.zip" if source.is_dir() else source.name
        return self.root / run / name

    def files(self, state: dict) -> tuple[list[tuple[str, Path]], bool]:
        """([(label, file to download)] ready so far, whether more are being prepared)."""
        run = Path(state.get("run_dir", "run")).name
        ready, pending = [], False
        for label, source in self.wanted(state):
            target = self._target(run, source)
            if target.is_file():
                ready.append((label, target))
            elif str(target) not in self._errors:
                pending = True
                self._start(target, source)
        return ready, pending

    def _start(self, target: Path, source: Path) -> None:
        with self._lock:
            if str(target) in self._building:
                return
            thread = threading.Thread(target=self._build, args=(target, source), daemon=True)
            self._building[str(target)] = thread
            thread.start()

    def _build(self, target: Path, source: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            if source.is_dir():
                with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
                    for p in sorted(source.rglob("*")):
                        if p.is_file():
                            z.write(p, f"{source.name}/{p.relative_to(source).as_posix()}")
            else:
                try:
                    os.link(source, tmp)
                except OSError:  # another file system, or no hard links there
                    shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._errors[str(target)] = f"{target.name}: {e.strerror or e}"
        finally:
            with self._lock:
                self._building.pop(str(target), None)

    def links_md(self, state: dict) -> str:
        """Markdown: one download link per artifact (sizes shown), and what is still being prepared."""
        if state.get("status") not in ("completed", "stopped"):
            return ""
        ready, pending = self.files(state)
        lines = [f"- ⬇️ [{label}: {path.name}]({file_url(path)}) ({_size(path.stat().st_size)})"
                 for label, path in ready]
        if pending:
            lines.append("- ⏳ preparing downloads…")
        run = Path(state.get("run_dir", "run")).name
        lines += [f"- ❌ {why}" for target, why in self._errors.items() if Path(target).parent.name == run]
        return ("**Downloads**\n" + "\n".join(lines)) if lines else ""


def file_url(path: Path) -> str:
    """Gradio's route for a file it may serve (the app allows ``Downloads.root``)."""
    return "/gradio_api/file=" + quote(str(path.resolve()))


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def result_md(state: dict, downloads: Downloads) -> str:
    """The result of a run: its status and metrics, download links, pushed repos, the run folder."""
    status = state.get("status")
    m = state.get("metrics") or {}
    lines = []
    if status == "failed":
        lines.append(f"❌ **Failed:** {state.get('error') or 'see the log'}")
    elif status == "interrupted":
        why = state.get("error") or "the process is gone"
        lines.append(f"⚠️ **Interrupted** at step {state.get('step', 0)}: {why}. "
                     "Checkpoints, if any, are in the run folder (`fasttune train --resume`).")
    elif status == "stopped":
        lines.append(f"⏹ **Stopped** at step {state.get('step', 0)}; the model so far is in `final/`.")
    elif status == "completed":
        lines.append(f"✅ **Completed** {m.get('global_step', state.get('step'))} steps, loss "
                     f"{_fmt(m.get('first_loss'))} → {_fmt(m.get('last_loss'))}"
                     + (f", eval loss {_fmt(m['eval_loss'])}" if m.get("eval_loss") is not None else "")
                     + (f"; {_exact_match_note(m)}" if m.get("exact_match") is not None else ""))
    links = downloads.links_md(state)
    if links:
        lines.append(links)
    pushed = [f"- pushed {kind}: [{url.rstrip('/').split('/', 3)[-1]}]({url})"
              for kind, url in (state.get("urls") or {}).items()]
    if pushed:
        lines.append("\n".join(pushed))
    if state.get("run_dir"):
        lines.append(f"Run folder: `{state['run_dir']}`")
    return "\n\n".join(lines)  # blank lines: each block its own paragraph or list


def _exact_match_note(metrics: dict) -> str:
    from fasttune.embedded import describe_exact_match

    return describe_exact_match(metrics["exact_match"], metrics.get("exact_match_rows"))


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
