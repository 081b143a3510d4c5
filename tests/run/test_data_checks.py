"""Data checked row by row: each problem names the file and the line (or row)."""

from __future__ import annotations

import json
import logging

import pytest
from datasets import Dataset

from fasttune.run.data_checks import DataError, Rows, check_rows, locate_load_error


def _lines(path, rows: list, blank_at: int | None = None):
    text = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    if blank_at is not None:
        text.insert(blank_at, "")
    path.write_text("\n".join(text) + "\n")
    return path


@pytest.mark.parametrize("bad, expected", [
    ('{"prompt": "p", "completion": "c"', "line 58: not valid JSON (Expecting ',' delimiter, column 34)"),
    ('["p", "c"]', "line 58: expected a JSON object, got a list"),
    ('{"prompt": "p", "completion": 7}', "line 58: 'completion' is a number here but text in "),
    (b"\xff\xfe{}".decode("latin-1"), "line 58: not valid JSON"),
], ids=["syntax", "not-object", "type-change", "garbage"])
def test_locate_load_error_names_the_line(tmp_path, bad, expected):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(60)]
    rows[56] = bad
    path = _lines(tmp_path / "d.jsonl", rows, blank_at=10)  # a blank line: line numbers, not row numbers
    err = locate_load_error(path, RuntimeError("An error occurred while generating the dataset"))
    assert isinstance(err, DataError) and str(err).startswith(f"{path} {expected}")


def test_locate_load_error_in_a_json_array_and_else_the_root_cause(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[{"prompt": "p", "completion": "c"},\n {"prompt": "q" "completion": "d"}]')
    assert str(locate_load_error(path, RuntimeError())).startswith(f"{path} line 2: not valid JSON")
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n1,2\n")
    try:
        try:
            raise ValueError("Error tokenizing data. C error: Expected 2 fields in line 3, saw 3")
        except ValueError as e:
            raise RuntimeError("An error occurred while generating the dataset") from e
    except RuntimeError as e:
        err = locate_load_error(csv, e)
    assert str(err) == f"{csv}: could not be read as csv data: ValueError: Error tokenizing data. C error: " \
                       "Expected 2 fields in line 3, saw 3"


def test_rows_are_named_by_line_in_json_lines_and_by_row_elsewhere(tmp_path):
    path = _lines(tmp_path / "d.jsonl", [{"a": 1}, {"a": 2}], blank_at=1)
    assert Rows(str(path), local=True).name(1) == f"{path} line 3"
    assert Rows("org/data (train)", local=False).name(4) == "org/data (train) row 5"


def test_missing_and_non_text_values_stop_the_run_naming_the_row(tmp_path):
    path = _lines(tmp_path / "d.jsonl", [{"q": "a", "c": "b"}] * 3)
    ds = Dataset.from_list([{"q": "a", "c": "b"}, {"q": "a", "c": None}, {"q": "a", "c": "b"}])
    with pytest.raises(DataError, match=rf"^{path} line 2: 'c' is missing$"):
        check_rows(ds, "sft", {"prompt": "q", "completion": "c"}, Rows(str(path), local=True))
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"content": "x"}]}])
    with pytest.raises(DataError, match="row 2: 'messages' is not a list of chat turns"):
        check_rows(ds, "sft", {"messages": "messages"}, Rows("chat", local=False))


def test_empty_targets_warn_when_some_and_stop_when_all(caplog):
    caplog.set_level(logging.WARNING, logger="fasttune.runner")
    rows = [{"prompt": f"p{i}", "completion": "" if i in (3, 5, 7, 9, 11) else f" c{i}"} for i in range(20)]
    warnings = check_rows(Dataset.from_list(rows), "sft", {"prompt": "prompt", "completion": "completion"},
                          Rows("d", local=False))
    assert warnings == ["d: 5 of 20 rows have an empty 'completion' value (row 4, row 6, row 8 and 2 more); "
                        "they teach nothing"] and warnings[0] in caplog.text
    chats = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}] * 4
    with pytest.raises(DataError, match="every assistant turn is empty \\(4 rows\\)"):
        check_rows(Dataset.from_list(chats), "sft", {"messages": "messages"}, Rows("chat.jsonl", local=False))
    prefs = [{"prompt": "p", "chosen": "", "rejected": "r"}] * 3
    with pytest.raises(DataError, match="every 'chosen' value is empty"):
        check_rows(Dataset.from_list(prefs), "dpo", {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
                   Rows("p", local=False))
    prompts_empty = [{"prompt": "", "completion": " c"}] * 3  # an empty prompt teaches the completion still
    assert check_rows(Dataset.from_list(prompts_empty), "sft", {"prompt": "prompt", "completion": "completion"},
                      Rows("p", local=False)) == []
