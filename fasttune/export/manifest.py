"""What an export wrote, and from which trained weights: ``<artifact>/.fasttune-export.json``.

Export writes one manifest per artifact folder: the kind, the files with their sizes and a
fingerprint of the source (for a run folder, of ``final/``: each file's path, size and mtime).
``push`` reuses an artifact only when its manifest names the same source and every listed file
is there with its size, so a push after ``export`` uploads what export made and exports only what
is missing, while a retrained run (new ``final/``) is exported afresh. Hidden, so never uploaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable

from .atomic import atomic_write

MANIFEST = ".fasttune-export.json"
_GGUF_NAME = re.compile(r"^(?P<name>.+)-(?P<quant>[A-Z0-9_]+)\.gguf$")


def source_fingerprint(path: str | Path) -> str:
    """A short hash of every file under ``path`` (relative path, size, mtime): changes when any
    of them is rewritten."""
    path = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        st = p.stat()
        h.update(f"{p.relative_to(path).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_manifest(folder: str | Path, kind: str, source: str | None, files: Iterable[str | Path],
                   **extra: Any) -> dict[str, Any]:
    """Records ``files`` (names inside ``folder``) as ``kind``'s export from ``source``."""
    folder = Path(folder)
    names = sorted({Path(f).name if Path(f).is_absolute() else str(f) for f in files})
    data = {"kind": kind, "source": source, "files": {n: (folder / n).stat().st_size for n in names}, **extra}
    atomic_write(folder / MANIFEST, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def artifact_files(folder: str | Path, kind: str) -> list[str]:
    """The files that make ``kind`` complete, as they are in ``folder`` now (relative names); [] when
    a required one is missing."""
    folder = Path(folder)
    if kind == "adapter":
        weights = [n for n in ("adapter_model.safetensors", "adapter_model.bin") if (folder / n).is_file()]
        return ["adapter_config.json", weights[0]] if weights and (folder / "adapter_config.json").is_file() else []
    if kind == "merged":
        if not (folder / "config.json").is_file():
            return []
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            return ["config.json", index.name, *shards] if all((folder / s).is_file() for s in shards) else []
        return ["config.json", "model.safetensors"] if (folder / "model.safetensors").is_file() else []
    if kind == "gguf":
        return sorted(p.name for p in folder.glob("*.gguf") if not p.name.startswith("."))
    raise ValueError(f"kind must be adapter, merged or gguf, got {kind!r}")


def reusable(folder: str | Path, kind: str, source: str | None) -> bool:
    """``folder`` holds a complete ``kind`` exported from ``source`` and unchanged since."""
    folder = Path(folder)
    data = read_manifest(folder)
    if source is None or not data or data.get("source") != source or data.get("kind") != kind:
        return False
    listed = data.get("files") or {}
    if not set(artifact_files(folder, kind)) <= set(listed):
        return False
    return all((folder / n).is_file() and (folder / n).stat().st_size == size for n, size in listed.items())


def gguf_quants(folder: str | Path, source: str | None) -> dict[str, Path]:
    """quant (lower case) → file of the GGUF files exported from ``source`` that are still there."""
    folder = Path(folder)
    if not reusable(folder, "gguf", source):
        return {}
    out = {}
    for name in read_manifest(folder)["files"]:
        match = _GGUF_NAME.match(name)
        if match and not name.startswith("mmproj-"):  # a VLM's vision file rides along with every type
            out[match.group("quant").lower()] = folder / name
    return out
