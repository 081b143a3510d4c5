"""Training data for a run: the embedded task, local files or a Hub dataset, mapped onto TRL's columns.

A run config's ``data.columns`` maps roles to dataset columns; the roles are TRL's column names
(``config.FORMATS``): sft takes prompt+completion, messages (chat turns) or text; dpo takes
prompt+chosen+rejected (or chosen+rejected with the prompt inside the conversations). An empty
mapping picks the first format whose names the dataset already has. ``load_train_dataset``
renames the mapped columns to the roles and drops the rest, so TRL sees exactly one format.

Previews and column checks read local files with the standard library only (the Space and
``checks.check_sources`` use them before anything heavy is imported).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from .config import FORMATS
from .data_checks import DataError, Rows, check_rows, locate_load_error
from .sources import EMBEDDED, classify_dataset

EMBEDDED_ROWS = 2000
EMBEDDED_EVAL_ROWS = 200
EMBEDDED_EVAL_SEED = 10_000  # held-out words: the seed offset the embedded exact-match set uses too


def embedded_rows(trainer: str, n: int = EMBEDDED_ROWS, seed: int = 0) -> list[dict[str, str]]:
    """The embedded shift task: prompt/completion rows for sft, prompt/chosen/rejected for dpo
    (the rejected answer repeats the word unshifted, a plausible wrong answer)."""
    from ..embedded import make_task, word_of

    rows = make_task(n, seed=seed)
    if trainer == "dpo":
        return [{"prompt": r["prompt"], "chosen": r["completion"],
                 "rejected": " " + word_of(r["prompt"])} for r in rows]
    return rows


def read_rows(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a local .json (array, or JSON lines), .jsonl, .csv or .parquet file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = []
            for row in csv.DictReader(f):
                rows.append(dict(row))
                if limit is not None and len(rows) >= limit:
                    break
            return rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return table.slice(0, limit).to_pylist() if limit is not None else table.to_pylist()
    text = path.read_text(encoding="utf-8")
    rows: list[dict[str, Any]] | None = None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # JSON lines in a .json file, as datasets' json loader accepts
        if isinstance(data, list):
            rows = data
        elif isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            rows = lists[0] if len(lists) == 1 else [data]
    if rows is None:
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {i + 1}: not valid JSON ({e.msg}, column {e.colno})") from None
            if limit is not None and len(rows) >= limit:
                break
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{path}: expected one JSON object per row")
    return rows[:limit] if limit is not None else rows


def preview_rows(dataset: str, trainer: str = "sft", n: int = 5) -> list[dict[str, Any]]:
    """The first ``n`` rows of an embedded or local dataset (no network)."""
    kind = classify_dataset(dataset)
    if kind == EMBEDDED:
        return embedded_rows(trainer, n)
    if kind == "local":
        return read_rows(dataset, n)
    raise ValueError(f"{dataset!r} is a Hub dataset: no local preview")


def available_columns(dataset: str, trainer: str = "sft") -> list[str]:
    """Column names of an embedded or local dataset (union over the first rows)."""
    if dataset == EMBEDDED:  # known without building the task (which imports torch)
        return list(FORMATS[trainer][0])
    cols: dict[str, None] = {}
    for row in preview_rows(dataset, trainer, 20):
        cols.update(dict.fromkeys(row))
    return list(cols)


def resolve_columns(trainer: str, mapping: dict[str, str], available: list[str]) -> dict[str, str]:
    """role → column: the mapping given, or the first format whose names ``available`` has."""
    errors = column_errors(trainer, mapping, available)
    if errors:
        raise ValueError("; ".join(errors))
    if mapping:
        return dict(mapping)
    fmt = next(f for f in FORMATS[trainer] if set(f) <= set(available))
    return {role: role for role in fmt}


def column_errors(trainer: str, mapping: dict[str, str], available: list[str]) -> list[str]:
    """Why ``mapping`` does not work on a dataset with columns ``available`` (empty: it works)."""
    formats = " or ".join("+".join(f) for f in FORMATS[trainer])
    shown = ", ".join(available) or "(none)"
    if not mapping:
        if any(set(f) <= set(available) for f in FORMATS[trainer]):
            return []
        return [f"data.columns: the dataset's columns ({shown}) hold no {trainer} format ({formats}); map them, "
                f"e.g. columns: {{{', '.join(f'{r}: <column>' for r in FORMATS[trainer][0])}}}"]
    return [f"data.columns.{role}: column {col!r} is not in the dataset; columns: {shown}"
            for role, col in mapping.items() if col not in available]


def load_train_dataset(cfg):
    """The training ``datasets.Dataset`` of a run config, columns renamed to TRL's roles (rows checked:
    a malformed line or an empty target column names its file and row, ``data_checks``)."""
    data = cfg.data
    n = EMBEDDED_ROWS if data.max_samples is None else data.max_samples
    return _load(cfg, data.dataset, data.split, n, cfg.training.seed, limit=data.max_samples)


def load_eval_dataset(cfg, train):
    """(train, eval) for a run config: ``data.eval_dataset`` (held-out embedded rows for 'embedded'),
    ``data.eval_split`` of the Hub dataset, or ``data.eval_size`` rows held out of ``train``;
    (train, None) when the config names no eval data."""
    data = cfg.data
    if data.eval_dataset is not None:
        split = data.eval_split or data.split
        return train, _load(cfg, data.eval_dataset, split, EMBEDDED_EVAL_ROWS, cfg.training.seed + EMBEDDED_EVAL_SEED)
    if data.eval_split is not None:
        return train, _load(cfg, data.dataset, data.eval_split, EMBEDDED_EVAL_ROWS,
                            cfg.training.seed + EMBEDDED_EVAL_SEED)
    if data.eval_size > 0:
        size = data.eval_size if data.eval_size < 1 else int(data.eval_size)
        if isinstance(size, int) and size >= len(train):
            raise DataError(f"data.eval_size: {size} rows held out would leave none of {len(train)} to train on")
        parts = train.train_test_split(test_size=size, seed=cfg.training.seed, shuffle=True)
        if len(parts["test"]) == 0:
            raise DataError(f"data.eval_size: {data.eval_size} of {len(train)} rows is no row at all")
        return parts["train"], parts["test"]
    return train, None


def _load(cfg, name: str, split: str, n_embedded: int, seed_embedded: int, limit: int | None = None):
    """One data source as a Dataset of TRL's role columns: loaded, cut to ``limit`` rows, checked."""
    from datasets import Dataset, load_dataset

    kind = classify_dataset(name)
    if kind == EMBEDDED:
        ds = Dataset.from_list(embedded_rows(cfg.trainer, n_embedded, seed_embedded))
    elif kind == "local":
        suffix = Path(name).suffix.lower().lstrip(".")
        builder = {"jsonl": "json"}.get(suffix, suffix)
        try:
            ds = load_dataset(builder, data_files=str(name), split="train")
        except Exception as e:  # noqa: BLE001 - DatasetGenerationError and friends: say which line
            raise locate_load_error(name, e) from e
    else:
        ds = load_dataset(name, cfg.data.config_name, split=split)
    if len(ds) == 0:
        raise DataError(f"{name}: no rows" + (f" in split {split!r}" if kind == "hub" else ""))
    if limit is not None and len(ds) > limit:
        ds = ds.select(range(limit))
    mapping = resolve_columns(cfg.trainer, cfg.data.columns, list(ds.column_names))
    ds = ds.select_columns(list(mapping.values()))
    source = name if kind != "hub" else f"{name} ({split})"
    check_rows(ds, cfg.trainer, mapping, Rows(source, local=kind == "local"))
    renames = {col: role for role, col in mapping.items() if col != role}
    return ds.rename_columns(renames) if renames else ds
