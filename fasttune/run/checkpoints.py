"""The Trainer's ``checkpoint-N`` folders of a run, and which of them are complete.

A checkpoint is written file by file (weights, optimizer.pt, scheduler.pt, rng_state.pth,
trainer_state.json last); a full disk or a kill leaves a folder with some files missing or cut
short, and resuming from it crashes. So after the Trainer's save, fasttune writes a marker,
``fasttune_checkpoint.json``, listing every file with its size and modification time
(``RunStateCallback.on_save``). A checkpoint is complete when its marker matches the files (a later
partial re-save of the same step changes a size or a time). A checkpoint without a marker (saved
by a plain Trainer) must pass the structural checks: ``trainer_state.json`` parses, every
safetensors file holds the data its header declares, every torch file's zip directory is intact.
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from pathlib import Path

MARKER = "fasttune_checkpoint.json"
_NAME = re.compile(r"checkpoint-(\d+)")
_WEIGHTS = ("adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "adapter_model.bin")


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``checkpoint-N`` folder in ``run_dir``, oldest step first."""
    run_dir = Path(run_dir)
    found = []
    for p in run_dir.iterdir() if run_dir.is_dir() else ():
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _files(folder: Path) -> dict[str, list[int]]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MARKER and not p.name.startswith(f".{MARKER}"):
            st = p.stat()
            out[p.relative_to(folder).as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def write_marker(folder: str | Path, step: int) -> Path:
    """Records ``folder`` as a complete checkpoint of ``step`` (call after the save returned)."""
    folder = Path(folder)
    data = json.dumps({"step": step, "files": _files(folder)}, indent=1).encode()
    tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, folder / MARKER)
    return folder / MARKER


def incomplete_reason(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None when it is complete)."""
    folder = Path(folder)
    marker = folder / MARKER
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text(encoding="utf-8"))["files"]
        except (ValueError, KeyError, OSError) as e:
            return f"{MARKER} is unreadable ({e})"
        now = _files(folder)
        for name, (size, mtime) in recorded.items():
            if name not in now:
                return f"{name} is missing"
            if now[name][0] != size:
                return f"{name} is {now[name][0]} bytes, {size} when saved (cut short?)"
            if now[name][1] != mtime:
                return f"{name} was rewritten after the checkpoint was saved (an unfinished re-save)"
        return None
    return _structural_reason(folder)


def _structural_reason(folder: Path) -> str | None:
    state = folder / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json (the Trainer writes it last: the save did not finish)"
    try:
        json.loads(state.read_text(encoding="utf-8"))["global_step"]
    except (ValueError, KeyError, OSError) as e:
        return f"trainer_state.json is unreadable ({type(e).__name__})"
    if not any((folder / w).is_file() for w in _WEIGHTS):
        return "no model weights"
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        if p.suffix == ".safetensors":
            why = _safetensors_reason(p)
        elif p.suffix in (".pt", ".pth", ".bin"):
            why = _torch_file_reason(p)
        else:
            why = None
        if why:
            return f"{p.relative_to(folder).as_posix()} {why}"
    return None


def _safetensors_reason(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return "is cut short (its header runs past the end)"
            header = json.loads(f.read(n))
    except (struct.error, ValueError, OSError) as e:
        return f"is unreadable ({type(e).__name__})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return None if 8 + n + end <= size else f"is cut short ({size} bytes, its header needs {8 + n + end})"


def _torch_file_reason(path: Path) -> str | None:
    """torch.save writes a zip whose directory comes last: a cut-short file has none."""
    try:
        with zipfile.ZipFile(path) as z:
            end = max((i.header_offset + i.compress_size for i in z.infolist()), default=0)
    except (zipfile.BadZipFile, OSError, ValueError):
        return "is cut short or not a torch file (no zip directory at its end)"
    return None if end <= path.stat().st_size else "is cut short"


def newest_complete(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest complete checkpoint or None, [(newer incomplete checkpoint, why)...])."""
    skipped = []
    for _, folder in reversed(checkpoints(run_dir)):
        why = incomplete_reason(folder)
        if why is None:
            return folder, skipped
        skipped.append((folder, why))
    return None, skipped


def step_of(folder: str | Path) -> int:
    m = _NAME.fullmatch(Path(folder).name)
    if not m:
        raise ValueError(f"{folder} is not a checkpoint-N folder")
    return int(m.group(1))
