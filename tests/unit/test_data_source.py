"""The built-in data source: formats, keys, and errors that name file and line."""

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime.data.source import DataError, DataKeys, DatasetCursor, PromptDataset

KEYS = DataKeys("prompt", "label", "metadata")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_records(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "1=", "label": "2", "metadata": {"source_name": "a"}},
            {"prompt": [{"role": "user", "content": "hi"}], "label": "x"},
        ],
    )
    data = PromptDataset.load(path, KEYS)
    assert len(data) == 2
    assert data[0].prompt == "1=" and data[0].label == "2" and data[0].metadata == {"source_name": "a"}
    assert data[1].metadata == {}


def test_parquet_and_fsspec_memory(tmp_path):
    table = pa.table({"prompt": ["a", "b", "c"], "label": ["1", "2", "3"]})
    pq.write_table(table, tmp_path / "d.parquet")
    assert [r.label for r in PromptDataset.load(str(tmp_path / "d.parquet"), KEYS).records] == ["1", "2", "3"]
    with fsspec.open("memory://vime/d.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "p", "label": "l"}) + "\n")
    assert PromptDataset.load("memory://vime/d.jsonl", KEYS)[0].prompt == "p"


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "label": "b"}, '{"prompt": "x", ', {"prompt": "c"}])
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: malformed JSON"):
        PromptDataset.load(path, KEYS)


def test_missing_input_key_names_the_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "b"}, {"question": "c", "label": "d"}])
    with pytest.raises(DataError, match=r"line 2: record has no field 'prompt' \(--input-key\)"):
        PromptDataset.load(path, KEYS)


def test_missing_label_and_bad_types(tmp_path):
    with pytest.raises(DataError, match=r"--label-key"):
        PromptDataset.load(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}]), KEYS)
    with pytest.raises(DataError, match=r"must be a string or a list of chat messages"):
        PromptDataset.load(write_jsonl(tmp_path / "b.jsonl", [{"prompt": 3, "label": "x"}]), KEYS)
    with pytest.raises(DataError, match=r"no such file"):
        PromptDataset.load(str(tmp_path / "missing.jsonl"), KEYS)


def test_cursor_walks_epochs_deterministically(tmp_path):
    data = PromptDataset.load(
        write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i), "label": ""} for i in range(5)]), KEYS
    )
    cursor = DatasetCursor()
    first = cursor.take(data, 7, seed=3, shuffle=True)
    assert [e for e, _ in first] == [0] * 5 + [1] * 2
    assert sorted(r for e, r in first if e == 0) == list(range(5))
    again = DatasetCursor().take(data, 7, seed=3, shuffle=True)
    assert again == first
    assert (cursor.epoch, cursor.offset) == (1, 2)
    bounded = DatasetCursor()
    assert len(bounded.take(data, 100, seed=0, shuffle=False, num_epoch=2)) == 10
    assert bounded.take(data, 1, seed=0, shuffle=False, num_epoch=2) == []
