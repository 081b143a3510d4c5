"""Run data: local files, the embedded task, column detection and mapping onto TRL's roles."""

from __future__ import annotations

import csv
import json

import pytest

from fasttune.run import data as run_data
from fasttune.run.config import RunConfig


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_read_rows_reads_every_supported_file_kind(tmp_path):
    rows = [{"q": f"question {i}", "a": f"answer {i}"} for i in range(7)]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "array.json").write_text(json.dumps(rows))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}))
    _write_jsonl(tmp_path / "lines.json", rows)  # JSON lines in a .json file, as datasets accepts
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["q", "a"])
        w.writeheader()
        w.writerows(rows)
    for name in ("d.jsonl", "array.json", "wrapped.json", "lines.json", "d.csv"):
        assert run_data.read_rows(tmp_path / name) == rows, name
        assert run_data.read_rows(tmp_path / name, limit=3) == rows[:3], name
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        run_data.read_rows(tmp_path / "bad.jsonl")


def test_embedded_rows_per_trainer():
    sft = run_data.embedded_rows("sft", 5, seed=1)
    dpo = run_data.embedded_rows("dpo", 5, seed=1)
    assert set(sft[0]) == {"prompt", "completion"} and set(dpo[0]) == {"prompt", "chosen", "rejected"}
    for s, d in zip(sft, dpo, strict=True):
        word = s["prompt"].removesuffix(" =")
        assert d["chosen"] == s["completion"] != d["rejected"] == " " + word
    assert run_data.available_columns("embedded", "dpo") == ["prompt", "chosen", "rejected"]


@pytest.mark.parametrize("trainer, columns, expected", [
    ("sft", ["id", "prompt", "completion", "text"], {"prompt": "prompt", "completion": "completion"}),
    ("sft", ["id", "messages"], {"messages": "messages"}),
    ("sft", ["text"], {"text": "text"}),
    ("dpo", ["prompt", "chosen", "rejected", "score"],
     {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}),
    ("dpo", ["chosen", "rejected"], {"chosen": "chosen", "rejected": "rejected"}),
])
def test_formats_are_detected_from_column_names(trainer, columns, expected):
    assert run_data.resolve_columns(trainer, {}, columns) == expected


def test_column_errors_name_the_role_and_the_columns():
    assert run_data.column_errors("sft", {"prompt": "q", "completion": "x"}, ["q", "a"]) == [
        "data.columns.completion: column 'x' is not in the dataset; columns: q, a"]
    [msg] = run_data.column_errors("dpo", {}, ["q", "good", "bad"])
    assert msg.startswith("data.columns: the dataset's columns (q, good, bad) hold no dpo format "
                          "(prompt+chosen+rejected or chosen+rejected)")
    with pytest.raises(ValueError, match="hold no sft format"):
        run_data.resolve_columns("sft", {}, ["q", "a"])


def test_load_train_dataset_renames_selects_and_limits(tmp_path):
    rows = [{"id": i, "q": f"q{i}", "good": f"g{i}", "bad": f"b{i}"} for i in range(9)]
    path = _write_jsonl(tmp_path / "prefs.jsonl", rows)
    columns = {"prompt": "q", "chosen": "good", "rejected": "bad"}
    cfg = RunConfig.from_dict({"trainer": "dpo", "data": {"dataset": str(path), "max_samples": 4, "columns": columns}})
    ds = run_data.load_train_dataset(cfg)
    assert ds.column_names == ["prompt", "chosen", "rejected"] and len(ds) == 4
    assert ds[3] == {"prompt": "q3", "chosen": "g3", "rejected": "b3"}
    cfg = RunConfig.from_dict({"data": {"max_samples": 12}, "training": {"seed": 3}})
    ds = run_data.load_train_dataset(cfg)
    assert len(ds) == 12 and ds.column_names == ["prompt", "completion"]
    assert ds[0] == run_data.embedded_rows("sft", 1, seed=3)[0]


def test_load_train_dataset_rejects_a_missing_column(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "a": "y"}])
    cfg = RunConfig.from_dict({"data": {"dataset": str(path), "columns": {"prompt": "q", "completion": "answer"}}})
    with pytest.raises(ValueError, match="column 'answer' is not in the dataset; columns: q, a"):
        run_data.load_train_dataset(cfg)


def test_eval_data_from_a_file_a_held_out_share_or_the_embedded_task(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(20)]
    train_file, eval_file = _write_jsonl(tmp_path / "t.jsonl", rows), _write_jsonl(tmp_path / "e.jsonl", rows[:3])
    cfg = RunConfig.from_dict({"data": {"dataset": str(train_file)}})
    train = run_data.load_train_dataset(cfg)
    assert run_data.load_eval_dataset(cfg, train) == (train, None)
    cfg = RunConfig.from_dict({"data": {"dataset": str(train_file), "eval_dataset": str(eval_file)}})
    same, held = run_data.load_eval_dataset(cfg, train)
    assert same is train and held[:] == {"prompt": ["p0", "p1", "p2"], "completion": [" c0", " c1", " c2"]}
    for size, n_eval in ((0.25, 5), (4, 4)):
        cfg = RunConfig.from_dict({"data": {"dataset": str(train_file), "eval_size": size}})
        kept, held = run_data.load_eval_dataset(cfg, train)
        assert (len(kept), len(held)) == (20 - n_eval, n_eval)
        assert not set(kept["prompt"]) & set(held["prompt"])  # held out: never trained on
    cfg = RunConfig.from_dict({"data": {"dataset": str(train_file), "eval_size": 20}})
    with pytest.raises(run_data.DataError, match="would leave none of 20 to train on"):
        run_data.load_eval_dataset(cfg, train)
    cfg = RunConfig.from_dict({"data": {"eval_dataset": "embedded", "max_samples": 50}})
    train = run_data.load_train_dataset(cfg)
    _, held = run_data.load_eval_dataset(cfg, train)
    assert len(held) == run_data.EMBEDDED_EVAL_ROWS and held.column_names == ["prompt", "completion"]
    assert len(set(held["prompt"]) & set(train["prompt"])) < len(held) / 10  # another seed: other words, nearly all


def test_a_malformed_line_after_the_preview_names_file_and_line(tmp_path):
    lines = [json.dumps({"prompt": f"p{i}", "completion": f" c{i}"}) for i in range(60)]
    lines[56] = '{"prompt": "p56", "completion": " c56"'  # line 57: the closing brace is missing
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert len(run_data.preview_rows(str(path), "sft", 20)) == 20  # the preview (and check_sources) sees no problem
    cfg = RunConfig.from_dict({"data": {"dataset": str(path)}})
    with pytest.raises(run_data.DataError, match=rf"^{path} line 57: not valid JSON \(Expecting ',' delimiter"):
        run_data.load_train_dataset(cfg)


def test_an_empty_completion_column_stops_the_run(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": "" if i % 2 else "  "} for i in range(30)]
    cfg = RunConfig.from_dict({"data": {"dataset": str(_write_jsonl(tmp_path / "d.jsonl", rows))}})
    with pytest.raises(run_data.DataError, match="every 'completion' value is empty \\(30 rows\\): the model "
                                                 "would learn nothing"):
        run_data.load_train_dataset(cfg)
