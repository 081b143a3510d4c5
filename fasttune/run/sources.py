"""Where a run's model and data come from: the embedded demo, a local folder or file, or the Hub.

Standard library only: the CLI and the Space classify sources before anything heavy is imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

EMBEDDED = "embedded"
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("", "0", "false", "no", "off")


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith((".json", ".jsonl", ".csv"))


def classify_model(base: str) -> str:
    """'embedded', 'local' (an existing folder) or 'hub'; ValueError with the reason otherwise."""
    if base == EMBEDDED:
        return EMBEDDED
    path = Path(base).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"local folder {base!r} has no config.json (not a transformers model)")
        return "local"
    if base.startswith((".", "/", "~")) or not is_hub_id(base):
        raise ValueError(f"{base!r} is neither an existing local folder nor a Hub id like 'org/name'")
    return "hub"


def classify_dataset(name: str) -> str:
    """'embedded', 'local' (an existing data file) or 'hub'; ValueError with the reason otherwise."""
    if name == EMBEDDED:
        return EMBEDDED
    path = Path(name).expanduser()
    if path.suffix.lower() in DATA_SUFFIXES or path.exists():
        if not path.is_file():
            raise ValueError(f"local file {name!r} does not exist")
        if path.suffix.lower() not in DATA_SUFFIXES:
            raise ValueError(f"local file {name!r} is not one of {', '.join(DATA_SUFFIXES)}")
        return "local"
    if not is_hub_id(name):
        raise ValueError(f"{name!r} is neither a local {'/'.join(DATA_SUFFIXES)} file nor a Hub dataset id")
    return "hub"


def in_hub_cache(repo_id: str, repo_type: str) -> bool:
    try:
        from huggingface_hub import scan_cache_dir

        return any(r.repo_id == repo_id and r.repo_type == repo_type for r in scan_cache_dir().repos)
    except Exception:  # noqa: BLE001 - no cache folder yet, unreadable cache: treat as not cached
        return False
