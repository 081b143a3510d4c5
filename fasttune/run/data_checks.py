"""Training data checked row by row, with errors that name the file and the row.

datasets reports a malformed line of a local JSON file as ``DatasetGenerationError: An error
occurred while generating the dataset``; the line is only in its chained causes, if at all.
``locate_load_error`` reads the file again with the standard library and names the first line that
is not a JSON object (or whose value types change from earlier rows). ``check_rows`` then looks at
the role columns of the loaded rows: a missing or non-text value stops the run naming its row;
targets (completion, text, chosen, the assistant turns) that are all empty stop it too, since the
model would learn nothing; some empty ones give a warning with the first few rows.

Standard library only (the dataset passed in is any object with ``__len__`` and ``__getitem__``
by column name, as ``datasets.Dataset`` has).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("fasttune.runner")

TEXT_ROLES = ("prompt", "completion", "text", "chosen", "rejected")
TARGET_ROLES = ("completion", "text", "chosen", "messages")  # what the model is trained to produce
_SHOWN = 3  # rows named in a message


class DataError(ValueError):
    """A problem with the data; the message names the file (or Hub dataset) and the row."""


class Rows:
    """Names rows of one data source as a user finds them: ``file.jsonl line 57`` for JSON lines
    (blank lines skipped as datasets does), ``file.csv row 57`` otherwise (1-based)."""

    def __init__(self, source: str, local: bool) -> None:
        self.source = source
        self.path = Path(source) if local else None
        self._lines: list[int] | None = None

    def name(self, index: int) -> str:
        if self.path is not None and _is_json_lines(self.path):
            if self._lines is None:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    self._lines = [n for n, line in enumerate(f, 1) if line.strip()]
            if index < len(self._lines):
                return f"{self.source} line {self._lines[index]}"
        return f"{self.source} row {index + 1}"


def _is_json_lines(path: Path) -> bool:
    if path.suffix.lower() == ".jsonl":
        return True
    if path.suffix.lower() != ".json":
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    return not head.startswith("[")  # a .json file of JSON lines, as datasets' json loader accepts


def locate_load_error(path: str | Path, exc: BaseException) -> DataError:
    """A DataError naming the line of ``path`` that made datasets fail with ``exc`` (its root cause
    when no line is at fault: a CSV/Parquet problem, an unreadable file)."""
    path = Path(path)
    found = _first_bad_json_line(path) if path.suffix.lower() in (".json", ".jsonl") else None
    if found:
        return DataError(found)
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    return DataError(f"{path}: could not be read as {path.suffix.lstrip('.')} data: {type(root).__name__}: {root}")


def _first_bad_json_line(path: Path) -> str | None:
    if not _is_json_lines(path):
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            return f"{path} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        except UnicodeDecodeError as e:
            return f"{path}: not UTF-8 text ({e.reason} at byte {e.start})"
        items = rows if isinstance(rows, list) else []
        return _first_type_change((f"{path} row {i + 1}", r) for i, r in enumerate(items))
    return _first_type_change(_json_lines(path))


def _json_lines(path: Path):
    """(name, parsed row) per non-blank line; a line that does not parse yields (name, DataError)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield f"{path} line {n}", json.loads(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as e:
                yield f"{path} line {n}", DataError(f"not UTF-8 text ({e.reason} at byte {e.start})")
            except json.JSONDecodeError as e:
                yield f"{path} line {n}", DataError(f"not valid JSON ({e.msg}, column {e.colno})")


def _first_type_change(rows) -> str | None:
    """The first row that is not a JSON object, or whose value for a key changes JSON type."""
    seen: dict[str, tuple[str, str]] = {}
    for name, row in rows:
        if isinstance(row, DataError):
            return f"{name}: {row}"
        if not isinstance(row, dict):
            return f"{name}: expected a JSON object, got {_kind(row)}"
        for key, value in row.items():
            if value is None:
                continue
            kind = _kind(value)
            first = seen.setdefault(key, (kind, name))
            if first[0] != kind:
                return f"{name}: {key!r} is {kind} here but {first[0]} in {first[1]}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "text", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def check_rows(ds, trainer: str, mapping: dict[str, str], rows: Rows) -> list[str]:
    """Checks the role columns of ``ds`` (columns still under their dataset names, ``mapping``: role
    → column). Raises DataError for a missing or non-text value (naming the row) and for targets that
    are all empty; returns (and logs) a warning when only some are empty."""
    n = len(ds)
    warnings = []
    for role, col in mapping.items():
        values = ds[col]
        bad = _first_bad_value(values, role)
        if bad is not None:
            i, what = bad
            raise DataError(f"{rows.name(i)}: {col!r} {what}")
        if role not in TARGET_ROLES or (trainer == "dpo" and role != "chosen"):
            continue
        empty = [i for i, v in enumerate(values) if _is_empty(v, role)]
        if not empty:
            continue
        what = "assistant turn" if role == "messages" else f"{col!r} value"
        if len(empty) == n:
            raise DataError(f"{rows.source}: every {what} is empty ({n} rows): the model would learn nothing; "
                            f"check data.columns.{role} (now {col!r})")
        shown = ", ".join(rows.name(i).removeprefix(f"{rows.source} ") for i in empty[:_SHOWN])
        more = f" and {len(empty) - _SHOWN} more" if len(empty) > _SHOWN else ""
        warnings.append(f"{rows.source}: {len(empty)} of {n} rows have an empty {what} ({shown}{more}); "
                        "they teach nothing")
    for text in warnings:
        logger.warning("fasttune: %s", text)
    return warnings


def _first_bad_value(values, role: str) -> tuple[int, str] | None:
    for i, v in enumerate(values):
        if v is None:
            return i, "is missing"
        if role in TEXT_ROLES and not isinstance(v, (str, list)):
            return i, f"is {_kind(v)} ({str(v)[:40]}), expected text"
        if role == "messages" and not (isinstance(v, list) and all(isinstance(m, dict) and m.get("role") for m in v)):
            return i, "is not a list of chat turns ({'role': ..., 'content': ...})"
    return None


def _is_empty(value, role: str) -> bool:
    if role == "messages":
        return not any(str(m.get("content") or "").strip() for m in value if m.get("role") == "assistant")
    if isinstance(value, list):  # a conversational completion / chosen answer: a list of turns
        return not any(str(m.get("content") or "").strip() for m in value if isinstance(m, dict))
    return not value.strip()
